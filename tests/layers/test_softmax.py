"""Softmax: float32 under every policy vs a float64 reference; stock rounds logits near 1e4."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.layers import Softmax
from tests.helpers import MIXED, np64, softmax


def _logits():
    # Rows near +1e4 and -1e4 whose differences (|d| <= 3) are below float16's
    # spacing there (8) and bfloat16's (64): all a softmax sees is rounded away.
    rng = np.random.default_rng(0)
    offsets = rng.uniform(-3, 3, size=(4, 6))
    centre = np.array([1e4, -1e4, 1e4, -1e4])[:, None]
    return (centre + offsets).astype("float32")


def test_matches_float64_reference(policy):
    x = _logits()
    y = Softmax()(x)
    assert y.dtype == tf.float32
    # float32 end to end: x - max is exact, exp/sum errors are a few float32 ulps.
    np.testing.assert_allclose(np64(y), softmax(np64(x)), atol=1e-6)


@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_stock_loses_accuracy_ours_holds(p):
    keras.config.set_dtype_policy(p)
    x = _logits()
    cdt = keras.dtype_policies.get(p).compute_dtype
    # guard: the logits really collapse when rounded to the compute dtype
    assert np.ptp(np64(keras.ops.cast(x[0], cdt))) < np.ptp(x[0]) / 2 or cdt == "float16"
    ref = softmax(np64(x))
    stock_err = np.abs(np64(keras.layers.Softmax()(x)) - ref).max()
    ours_err = np.abs(np64(Softmax()(x)) - ref).max()
    assert stock_err > 0.05, stock_err
    assert ours_err < 1e-6, ours_err


def test_output_dtype_argument(policy):
    cdt = keras.dtype_policies.get(policy).compute_dtype
    x = _logits()
    assert keras.backend.standardize_dtype(Softmax(output_dtype="compute")(x).dtype) == cdt
    assert Softmax(output_dtype="float64")(x).dtype == tf.float64
    assert Softmax()(keras.Input((6,))).dtype == "float32"
    assert Softmax(output_dtype="compute")(keras.Input((6,))).dtype == cdt


def test_mask_and_multi_axis(policy):
    x = _logits().reshape(4, 2, 3)
    mask = np.ones((4, 2, 3), bool)
    mask[:, :, 0] = False
    y = np64(Softmax(axis=-1)(x, mask=mask))
    ref = softmax(np.where(mask, np64(x), -np.inf))
    np.testing.assert_allclose(y, ref, atol=1e-6)
    y2 = np64(Softmax(axis=(1, 2))(x))
    ref2 = np.exp(np64(x) - np64(x).max(axis=(1, 2), keepdims=True))
    np.testing.assert_allclose(y2, ref2 / ref2.sum(axis=(1, 2), keepdims=True), atol=1e-6)


def test_gradients_match_float32(mixed_policy):
    x = tf.constant(_logits() / 1e3)  # moderate logits so the Jacobian is not 0
    w = tf.constant(np.random.default_rng(1).standard_normal((4, 6)), tf.float32)
    grads = {}
    for p in ("float32", mixed_policy):
        layer = Softmax(dtype=p)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x) * w)
        grads[p] = tape.gradient(loss, x)
    # float32 forward and backward whatever the policy: same gradient.
    np.testing.assert_allclose(np64(grads[mixed_policy]), np64(grads["float32"]), atol=1e-6)


def test_isinstance_and_invalid_arguments():
    assert isinstance(Softmax(), keras.layers.Softmax)
    with pytest.raises(ValueError, match="output_dtype"):
        Softmax(output_dtype="int32")
    with pytest.raises(TypeError, match="output_dtype"):
        Softmax(output_dtype=3)

"""Normalisation layers: float32 statistics vs float64 references; stock BN/RMS round their inputs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.layers import (
    BatchNormalization,
    GroupNormalization,
    LayerNormalization,
    RMSNormalization,
)
from tests.helpers import MIXED, np64, u

EPS = 1e-3


def _x(centre=1e4, scale=100.0):
    rng = np.random.default_rng(0)
    return (centre + scale * rng.standard_normal((4, 3, 8))).astype("float32")


def ref_layer_norm(x):
    m, v = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - m) / np.sqrt(v + EPS)


def ref_batch_norm(x, mask=None):
    w = np.ones(x.shape[:-1] + (1,)) if mask is None else mask[..., None].astype(float)
    m = (x * w).sum((0, 1), keepdims=True) / w.sum((0, 1), keepdims=True)
    v = (w * (x - m) ** 2).sum((0, 1), keepdims=True) / w.sum((0, 1), keepdims=True)
    return (x - m) / np.sqrt(v + EPS), m.ravel(), v.ravel()


def ref_group_norm(x, groups=2):
    g = x.reshape(x.shape[:-1] + (groups, -1))
    m, v = g.mean((1, 3), keepdims=True), g.var((1, 3), keepdims=True)
    return ((g - m) / np.sqrt(v + EPS)).reshape(x.shape)


def ref_rms_norm(x):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + EPS)


CASES = {
    "LayerNormalization": (LayerNormalization, dict(epsilon=EPS), ref_layer_norm),
    "BatchNormalization": (BatchNormalization, dict(epsilon=EPS), lambda x: ref_batch_norm(x)[0]),
    "GroupNormalization": (GroupNormalization, dict(groups=2, epsilon=EPS), ref_group_norm),
    "RMSNormalization": (RMSNormalization, dict(epsilon=EPS), ref_rms_norm),
}


def _call(layer, x, **kwargs):
    if isinstance(layer, keras.layers.BatchNormalization):
        kwargs.setdefault("training", True)
    return layer(x, **kwargs)


def _tol(policy_name):
    # float32 statistics of values near 1e4 with std 100: x - mean carries
    # ~1e4 * 2**-24 / 100 relative error; the output cast adds u(compute).
    return 4e-5 + 2 * u(policy_name) * 3.5  # outputs are within |3.5|


@pytest.mark.parametrize("name", CASES, ids=lambda n: n)
def test_matches_float64_reference(policy, name):
    cls, kwargs, ref = CASES[name]
    x = _x()
    y = _call(cls(**kwargs), x)
    assert keras.backend.standardize_dtype(y.dtype) == keras.dtype_policies.get(policy).compute_dtype
    np.testing.assert_allclose(np64(y), ref(np64(x)), atol=_tol(policy))


@pytest.mark.parametrize("name", CASES, ids=lambda n: n)
@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_stock_versus_ours(p, name):
    """float16: inputs above 65504 (x ~ 7e4). bfloat16: inputs near 1e4 with std 100."""
    keras.config.set_dtype_policy(p)
    cls, kwargs, ref = CASES[name]
    x = _x(centre=7e4) if p == "mixed_float16" else _x()
    stock_cls = getattr(keras.layers, name)
    expected = ref(np64(x))
    stock_err = np.abs(np64(_call(stock_cls(**kwargs), x)) - expected).max()
    ours_err = np.abs(np64(_call(cls(**kwargs), x)) - expected).max()
    assert ours_err < _tol(p), ours_err
    if name == "BatchNormalization" or (name == "RMSNormalization" and p == "mixed_float16"):
        # Stock autocasts these layers' inputs: 7e4 is inf in float16; bfloat16
        # rounds 1e4 + 100 * N(0, 1) to multiples of 64 before BN centres it.
        assert not (stock_err < 0.05), stock_err  # NaN counts as failure
    else:
        # Stock LayerNormalization/GroupNormalization already skip input autocast
        # and upcast internally (Keras 3.15.1), and RMS normalisation has no
        # centring, so bfloat16 input rounding is a relative error ~u, like the
        # output cast: stock holds here too.
        assert stock_err < _tol(p), stock_err


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_batch_norm_training_inference_and_moving_stats(policy, masked):
    x = _x()
    mask = np.random.default_rng(2).uniform(size=x.shape[:-1]) > 0.3 if masked else None
    layer = BatchNormalization(epsilon=EPS, momentum=0.0)
    y = layer(x, training=True, mask=mask)
    expected, mean, var = ref_batch_norm(np64(x), mask)
    rows = np.ones(x.shape[:-1], bool) if mask is None else mask
    np.testing.assert_allclose(np64(y)[rows], expected[rows], atol=_tol(policy))
    # momentum=0: the moving statistics are this batch's, kept in float32.
    assert layer.moving_mean.dtype == "float32"
    np.testing.assert_allclose(np64(layer.moving_mean), mean, rtol=1e-6)
    np.testing.assert_allclose(np64(layer.moving_variance), var, rtol=1e-4)
    # Inference uses them: the same normalisation.
    y_inf = layer(x, training=False, mask=mask)
    np.testing.assert_allclose(np64(y_inf)[rows], expected[rows], atol=_tol(policy))


@pytest.mark.parametrize("name", CASES, ids=lambda n: n)
def test_variables_float32_and_isinstance(mixed_policy, name):
    cls, kwargs, _ = CASES[name]
    layer = cls(**kwargs)
    _call(layer, _x())
    assert isinstance(layer, getattr(keras.layers, name))
    assert layer.weights and all(w.dtype == "float32" for w in layer.weights)


@pytest.mark.parametrize("name", CASES, ids=lambda n: n)
def test_gradients_match_float32(mixed_policy, name):
    cls, kwargs, _ = CASES[name]
    x = tf.constant(_x(centre=0.0, scale=1e2))
    w = tf.constant(np.random.default_rng(1).standard_normal(x.shape), tf.float32)
    grads = {}
    for p in ("float32", mixed_policy):
        layer = cls(dtype=p, **kwargs)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.cast(_call(layer, x), tf.float32) * w)
        grads[p] = tape.gradient(loss, [x] + layer.trainable_variables)
    for g32, gm in zip(grads["float32"], grads[mixed_policy]):
        scale = np.abs(np64(g32)).max()
        # Only the output cast (and the incoming gradient's cast) is in the compute dtype.
        np.testing.assert_allclose(np64(gm), np64(g32), atol=4 * u(mixed_policy) * scale)


@pytest.mark.parametrize("name", CASES, ids=lambda n: n)
def test_integer_inputs_computed_in_float32(policy, name):
    """Integer inputs are cast to float32 first; stock LN/RMS compute in integer arithmetic."""
    cls, kwargs, ref = CASES[name]
    x = np.array([[[1, 2, 3, 4], [-1, 0, 0, 1]]] * 2, dtype="int64")  # (2, 2, 4)
    y = _call(cls(**kwargs), x)
    assert keras.backend.standardize_dtype(y.dtype) == keras.dtype_policies.get(policy).compute_dtype
    expected = ref(x.astype(np.float64))
    # Outputs within 2: float32 statistics, one rounding to the compute dtype.
    np.testing.assert_allclose(np64(y), expected, atol=1e-5 + 2 * u(policy) * 2)
    if name == "LayerNormalization":
        # Closed form: (x - 2.5) / sqrt(1.25 + epsilon).
        closed = (np.arange(1, 5) - 2.5) / np.sqrt(1.25 + EPS)
        np.testing.assert_allclose(np64(y)[0, 0], closed, atol=1e-5 + 2 * u(policy) * 2)
    if name in ("LayerNormalization", "RMSNormalization"):
        stock = np64(_call(getattr(keras.layers, name)(**kwargs), x))
        assert np.abs(stock - expected).max() > 0.3  # guard: stock returns the integers unnormalised

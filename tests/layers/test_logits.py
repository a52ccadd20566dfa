"""Logits: 16-bit matmul with float32 accumulation and a float32 result; stock Dense rounds or overflows."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.layers.logits import Logits
from tests.helpers import MIXED, compute_dtype, np64, u


def _rounded(x, dtype):
    """float64 copy of x after rounding to `dtype` (what the 16-bit matmul multiplies)."""
    return np64(keras.ops.cast(keras.ops.cast(x, dtype), "float32"))


def _setup(scale=1.0):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 32)).astype("float32")
    kernel = (scale * rng.standard_normal((32, 40))).astype("float32")
    bias = rng.standard_normal(40).astype("float32")
    return x, kernel, bias


def _layer(cls, x, kernel, bias, **kwargs):
    layer = cls(kernel.shape[1], **kwargs)
    layer.build(x.shape)
    layer.set_weights([kernel, bias])
    return layer


def test_matches_float64_reference_of_the_16_bit_operands(policy):
    x, kernel, bias = _setup()
    layer = _layer(Logits, x, kernel, bias)
    y = layer(x)
    assert y.dtype == tf.float32
    low = compute_dtype(policy)
    ref = _rounded(x, low) @ _rounded(kernel, low) + np64(bias)
    # float32 accumulation of 32 exact products: a few float32 ulps of the largest partial sums.
    np.testing.assert_allclose(np64(y), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_stock_dense_rounds_logits_ours_does_not(p):
    keras.config.set_dtype_policy(p)
    x, kernel, bias = _setup(scale=30.0)  # logits ~ 30 * sqrt(32) ~ 170
    stock = _layer(keras.layers.Dense, x, kernel, bias)
    ours = _layer(Logits, x, kernel, bias)
    low = compute_dtype(p)
    ref = _rounded(x, low) @ _rounded(kernel, low) + np64(bias)
    stock_err = np.abs(np64(stock(x)) - ref).max()
    ours_err = np.abs(np64(ours(x)) - ref).max()
    assert np.abs(ref).max() > 300  # guard: logits large enough to show the rounding
    assert stock_err > 0.25 * u(p) * np.abs(ref).max()  # rounded to the compute dtype
    assert ours_err < 1e-4


def test_float16_logits_beyond_float16_range_stay_finite():
    keras.config.set_dtype_policy("mixed_float16")
    x, kernel, bias = _setup(scale=6000.0)
    stock = _layer(keras.layers.Dense, x, kernel, bias)
    ours = _layer(Logits, x, kernel, bias)
    ref = _rounded(x, "float16") @ _rounded(kernel, "float16") + np64(bias)
    assert np.abs(ref).max() > 65504  # guard: beyond float16's largest finite value
    assert not np.all(np.isfinite(np64(stock(x))))
    np.testing.assert_allclose(np64(ours(x)), ref, rtol=1e-6, atol=1e-2)


@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_gradients_match_float64_reference(p):
    keras.config.set_dtype_policy(p)
    x, kernel, bias = _setup()
    layer = _layer(Logits, x, kernel, bias)
    upstream = np.random.default_rng(1).standard_normal((3, 5, 40)).astype("float32")
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        loss = tf.reduce_sum(layer(xt) * upstream)
    d_x, d_kernel, d_bias = tape.gradient(loss, [xt, layer.kernel.value, layer.bias.value])
    low = compute_dtype(p)
    g = _rounded(upstream, low)
    ref_kernel = np.einsum("btd,btv->dv", _rounded(x, low), g)
    ref_x = np.einsum("btv,dv->btd", g, _rounded(kernel, low))
    assert d_kernel.dtype == tf.float32 and d_bias.dtype == tf.float32
    # d(kernel), d(x): 16-bit matmuls as in stock Dense (float32 accumulation, one rounding).
    np.testing.assert_allclose(np64(d_kernel), ref_kernel, rtol=2 * u(p), atol=1e-3)
    np.testing.assert_allclose(np64(d_x), ref_x, rtol=4 * u(p), atol=4 * u(p) * np.abs(ref_x).max())
    np.testing.assert_allclose(np64(d_bias), upstream.sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)


def test_float32_policy_is_plain_dense():
    x, kernel, bias = _setup()
    ours = _layer(Logits, x, kernel, bias)
    stock = _layer(keras.layers.Dense, x, kernel, bias)
    np.testing.assert_array_equal(ours(x).numpy(), stock(x).numpy())


def test_functional_output_spec_is_float32_and_keras_round_trip(tmp_path, mixed_policy):
    inputs = keras.Input((5, 32))
    model = keras.Model(inputs, Logits(40, activation="softmax", name="lm_head")(inputs))
    assert model.outputs[0].dtype == "float32"
    x = _setup()[0]
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy())
    history = model.fit(x, np.zeros((3, 5)), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    path = tmp_path / "logits.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.get_layer("lm_head")) is Logits
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())

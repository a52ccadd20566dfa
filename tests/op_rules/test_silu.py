"""keras_amp.op_rules.silu: silu on a gradient freed with its graph; 16-bit passes as XLA computations.

With keras_amp's XLA kernels off (and for float32 inputs) the rule is TensorFlow's silu op for op;
with them on, a 16-bit silu's backward pass (and its forward pass, except bfloat16 where oneDNN runs
it natively) is float32 arithmetic rounded once, checked against float64 here.
"""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.numerics import islands

pytestmark = [pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning"),
              pytest.mark.usefixtures("no_op_rules")]

# One rounding to the 16-bit type, relative (half an ulp), and an absolute floor: half of float16's
# subnormal spacing; for bfloat16 the smallest normal (TensorFlow's CPU threads flush denormals to zero).
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
TINY = {"bfloat16": 2.0**-126, "float16": 2.0**-25}


def _value_and_gradient(x, upstream):
    @tf.function
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = keras.ops.silu(x)
        return y, tape.gradient(y, x, output_gradients=upstream)

    return [t.numpy() for t in f(x)]


def _inputs(dtype):
    rng = np.random.default_rng(0)
    return tf.cast(rng.standard_normal(4096) * 6, dtype), tf.cast(rng.standard_normal(4096), dtype)


def _reference(x, upstream):
    """silu and its gradient in float64."""
    x64, dy64 = (np.asarray(tf.cast(t, tf.float64)) for t in (x, upstream))
    s = 1 / (1 + np.exp(-x64))
    return x64 * s, dy64 * s * (1 + x64 * (1 - s))


def _one_rounding(got, want, dtype):
    """Whether every element of `got` is within one rounding of `want` to `dtype` (plus float32 error)."""
    got = got.astype(np.float64)
    return np.all(np.abs(got - want) <= np.abs(want) * (HALF_ULP[dtype] + 2.0**-20) + TINY[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_without_xla_kernels_values_and_gradients_are_tensorflows_bit_for_bit(dtype):
    x, upstream = _inputs(dtype)
    stock = _value_and_gradient(x, upstream)
    keras_amp.enable("mixed_bfloat16", xla_scores=False)
    ours = _value_and_gradient(x, upstream)
    for a, b in zip(stock, ours):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    # Guard: both match float64's silu and derivative to the dtype's rounding.
    value, gradient = _reference(x, upstream)
    tol = {"float32": 1e-6, "bfloat16": 2e-2, "float16": 2e-3}[dtype]
    np.testing.assert_allclose(ours[0].astype(np.float64), value, rtol=tol, atol=tol)
    np.testing.assert_allclose(ours[1].astype(np.float64), gradient, rtol=4 * tol, atol=4 * tol)


def test_float32_inputs_stay_tensorflows_with_xla_kernels():
    x, upstream = _inputs("float32")
    stock = _value_and_gradient(x, upstream)
    keras_amp.enable("mixed_bfloat16")
    for a, b in zip(stock, _value_and_gradient(x, upstream)):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("native_bfloat16", [True, False], ids=["onednn_bfloat16", "no_onednn_bfloat16"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_gradient_is_one_rounding_of_float64_where_tensorflows_is_not(dtype, native_bfloat16, monkeypatch):
    monkeypatch.setattr(islands, "native_bfloat16_cpu", lambda: native_bfloat16)
    x, upstream = _inputs(dtype)
    value, gradient = _reference(x, upstream)
    stock = _value_and_gradient(x, upstream)
    assert not _one_rounding(stock[1], gradient, dtype)  # six 16-bit ops, each rounded
    keras_amp.enable("mixed_bfloat16")
    ours = _value_and_gradient(x, upstream)
    assert ours[0].dtype == stock[0].dtype and ours[1].dtype == stock[1].dtype
    assert _one_rounding(ours[1], gradient, dtype)
    if dtype == "bfloat16" and native_bfloat16:  # TensorFlow's forward ops, faster there
        np.testing.assert_array_equal(stock[0].view(np.uint8), ours[0].view(np.uint8))
    else:  # one XLA computation, rounded once (TensorFlow's two ops round twice, unless oneDNN fuses them)
        assert _one_rounding(ours[0], value, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_extremes_are_finite_and_one_rounding(dtype):
    big = float(tf.as_dtype(dtype).max)
    x = tf.constant([-big, -1e4, -100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, 1e4, big], dtype)
    upstream = tf.ones_like(x)
    keras_amp.enable("mixed_bfloat16")
    value, gradient = _reference(x, upstream)
    ours = _value_and_gradient(x, upstream)
    assert np.all(np.isfinite(ours[0].astype(np.float64))) and np.all(np.isfinite(ours[1].astype(np.float64)))
    assert _one_rounding(ours[0], value, dtype) and _one_rounding(ours[1], gradient, dtype)


def test_a_dense_silu_layer_trains_the_same_within_rounding():
    # The rule inside a model: a bfloat16 Dense with silu, gradients against float64 from the same weights.
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(64, activation="silu")
    x = np.random.default_rng(1).standard_normal((32, 16)).astype("float32")

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(tf.cast(layer(x), tf.float32))
        return tape.gradient(y, layer.trainable_variables)

    d_kernel, d_bias = (g.numpy() for g in grads())
    kernel16, bias16 = (np.asarray(tf.cast(tf.cast(v, tf.bfloat16), tf.float64)) for v in layer.trainable_variables)
    z = np.asarray(tf.cast(tf.cast(x, tf.bfloat16), tf.float64)) @ kernel16 + bias16
    s = 1 / (1 + np.exp(-z))
    dz = s * (1 + z * (1 - s))
    # The pre-activation is the bfloat16 matmul's (one rounding of z), then one rounding of the slope:
    # the gradients are sums of 32 rows of those, each within a few bfloat16 ulps.
    np.testing.assert_allclose(d_bias, dz.sum(0), rtol=0.05, atol=0.05)
    np.testing.assert_allclose(d_kernel, np.asarray(tf.cast(tf.cast(x, tf.bfloat16), tf.float64)).T @ dz,
                               rtol=0.05, atol=0.15)


def _traced_graph_survives(dtype) -> bool:
    """Traces a function whose gradient goes through silu; whether its graph outlives it."""
    variable = tf.Variable(tf.ones((4,)))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(tf.cast(keras.ops.silu(tf.cast(variable * 2.0, dtype)), tf.float32))
        return tape.gradient(y, variable)

    graph = weakref.ref(step.get_concrete_function().graph)
    del step
    gc.collect()
    return graph() is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_traced_graph_is_freed_with_the_rule_and_kept_forever_without(dtype):
    assert _traced_graph_survives(dtype)  # TensorFlow's tf.custom_gradient: registered, never freed
    keras_amp.enable("mixed_bfloat16")
    assert not _traced_graph_survives(dtype)


def test_eager_calls_are_tensorflows():
    keras_amp.enable("mixed_bfloat16")
    x = tf.constant([-3.0, 0.5, 4.0])
    np.testing.assert_array_equal(keras.ops.silu(x).numpy(), tf.nn.silu(x).numpy())

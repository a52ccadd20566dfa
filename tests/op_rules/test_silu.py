"""keras_amp.op_rules.silu: TensorFlow's silu, op for op, on a gradient freed with its graph."""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp

pytestmark = [pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning"),
              pytest.mark.usefixtures("no_op_rules")]


def _value_and_gradient(x, upstream):
    @tf.function
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = keras.ops.silu(x)
        return y, tape.gradient(y, x, output_gradients=upstream)

    return [t.numpy() for t in f(x)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_values_and_gradients_are_tensorflows_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    x = tf.cast(rng.standard_normal(4096) * 6, dtype)
    upstream = tf.cast(rng.standard_normal(4096), dtype)
    stock = _value_and_gradient(x, upstream)
    keras_amp.enable("mixed_bfloat16")
    ours = _value_and_gradient(x, upstream)
    for a, b in zip(stock, ours):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    # Guard: both match float64's silu and derivative to the dtype's rounding.
    x64 = np.asarray(tf.cast(x, tf.float64))
    s = 1 / (1 + np.exp(-x64))
    tol = {"float32": 1e-6, "bfloat16": 2e-2, "float16": 2e-3}[dtype]
    np.testing.assert_allclose(ours[0].astype(np.float64), x64 * s, rtol=tol, atol=tol)
    slope = s * (1 + x64 * (1 - s))
    np.testing.assert_allclose(ours[1].astype(np.float64), np.asarray(tf.cast(upstream, tf.float64)) * slope,
                               rtol=4 * tol, atol=4 * tol)


def _traced_graph_survives() -> bool:
    """Traces a function whose gradient goes through silu; whether its graph outlives it."""
    variable = tf.Variable(tf.ones((4,)))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(keras.ops.silu(variable * 2.0))
        return tape.gradient(y, variable)

    graph = weakref.ref(step.get_concrete_function().graph)
    del step
    gc.collect()
    return graph() is not None


def test_a_traced_graph_is_freed_with_the_rule_and_kept_forever_without():
    assert _traced_graph_survives()  # TensorFlow's tf.custom_gradient: registered, never freed
    keras_amp.enable("mixed_bfloat16")
    assert not _traced_graph_survives()


def test_eager_calls_are_tensorflows():
    keras_amp.enable("mixed_bfloat16")
    x = tf.constant([-3.0, 0.5, 4.0])
    np.testing.assert_array_equal(keras.ops.silu(x).numpy(), tf.nn.silu(x).numpy())

"""silu's derivative and the XLA forward and backward (`keras_amp.numerics.silu`), against float64.

The rule that uses them (`op_rules.silu`) is checked inside graphs and models in
tests/op_rules/test_silu.py; here the computations are called directly.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_amp.numerics import silu

# One rounding to the 16-bit type, relative (half an ulp), plus float32's error of the formula.
HALF_ULP = {tf.bfloat16: 2.0**-8, tf.float16: 2.0**-11}
FLOAT32_ERROR = 2.0**-20


def _reference(x):
    """silu and its derivative in float64."""
    s = 1 / (1 + np.exp(-x))
    return x * s, s * (1 + x * (1 - s))


def test_derivative_matches_float64():
    x = np.linspace(-40.0, 40.0, 801)
    got = silu.derivative(tf.constant(x, tf.float32)).numpy().astype(np.float64)
    _, want = _reference(x)
    # s (1 + x (1 - s)): float32 roundings of terms up to |x| s (1 - s) <= 0.3 |x|.
    assert np.all(np.abs(got - want) <= 4 * 2.0**-24 * (1 + 0.3 * np.abs(x))), np.abs(got - want).max()


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16], ids=["bfloat16", "float16"])
def test_forward_and_backward_are_one_rounding_of_float64(dtype):
    rng = np.random.default_rng(0)
    x16 = tf.cast(rng.normal(0.0, 6.0, (64, 64)), dtype)
    dy = tf.cast(rng.normal(0.0, 1.0, (64, 64)), dtype)
    y, dx = silu.forward(x16), silu.backward(x16, dy)
    assert y.dtype == dtype and dx.dtype == dtype
    x64, dy64 = tf.cast(x16, tf.float64).numpy(), tf.cast(dy, tf.float64).numpy()
    value, slope = _reference(x64)
    tiny = 2.0**-25 if dtype == tf.float16 else 2.0**-126  # float16's half subnormal step; bfloat16 flushes
    for got, want in ((y, value), (dx, dy64 * slope)):
        got = tf.cast(got, tf.float64).numpy()
        assert np.all(np.abs(got - want) <= np.abs(want) * (HALF_ULP[dtype] + FLOAT32_ERROR) + tiny), \
            np.abs(got - want).max()


def test_backward_rounds_to_the_incoming_gradients_dtype():
    # A float32 gradient into a bfloat16 silu (a caller that upcast) gets a float32 result, not a rounded one.
    x16 = tf.constant([-2.0, 0.5, 3.0], tf.bfloat16)
    dy = tf.constant([1.0, -1.0, 0.25], tf.float32)
    dx = silu.backward(x16, dy)
    _, slope = _reference(tf.cast(x16, tf.float64).numpy())
    assert dx.dtype == tf.float32
    np.testing.assert_allclose(dx.numpy(), dy.numpy() * slope, rtol=1e-6)

"""gelu's float32 derivative and the XLA forward and backward (`keras_amp.numerics.gelu`).

The rule that uses them (`op_rules.upcast_recompute.upcast_recompute_gelu`) is checked against
float64 with and without XLA in tests/op_rules/test_upcast_recompute.py; here the compiled
computations are checked against the unfused float32 ops they replace, and the derivative
against a float64 NumPy reference.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from keras_amp.numerics import gelu

ERF = np.vectorize(math.erf)
# One rounding to the 16-bit type, relative (half an ulp).
ROUNDING = {tf.bfloat16: 2.0**-8, tf.float16: 2.0**-11}


def _x(dtype, n=4096, seed=0):
    return tf.cast(np.random.default_rng(seed).normal(0.0, 3.0, (n // 64, 64)), dtype)


def _reference(x, approximate):
    """gelu and its derivative in float64."""
    if approximate:
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x**3))
        return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * 0.044715 * x**2)
    return 0.5 * x * (1 + ERF(x / math.sqrt(2))), 0.5 * (1 + ERF(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _formula_error(x, approximate):
    """Bounds on the float32 formulas' own error, value and slope: a few float32 epsilons times the
    terms' size (|x| for the value; |x| phi(x), and the tanh form's cancelling 1 - t**2 times
    0.4 |x| (1 + 0.134 x**2), for the slope)."""
    eps, ax = 2.0**-23, np.abs(x)
    value = 4 * eps * (0.5 * ax if approximate else ax)
    slope = 8 * eps * (1 + (0.4 * ax * (1 + 0.134 * x**2) if approximate else ax))
    return value, slope


@pytest.mark.parametrize("approximate", [False, True], ids=["exact", "tanh"])
def test_derivative_matches_float64(approximate):
    x = np.linspace(-10.0, 10.0, 401)
    _, ref = _reference(x, approximate)
    got = gelu.derivative(tf.constant(x, tf.float32), approximate).numpy().astype(np.float64)
    assert np.all(np.abs(got - ref) <= _formula_error(x, approximate)[1]), np.abs(got - ref).max()


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("approximate", [False, True], ids=["exact", "tanh"])
def test_compiled_is_one_rounding_of_float32_like_the_unfused_ops(dtype, approximate):
    forward, backward = gelu.compiled(tf.nn.gelu)
    x16, dy = _x(dtype), _x(dtype, seed=1)
    x32 = tf.cast(x16, tf.float32)
    y, dx = forward(x16, approximate, dtype), backward(x16, dy, approximate)
    assert y.dtype == dtype and dx.dtype == dtype
    x64, dy64 = tf.cast(x16, tf.float64).numpy(), tf.cast(dy, tf.float64).numpy()
    value, slope = _reference(x64, approximate)
    value_err, slope_err = _formula_error(x64, approximate)
    # Half a 16-bit ulp of the result (float16's subnormal spacing near zero) plus the float32 error.
    tiny = 2.0**-25 if dtype == tf.float16 else 0.0
    unfused = (tf.nn.gelu(x32, approximate=approximate), tf.cast(dy, tf.float32) * gelu.derivative(x32, approximate))
    for got, want, err, plain in ((y, value, value_err, unfused[0]), (dx, dy64 * slope, slope_err * np.abs(dy64), unfused[1])):
        got = tf.cast(got, tf.float64).numpy()
        assert np.all(np.abs(got - want) <= np.abs(want) * ROUNDING[dtype] + err + tiny), np.abs(got - want).max()
        # XLA's erfc differs from TensorFlow's by float32 ulps: the same 16-bit value almost always.
        # (XLA's tanh is another approximation; in the tanh form's cancelling 1 + tanh(u) it moves
        # 3-6% of the 16-bit results by an ulp, all within the bound above.)
        if not approximate:
            assert np.mean(got != tf.cast(tf.cast(plain, dtype), tf.float64).numpy()) < 0.01


def test_a_float32_result_from_a_16bit_input():
    # A float32 caller (an upcast of a 16-bit tensor) gets the float32 value, not a rounded one.
    forward, backward = gelu.compiled(tf.nn.gelu)
    x16 = _x(tf.bfloat16)
    y = forward(x16, False, tf.float32)
    want = tf.nn.gelu(tf.cast(x16, tf.float32), approximate=False).numpy()
    assert y.dtype == tf.float32
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=1e-7)
    dx = backward(x16, tf.ones_like(y), False)
    assert dx.dtype == tf.float32
    np.testing.assert_allclose(dx.numpy(), gelu.derivative(tf.cast(x16, tf.float32), False).numpy(), rtol=1e-6, atol=1e-7)

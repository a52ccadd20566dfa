"""keras_amp.op_rules.matmul: while the rules are installed, a layer with a Matmul16DTypePolicy multiplies
16-bit operands with float32 accumulation, one rounding and a float32 result; every other matmul is
the original, and without the rules the policy is plain float32."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from tests.helpers import UNIT_ROUNDOFF

pytestmark = [
    pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning"),
    pytest.mark.usefixtures("no_op_rules"),
]


def _round(x, dtype):
    """float64 values rounded to a 16-bit dtype, back as float64."""
    return np.asarray(tf.cast(tf.cast(tf.constant(x, tf.float64), dtype), tf.float64))


@pytest.mark.parametrize("p", ["mixed_bfloat16", "mixed_float16"])
def test_matmul16_policy_layer_matmuls_in_16_bits_with_a_float32_result(p):
    keras_amp.enable(p)
    low = p[len("mixed_"):]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 64)).astype("float32")
    kernel = rng.normal(size=(64, 16)).astype("float32")
    bias = rng.normal(size=16).astype("float32")
    fast = keras.layers.Dense(16, dtype=keras_amp.Matmul16DTypePolicy(p))
    plain = keras.layers.Dense(16, dtype="float32")
    for layer in (fast, plain):
        layer.build((None, 64))
        layer.set_weights([kernel, bias])
    assert fast.compute_dtype == "float32" and fast.kernel.dtype == "float32"
    # Reference: 16-bit operands, exact products and sum, one rounding to 16 bits, float32 bias.
    ref = _round(_round(x, low) @ _round(kernel, low), low) + bias.astype(np.float64)
    exact = x.astype(np.float64) @ kernel.astype(np.float64) + bias.astype(np.float64)
    tol = np.abs(ref).max() * 1e-6 + 1e-6
    for call in (fast, tf.function(fast)):  # eager and traced
        out = call(x)
        assert out.dtype == tf.float32
        # float32 accumulation may sit one 16-bit spacing away from the float64 sum's rounding.
        spacing = 2 * UNIT_ROUNDOFF[low] * np.abs(ref - bias)
        assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= spacing + tol)
    assert np.abs(np.asarray(fast(x), np.float64) - exact).max() > 1e-3  # guard: really 16-bit
    # Other layers' matmuls are the original (float32 here).
    np.testing.assert_allclose(np.asarray(plain(x), np.float64), exact, rtol=1e-5, atol=1e-4)
    # Without the rules the policy is plain float32.
    keras_amp.disable()
    np.testing.assert_allclose(np.asarray(fast(x), np.float64), exact, rtol=1e-5, atol=1e-4)

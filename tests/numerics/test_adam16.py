"""keras_amp.numerics.adam16: one Adam step of a 16-bit-stored weight (its float32 master rebuilt from the
stored halves, the moments, the step, the weight stored again) against a float64 NumPy Adam step."""

import numpy as np
import pytest
import tensorflow as tf

from keras_amp.numerics import adam16, bits

U32 = 2.0**-24  # float32 unit roundoff
SHAPE = (4, 16)
LR, BETA_1, BETA_2, EPSILON, WEIGHT_DECAY, STEP = 1e-2, 0.9, 0.999, 1e-7, 0.01, 3
SEED = tf.constant([7, 0], tf.int32)  # the stateless seed of the stochastic roundings


def _state(seed=0):
    """float32 (w, m, v, g): weights near 0.5, gradients ~0.1, moments of a few steps."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0.5, 0.2, SHAPE).astype("float32")
    m = rng.normal(0.0, 0.01, SHAPE).astype("float32")
    v = rng.uniform(1e-4, 1e-2, SHAPE).astype("float32")
    g = rng.normal(0.0, 0.1, SHAPE).astype("float32")
    return w, m, v, g


def _scalars(decay):
    alpha = LR * np.sqrt(1 - BETA_2**STEP) / (1 - BETA_1**STEP)
    values = [LR, alpha, 1 - BETA_1, 1 - BETA_2, EPSILON, WEIGHT_DECAY if decay else 0.0]
    return tf.constant(values, tf.float32)


def _adam64(w, m, v, g, scalars, decay):
    """Float64 Adam step (Keras's order of operations) from the given values and float32 scalars."""
    lr, alpha, one_minus_b1, one_minus_b2, eps, wd = np.asarray(scalars, np.float64)
    w, m, v, g = (np.asarray(t, np.float64) for t in (w, m, v, g))
    if decay:
        w = w - w * wd * lr
    m = m + (g - m) * one_minus_b1
    v = v + (g * g - v) * one_minus_b2
    step = m * alpha / (np.sqrt(v) + eps)
    return w - step, m, v, np.abs(w) + np.abs(step)


def _f64(t):
    return np.asarray(tf.cast(t, tf.float32), np.float64)



@pytest.mark.parametrize("jit", [False, True], ids=["ops", "xla"])
@pytest.mark.parametrize("decay", [False, True], ids=["adam", "adamw"])
def test_split_step_is_adam_on_the_exact_float32_master(decay, jit):
    w, m, v, g = _state()
    hi, low = bits.split(w)
    scalars = _scalars(decay)
    out = adam16.kernel("split", "float32", decay, True, jit)(hi, low, m, v, g, scalars, SEED)
    hi2, low2, m2, v2, before, asked, stored = out
    if decay:  # the step starts from the decayed master, w - w * wd * lr (two float32 roundings)
        w64 = w.astype(np.float64)
        np.testing.assert_allclose(_f64(before), w64 - w64 * WEIGHT_DECAY * LR, rtol=2 * U32, atol=0)
        assert np.all(before.numpy() != w)  # guard: the decay moved every weight
    else:  # the master rebuilt from the two halves, bit for bit
        np.testing.assert_array_equal(before.numpy().view(np.uint32), w.view(np.uint32))
    ref, ref_m, ref_v, size = _adam64(w, m, v, g, scalars, decay)
    # A few float32 roundings of the operands (XLA may contract multiply-adds into FMAs).
    assert np.all(np.abs(_f64(asked) - ref) <= 8 * U32 * size)
    assert np.all(np.abs(_f64(m2) - ref_m) <= 4 * U32 * (np.abs(m) + np.abs(g)))
    assert np.all(np.abs(_f64(v2) - ref_v) <= 4 * U32 * (v + np.square(g, dtype=np.float64)))
    # Guard: most updates are below bfloat16's spacing at the weight, so bfloat16 alone would lose them.
    assert np.mean(np.abs(ref - w) < 2.0**-9 * np.abs(w)) > 0.5
    # The exact split: the stored halves are the new master, bit for bit.
    assert hi2.dtype == tf.bfloat16 and low2.dtype == tf.uint16
    np.testing.assert_array_equal(stored.numpy().view(np.uint32), asked.numpy().view(np.uint32))
    np.testing.assert_array_equal(bits.join(hi2, low2).numpy().view(np.uint32), asked.numpy().view(np.uint32))


def test_kahan_step_keeps_twice_float16_precision():
    w, m, v, g = _state(1)
    hi, low = bits.kahan_split(w, tf.float16)
    scalars = _scalars(False)
    hi2, low2, _, _, before, asked, stored = adam16.kernel("kahan", "float32", False, True)(
        hi, low, m, v, g, scalars, SEED)
    np.testing.assert_array_equal(_f64(before), _f64(hi) + _f64(low))  # the master: hi + lo, exact in float32
    ref, _, _, size = _adam64(before, m, v, g, scalars, False)
    assert np.all(np.abs(_f64(asked) - ref) <= 8 * U32 * size)
    assert hi2.dtype == low2.dtype == tf.float16
    np.testing.assert_array_equal(_f64(hi2), _f64(tf.cast(asked, tf.float16)))  # hi: the nearest float16
    # hi + lo: the remainder rounded to float16 (relative 2**-11 of a remainder <= 2**-11 |x|), plus
    # the float32 sum's rounding and float16's subnormal spacing (2**-24) for tiny remainders.
    bound = 2.0**-21 * np.abs(_f64(asked)) + 2.0**-24
    np.testing.assert_array_equal(_f64(stored), _f64(hi2) + _f64(low2))
    assert np.all(np.abs(_f64(stored) - _f64(asked)) <= bound)
    assert np.abs(_f64(hi2) - _f64(asked)).max() > 100 * bound.max()  # guard: hi alone is far coarser


def test_bfloat16_moments_and_stored_weight_without_compensation():
    w, m, v, g = _state(2)
    hi, m16, v16 = (tf.cast(t, tf.bfloat16) for t in (w, m, v))
    dummy = tf.zeros((), tf.uint16)
    scalars = _scalars(False)
    fn = adam16.kernel("none", "bfloat16", False, True)
    hi2, low2, m2, v2, before, asked, _ = fn(hi, dummy, m16, v16, g, scalars, SEED)
    assert low2.shape == () and int(low2) == 0  # no compensation: the dummy passes through
    np.testing.assert_array_equal(_f64(before), _f64(hi))
    ref, ref_m, ref_v, _ = _adam64(_f64(hi), _f64(m16), _f64(v16), g, scalars, False)
    # The weight and the first moment: rounded to the nearest bfloat16 (as tf.cast), half an ulp.
    np.testing.assert_array_equal(hi2.numpy().view(np.uint16), tf.cast(asked, tf.bfloat16).numpy().view(np.uint16))
    assert m2.dtype == v2.dtype == tf.bfloat16
    np.testing.assert_allclose(_f64(m2), ref_m, rtol=2.0**-8 + 8 * U32, atol=0)
    # The second moment: rounded stochastically, to one of the two neighbouring bfloat16 values.
    np.testing.assert_allclose(_f64(v2), ref_v, rtol=2.0**-7 + 8 * U32, atol=0)
    same = fn(hi, dummy, m16, v16, g, scalars, SEED)[3]
    np.testing.assert_array_equal(_f64(same), _f64(v2))  # one seed, one rounding (every replica alike)
    draws = np.stack([_f64(fn(hi, dummy, m16, v16, g, scalars, tf.constant([s, 0], tf.int32))[3])
                      for s in range(64)])
    assert np.mean(draws.min(0) < draws.max(0)) > 0.9  # guard: rounded up on some seeds, down on others
    # Unbiased: the mean over 64 seeds is within 3 standard errors (ulp / 2 / 8) of the float64 value.
    np.testing.assert_allclose(draws.mean(0), ref_v, rtol=3 * 2.0**-7 / 16, atol=0)


def test_stochastic_weight_and_kernel_cache():
    w, m, v, g = _state(3)
    hi = tf.cast(w, tf.bfloat16)
    fn = adam16.kernel("stochastic", "float32", False, False)
    assert fn is adam16.kernel("stochastic", "float32", False, False)  # one trace per configuration
    assert fn is not adam16.kernel("stochastic", "float32", True, False)
    out = fn(hi, tf.zeros((), tf.uint16), m, v, g, _scalars(False), SEED)
    assert len(out) == 4  # no master probe
    ref, _, _, _ = _adam64(_f64(hi), m, v, g, _scalars(False), False)
    np.testing.assert_allclose(_f64(out[0]), ref, rtol=2.0**-7 + 8 * U32, atol=0)  # a bfloat16 neighbour
    assert np.any(_f64(out[0]) != _f64(tf.cast(tf.constant(ref, tf.float32), tf.bfloat16)))  # guard: not nearest

"""16-bit storage of float32 values (keras_amp.numerics.bits), against NumPy bit patterns and float64."""

import numpy as np
import pytest
import tensorflow as tf

from keras_amp.numerics import bits


def _floats(n=20000, seed=0):
    r = np.random.RandomState(seed)
    x = r.randn(n) * 10.0 ** r.randint(-38, 38, n)
    special = [0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.17549435e-38]
    return np.concatenate([x, special]).astype(np.float32)


def test_split_join_is_exact_for_every_float32():
    x = _floats()
    hi, lo = bits.split(x)
    assert hi.dtype == tf.bfloat16 and lo.dtype == tf.uint16
    np.testing.assert_array_equal(bits.join(hi, lo).numpy().view(np.uint32), x.view(np.uint32))


def test_split_top_half_is_the_nearest_bfloat16():
    x = _floats(seed=1)
    x = x[np.isfinite(x) & (np.abs(x) < 3.38e38)]
    hi = bits.split(x)[0].numpy().astype(np.float64)
    err = np.abs(hi - x.astype(np.float64))
    # Nearest: no other bfloat16 is closer; equals TF's round-to-nearest-even except on exact ties.
    rne = tf.cast(x, tf.bfloat16).numpy().astype(np.float64)
    assert np.all(err <= np.abs(rne - x.astype(np.float64)))
    assert np.mean(hi == rne) > 0.999


def test_top_half_for_a_low_half_joins_it_exactly_to_the_value_it_was_split_from():
    """`adam16.in_place` computes the low half and the top half in two compiled loops: a top half
    from a recomputation a few ulps off still joins the low half into the first value, bit for bit."""
    x = _floats(seed=2)
    x = x[np.isfinite(x) & (np.abs(x) < 3.38e38) & (np.abs(x) > 1e-37)]
    hi, lo = bits.split(x)
    np.testing.assert_array_equal(bits.top_half_for(x, lo).numpy().view(np.uint16), hi.numpy().view(np.uint16))
    for ulps in (1, -1, 37, -300, 2**14):  # the recomputation's error, in float32 ulps
        nearby = (x.view(np.int32) + ulps).view(np.float32)
        top = bits.top_half_for(nearby, lo)
        np.testing.assert_array_equal(top.numpy().view(np.uint16), hi.numpy().view(np.uint16), err_msg=str(ulps))
        np.testing.assert_array_equal(bits.join(top, lo).numpy().view(np.uint32), x.view(np.uint32))


def test_kahan_pair_carries_twice_the_16bit_precision():
    # Weight-sized values: below ~1e-3 float16's remainder reaches its subnormals and precision drops.
    r = np.random.RandomState(2)
    x = (r.uniform(0.01, 4, 10000) * r.choice([-1, 1], 10000)).astype(np.float32)
    for dtype, bits_kept in ((tf.float16, 18), (tf.bfloat16, 16)):
        hi, lo = bits.kahan_split(x, dtype)
        err = np.abs(bits.kahan_join(hi, lo).numpy().astype(np.float64) - x) / np.abs(x)
        plain = np.abs(tf.cast(x, dtype).numpy().astype(np.float64) - x) / np.abs(x)
        assert err.max() <= 2.0**-bits_kept, dtype
        assert err.mean() < plain.mean() / 50, dtype


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    x = np.full(20000, 1.0 + 2.0**-10, np.float32)  # a quarter of the way from 1 to the next bf16
    down, up = 1.0, 1.0 + 2.0**-7
    draws = np.stack([bits.stochastic_round(x, tf.constant([s, 3])).numpy().astype(np.float64) for s in range(4)])
    assert set(np.unique(draws)) <= {down, up}
    assert draws.mean() == pytest.approx(1.0 + 2.0**-10, abs=2.0**-7 * 0.01)
    # Same seed, same rounding (every replica rounds alike).
    a = bits.stochastic_round(x, tf.constant([7, 1])).numpy()
    np.testing.assert_array_equal(a, bits.stochastic_round(x, tf.constant([7, 1])).numpy())
    # Round to nearest would never move 1 + 2^-10 off 1.
    assert np.all(tf.cast(x, tf.bfloat16).numpy().astype(np.float64) == down)


def test_dither_is_uniform_reproducible_and_unrelated_across_seeds_and_positions():
    n = 1 << 16
    draw = bits.dither((256, 256), tf.constant([5, 8])).numpy().reshape(-1).astype(np.int64)
    assert draw.min() >= 0 and draw.max() < 1 << 16
    np.testing.assert_array_equal(draw, bits.dither([256, 256], tf.constant([5, 8])).numpy().reshape(-1))
    for part in (draw >> 12, draw & 15):  # top and bottom 4 bits: 16 buckets of n/16 expected
        counts = np.bincount(part, minlength=16)
        assert np.abs(counts - n / 16).max() < 5 * np.sqrt(n / 16 * 15 / 16), counts
    # The next step, the next variable, the next element: uncorrelated (|r| < 5 sigma = 5 / sqrt(n)).
    for other in (bits.dither([n], tf.constant([6, 8])), bits.dither([n], tf.constant([5, 9]))):
        assert abs(np.corrcoef(draw, other.numpy())[0, 1]) < 5 / np.sqrt(n)
    assert abs(np.corrcoef(draw[:-1], draw[1:])[0, 1]) < 5 / np.sqrt(n)


def test_stochastic_rounding_keeps_non_finite_values():
    x = np.array([np.inf, -np.inf, np.nan], np.float32)
    out = bits.stochastic_round(x, tf.constant([0, 0])).numpy().astype(np.float32)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])


def test_integer_bfloat16_conversions_match_tensorflows_casts():
    x = _floats(seed=4)
    x = x[np.abs(x) < 3.38e38]
    rounded = bits.round_to_bfloat16(x)
    np.testing.assert_array_equal(rounded.numpy().view(np.uint16), tf.cast(x, tf.bfloat16).numpy().view(np.uint16))
    np.testing.assert_array_equal(bits.bfloat16_to_float32(rounded).numpy(),
                                  tf.cast(rounded, tf.float32).numpy())
    assert np.isnan(bits.round_to_bfloat16(np.array([np.nan], np.float32)).numpy().astype(np.float32)).all()


def test_same_bits_compares_bit_patterns_nan_and_signed_zero_included():
    a = tf.constant([1.0, float("nan"), 0.0, -0.0], tf.bfloat16)
    assert bits.same_bits(a, tf.identity(a))  # NaN == NaN by bits, where tf.equal says no
    assert not bits.same_bits(a, tf.constant([1.0, float("nan"), 0.0, 0.0], tf.bfloat16))  # -0.0 vs 0.0
    assert not bits.same_bits(a, tf.constant([1.0078125, float("nan"), 0.0, -0.0], tf.bfloat16))  # one ulp


def test_same_bits_takes_float32_and_says_no_across_dtypes():
    a = tf.constant([1.0, float("nan"), -0.0], tf.float32)
    assert bits.same_bits(a, tf.identity(a))
    assert not bits.same_bits(a, tf.constant([1.0, float("nan"), 0.0], tf.float32))
    assert not bits.same_bits(a, tf.constant([1.0000001, float("nan"), -0.0], tf.float32))  # one ulp
    assert not bits.same_bits(a, tf.cast(a, tf.bfloat16))

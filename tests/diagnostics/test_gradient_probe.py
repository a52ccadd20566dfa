"""keras_amp.diagnostics.gradient_probe: per-layer gradient elements classified in the compute dtype."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.diagnostics import gradient_probe, traced_step
from keras_amp.diagnostics.gradient_probe import GradientReport, LayerGradientStats


def test_classification_matches_a_float64_reference():
    values = np.array([0.0, 1e-8, 3e-6, 6.2e-5, 1.0, -3.5, 65504.0, 1e5, np.nan, -np.inf, 2.0**-20],
                      dtype="float64")
    reference = values * 4096.0  # the same gradients at a 4096x larger scale
    counts = {k: np.asarray(v) for k, v in gradient_probe.stats_tensors(
        [tf.constant(values, tf.float32)], "float16", [tf.constant(reference, tf.float32)]).items()}
    s = gradient_probe.from_counts("x", "float16", counts)
    # Reference in float64: round to float16 first (what the compute dtype holds).
    held = values.astype(np.float16).astype(np.float64)
    finite = np.isfinite(held)
    nonzero = finite & (held != 0)
    tiny = 2.0**-14  # float16's smallest normal
    assert s.size == values.size
    assert s.zero_fraction == np.mean(held == 0)  # 0 and 1e-8 (below the smallest subnormal)
    ref = reference.astype(np.float16).astype(np.float64)
    lost = (held == 0) & np.isfinite(ref) & (ref != 0)
    assert s.underflow_zero_fraction == np.mean(lost) == 1 / values.size  # 1e-8 only; 0 stays 0
    assert s.subnormal_fraction == np.mean(nonzero & (np.abs(held) < tiny))  # 3e-6 and 2**-20
    assert s.nonfinite_fraction == np.mean(~finite)  # 1e5 overflows, nan, -inf
    exps = np.floor(np.log2(np.abs(held[nonzero]))).astype(int)
    assert (s.min_exponent, s.max_exponent) == (exps.min(), exps.max()) == (-20, 15)
    assert dict(s.exponent_histogram) == {int(e): int(n) for e, n in zip(*np.unique(exps, return_counts=True))}
    # Guard: the edge cases were really present.
    assert s.zero_fraction > 0 and s.subnormal_fraction > 0 and s.nonfinite_fraction > 0


@pytest.mark.parametrize("dtype,expected", [("float16", (-24, 15)), ("bfloat16", (-133, 127)),
                                            ("float32", (-149, 127))])
def test_exponent_range_runs_from_the_smallest_subnormal_to_the_largest_finite(dtype, expected):
    lo, hi = gradient_probe.exponent_range(dtype)
    assert (lo, hi) == expected
    info = traced_step.float_info(dtype)
    assert 2.0**lo == float(info.smallest_subnormal) and 2.0**hi <= float(info.max) < 2.0 ** (hi + 1)


def test_all_zero_gradients_have_no_exponents():
    counts = {k: np.asarray(v) for k, v in gradient_probe.stats_tensors([tf.zeros([3, 2])], "bfloat16").items()}
    s = gradient_probe.from_counts("d", "bfloat16", counts)
    assert (s.size, s.zero_fraction, s.underflow_zero_fraction) == (6, 1.0, 0.0)  # no reference: none lost
    assert (s.min_exponent, s.max_exponent, s.exponent_histogram) == (None, None, ())


def _stats(path, underflow_zero=0.0, subnormal=0.0, nonfinite=0.0):
    return LayerGradientStats(path, "float16", 4, underflow_zero, underflow_zero, subnormal, nonfinite,
                              -20, -10, ((-20, 1), (-10, 3)))


def test_flagged_layers_and_the_json_record():
    report = GradientReport(loss_scale=256.0, loss=0.5, layers=(
        _stats("at_threshold", underflow_zero=0.25, subnormal=0.25), _stats("below", subnormal=0.25),
        _stats("overflowing", nonfinite=0.25)))
    assert [s.path for s in report.flagged()] == ["at_threshold", "overflowing"]  # >= 0.5, or any inf/NaN
    assert [s.path for s in report.flagged(0.2)] == ["at_threshold", "below", "overflowing"]
    record = json.loads(report.to_json())
    assert record == report.as_dict()
    assert record["layers"][0]["exponent_histogram"] == {"-20": 1, "-10": 3}
    assert record["layers"][0]["underflow_zero_fraction"] == 0.25 and record["loss_scale"] == 256.0


def test_probe_counts_a_float16_layers_gradients_at_two_scales_against_float64():
    # One row through a bias-free float16 Dense(1), the mean of the outputs as the loss: the kernel's
    # gradient at scale s is s * x exactly, then held in float16.
    keras.config.set_dtype_policy("mixed_float16")
    x = np.array([[1.0, 2.0**-4, 2.0**-10, 0.0]], "float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        1, use_bias=False, name="k", kernel_initializer=keras.initializers.Constant(0.5))])
    probe = gradient_probe.GradientProbe(model, x)
    for scale in (2.0**-6, 2.0**-16):
        report = probe.run(scale)
        (k,) = report.layers
        held = (x[0].astype(np.float64) * scale).astype(np.float16).astype(np.float64)
        ref = (x[0].astype(np.float64) * scale * 4096.0).astype(np.float16).astype(np.float64)
        nonzero = held != 0
        exps = np.floor(np.log2(np.abs(held[nonzero]))).astype(int)
        assert (k.path, k.compute_dtype, k.size, report.loss_scale) == ("k", "float16", 4, scale)
        assert k.zero_fraction == np.mean(held == 0)
        assert k.underflow_zero_fraction == np.mean((held == 0) & (ref != 0))
        assert k.subnormal_fraction == np.mean(nonzero & (np.abs(held) < 2.0**-14))
        assert (k.min_exponent, k.max_exponent) == (exps.min(), exps.max())
        assert dict(k.exponent_histogram) == {int(e): 1 for e in exps}
        np.testing.assert_allclose(report.loss, 0.5 * x.sum(dtype=np.float64), rtol=2.0**-11)  # float16 output
    # Guard: at 2**-16 the 2**-10 element really underflowed (2**-26 < float16's 2**-24), the 0 stayed 0.
    assert (k.zero_fraction, k.underflow_zero_fraction, k.subnormal_fraction) == (0.5, 0.25, 0.5)
    assert [s.path for s in report.flagged()] == ["k"]
    assert gradient_probe.gradient_statistics(model, x).loss_scale == 1.0  # no optimizer: unscaled


def test_default_scale_before_the_first_step_is_the_one_fit_starts_at():
    # keras_amp's tier "auto" picks the first scale from the trainable variables when fit builds the
    # optimizer: before that, the probe and find_overflow report that scale, not Keras's 2**15.
    import keras_amp  # noqa: PLC0415
    from keras_amp.diagnostics.overflow import find_overflow  # noqa: PLC0415

    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1, dtype="float32")])
    opt = keras_amp.LossScaleOptimizer(keras.optimizers.SGD(0.0), tier="auto")
    model.compile(optimizer=opt, loss="mse")
    x, y = np.ones((4, 8), "float32"), np.zeros((4, 1), "float32")
    before = gradient_probe.gradient_statistics(model, x, y)
    assert not opt.built  # guard: the probe builds nothing
    model.fit(x, y, epochs=1, verbose=0)
    assert before.loss_scale == find_overflow(model, x, y).loss_scale == opt.scale == 2.0**10  # 81 parameters

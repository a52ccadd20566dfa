"""GradientStatistics: per-layer zero/subnormal/non-finite fractions and exponents, flags, TensorBoard."""

import glob
import json
import logging as py_logging
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.callbacks.gradient_statistics import GradientStatistics


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.uniform(0.5, 1.0, (n, 8)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _underflow_model():
    # The float32 head's ~1e-8 weights make the gradient reaching "k" ~1e-9 at scale 1: below
    # float16's smallest subnormal (6e-8), so k's weight gradients are all 0 in float16.
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, name="k")(inp)
    out = keras.layers.Dense(1, dtype="float32", name="head",
                             kernel_initializer=keras.initializers.Constant(1e-8))(h)
    return keras.Model(inp, out)


def _fit(policy, initial_scale, **kwargs):
    keras.config.set_dtype_policy(policy)
    model = _underflow_model()
    opt = keras.optimizers.SGD(0.0)
    if policy == "mixed_float16":
        opt = keras_amp.LossScaleOptimizer(opt, initial_scale=initial_scale, min_scale=1.0,
                                           dynamic_growth_steps=10_000)
    model.compile(optimizer=opt, loss="mse")
    x, y = _data()
    stats = GradientStatistics((x[:16], y[:16]), **{"update_freq": 2, **kwargs})
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[stats])
    return stats


def test_planted_underflow_is_flagged_and_a_larger_scale_clears_it():
    low = _fit("mixed_float16", 1.0)
    assert [r["step"] for r in low.records] == [2, 4]
    assert list(low.flagged) == ["k"]
    k = {layer["path"]: layer for layer in low.records[0]["layers"]}["k"]
    assert k["compute_dtype"] == "float16" and k["zero_fraction"] == 1.0
    assert k["underflow_zero_fraction"] == 1.0  # zeros here, values at a 4096x larger scale
    assert low.records[0]["loss_scale"] == 1.0
    high = _fit("mixed_float16", 2.0**20)
    assert high.flagged == {}
    k = {layer["path"]: layer for layer in high.records[0]["layers"]}["k"]
    assert k["zero_fraction"] == 0.0 and k["subnormal_fraction"] < 0.5
    # Guard: the scale in force really was 2**20 (the probe reads the optimizer's scale).
    assert high.records[0]["loss_scale"] == 2.0**20


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_same_gradients_do_not_underflow_with_float32_range(policy):
    # bfloat16 has float32's exponent range: 1e-9 is a normal number there.
    stats = _fit(policy, None)
    assert stats.flagged == {}
    k = {layer["path"]: layer for layer in stats.records[0]["layers"]}["k"]
    assert k["compute_dtype"] == policy.replace("mixed_", "")
    assert k["zero_fraction"] == 0.0 and k["min_exponent"] < -24  # below float16's range


def test_records_in_logs_and_tensorboard(tmp_path, caplog):
    caplog.set_level(py_logging.INFO, logger="absl")
    stats = _fit("mixed_float16", 1.0, log_dir=str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GradientStatistics: {")]
    assert len(lines) == 2
    record = json.loads(lines[0][len("GradientStatistics: "):])
    assert {layer["path"] for layer in record["layers"]} == {"k", "head"}
    assert any("'k' float16: 100.0% underflowed/subnormal" in r.getMessage() for r in caplog.records)
    scalars, hists = {}, {}
    for path in glob.glob(os.path.join(str(tmp_path), "*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                array = tf.make_ndarray(v.tensor)
                target = scalars if array.shape == () else hists
                target.setdefault(v.tag, []).append((event.step, array))
    assert [(step, float(a)) for step, a in scalars["gradients/k/zero_fraction"]] == [(2, 1.0), (4, 1.0)]
    assert "gradients/head/max_exponent" in scalars and "gradients/k/min_exponent" not in scalars
    step, buckets = hists["gradients/head/exponent"][0]
    head = {layer["path"]: layer for layer in stats.records[0]["layers"]}["head"]
    assert step == 2 and buckets.shape[1] == 3
    assert {int(left): int(n) for left, _, n in buckets} == {int(e): n for e, n in head["exponent_histogram"].items()}


def test_no_work_between_firings():
    stats = _fit("mixed_float16", 1.0)
    assert len(stats.records) == 2  # 4 steps, every 2


def test_a_fit_shorter_than_update_freq_fires_once_at_its_end(tmp_path):
    stats = _fit("mixed_float16", 1.0, update_freq=100, log_dir=str(tmp_path))  # 4 steps
    assert [r["step"] for r in stats.records] == [4]
    assert {layer["path"] for layer in stats.records[0]["layers"]} == {"k", "head"}
    assert list(tmp_path.rglob("events.out.tfevents.*"))  # TensorBoard has them too


def test_every_n_steps_is_the_deprecated_name_of_update_freq():
    x, y = _data()
    with pytest.warns(DeprecationWarning, match="`every_n_steps` is deprecated.*use `update_freq`") as caught:
        stats = GradientStatistics((x, y), every_n_steps=7)
    assert stats.update_freq == 7 and caught[0].filename == __file__
    with pytest.warns(DeprecationWarning, match="use `update_freq`"):
        assert stats.every_n_steps == 7
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="`every_n_steps` must be an integer >= 1"):
        GradientStatistics((x, y), every_n_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert GradientStatistics((x, y), 7).update_freq == 7


def test_a_flagged_fraction_never_reads_zero_percent():
    # Any non-finite element flags a layer: 2 of 4096 had been written "0% non-finite".
    from keras_amp.callbacks.gradient_statistics import _percent

    assert [_percent(f) for f in (0.0, 2 / 4096, 0.001, 0.25, 1.0)] == ["0.0%", "<0.1%", "0.1%", "25.0%", "100.0%"]

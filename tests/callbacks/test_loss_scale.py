"""LossScaleMonitor: metrics in History and TensorBoard, reads only at log points, symptoms, diagnoses."""

import glob
import os
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.callbacks import LossScaleMonitor
from tests.helpers import BatchLogRecorder, regression_batch, two_dense_model


def _model(gain_dtype=None):
    # k multiplies the (positive) inputs by ~1e5 through its kernel: ~7.5e4 > 65504 in float16.
    # A matmul, not scalar multiplies: grappler may reassociate x * a * b, never a matmul.
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, use_bias=False, name="k", dtype=gain_dtype,
                           kernel_initializer=keras.initializers.Constant(1.25e4))(inp)
    h = keras.layers.Dense(8, use_bias=False, name="down", dtype=gain_dtype,
                           kernel_initializer=keras.initializers.Constant(1.25e-5))(h)
    out = keras.layers.Dense(1, dtype="float32", name="head")(h)
    return keras.Model(inp, out, name="m")


def _events(log_dir):
    values = {}
    for path in glob.glob(os.path.join(log_dir, "train", "*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                array = tf.make_ndarray(v.tensor)
                if array.shape == () and array.dtype.kind == "f":  # scalars (not the model config)
                    values.setdefault(v.tag, []).append(float(array))
    return values


def _fit_overflowing(callbacks):
    keras.config.set_dtype_policy("mixed_float16")
    model = two_dense_model()
    opt = keras_amp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=256.0)
    model.compile(optimizer=opt, loss="mse")
    x, y = regression_batch(poison_row=40)  # batch 5 of 8 overflows in every epoch
    return model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)


def test_metrics_in_history_and_own_tensorboard_events(tmp_path):
    monitor = LossScaleMonitor(update_freq=3, log_dir=str(tmp_path / "train"))
    history = _fit_overflowing([monitor])
    h = history.history
    assert h["loss_scale"] == [128.0, 64.0]
    # The counters are kept out of the logs, and put into History beside them, one per epoch.
    assert h["overflow_count"] == [1, 2] and h["skipped_steps"] == [1, 2]
    assert h["overflows_since_log"] == [1, 1] and h["consecutive_overflows"] == [0, 0]
    assert len(h["loss"]) == 2 and history.epoch == [0, 1]
    assert monitor.last == {"loss_scale": 64.0, "overflow_count": 2, "skipped_steps": 2,
                            "consecutive_overflows": 0, "overflows_since_log": 1}
    # A second fit counts its own overflows: 1 per epoch again, not the 2 of the first fit.
    model = monitor.model
    again = model.fit(*regression_batch(poison_row=40), batch_size=8, epochs=1, verbose=0, shuffle=False,
                      callbacks=[LossScaleMonitor(update_freq=3)])
    assert again.history["overflows_since_log"] == [1] and again.history["overflow_count"] == [3]
    events = _events(str(tmp_path))
    assert events["epoch_loss_scale"] == [128.0, 64.0]
    assert events["epoch_overflow_count"] == [1.0, 2.0]
    assert events["epoch_overflows_since_log"] == [1.0, 1.0]
    # Log points at batches 3, 6, 9, 12, 15; the overflow of batch 5 shows at 6, that of 13 at 15.
    assert events["batch_overflow_count"] == [0.0, 1.0, 1.0, 1.0, 2.0]
    assert events["batch_loss_scale"] == [256.0, 128.0, 128.0, 128.0, 64.0]


def test_a_log_dir_without_loss_scaling_warns_that_nothing_is_written(tmp_path):
    # mixed_bfloat16 (what "auto" picks on most CPUs) needs no loss scale: keras_amp.wrap returns
    # the optimizer as given, and the monitor has no scale or counters to write.
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = two_dense_model()
    model.compile(optimizer=keras_amp.wrap(keras.optimizers.Adam(1e-3)), loss="mse")
    x, y = regression_batch()
    with pytest.warns(keras_amp.AmpWarning, match=r"LossScaleMonitor\(log_dir=.*writes nothing in this fit: "
                      r"optimizer 'Adam' does not scale the loss \(policy mixed_bfloat16\)") as caught:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[LossScaleMonitor(log_dir=str(tmp_path))])
    assert caught[0].filename == __file__  # at the user's fit call
    assert _events(str(tmp_path)) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_amp.AmpWarning)  # without log_dir: nothing was asked for
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[LossScaleMonitor()])


@pytest.mark.parametrize("counters_in_logs", [False, True], ids=["scale_only", "counters_too"])
def test_metrics_reach_keras_tensorboard_callback(tmp_path, counters_in_logs):
    pytest.importorskip("tensorboard", reason="keras.callbacks.TensorBoard needs the tensorboard package")
    _fit_overflowing([LossScaleMonitor(update_freq=3, counters_in_logs=counters_in_logs),
                      keras.callbacks.TensorBoard(str(tmp_path))])
    events = _events(str(tmp_path))
    assert events["epoch_loss_scale"] == [128.0, 64.0]
    if counters_in_logs:
        assert events["epoch_overflow_count"] == [1.0, 2.0]
        assert events["epoch_skipped_steps"] == [1.0, 2.0]
    else:  # the logs carry the scale only; the monitor's own log_dir has the counters
        assert not [tag for tag in events if "overflow" in tag or "skipped" in tag]


def _progress_bar(capsys, **monitor_kwargs) -> str:
    capsys.readouterr()
    keras.config.set_dtype_policy("mixed_float16")
    model = two_dense_model()
    model.compile(optimizer=keras_amp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=256.0),
                  loss="mse")
    with pytest.warns(keras_amp.AmpWarning, match="The loss is NaN or inf"):  # the poisoned batch
        model.fit(*regression_batch(poison_row=40), batch_size=8, epochs=2, verbose=1, shuffle=False,
                  callbacks=[LossScaleMonitor(update_freq=3, **monitor_kwargs)])
    return capsys.readouterr().out


def test_progress_bar_shows_the_scale_not_the_counters(capsys):
    out = _progress_bar(capsys)
    assert "Epoch 2/2" in out and "loss_scale: 128.0000" in out and "loss_scale: 64.0000" in out
    for counter in ("overflow_count", "overflows_since_log", "skipped_steps", "consecutive_overflows"):
        assert counter not in out
    # Guard: the capture sees what the bar prints for a counter once one is in the logs.
    out = _progress_bar(capsys, counters_in_logs=True)
    assert "overflow_count: 2.0000" in out and "consecutive_overflows: 0.0000e+00" in out


def test_state_is_read_only_at_log_points(monkeypatch):
    keras.config.set_dtype_policy("mixed_float16")
    model = two_dense_model()
    opt = keras_amp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=256.0)
    model.compile(optimizer=opt, loss="mse")
    reads = []
    original = opt.host_check

    def counting():
        reads.append(int(opt.total_steps.numpy()))
        return original()

    monkeypatch.setattr(opt, "host_check", counting)
    recorder = BatchLogRecorder()
    x, y = regression_batch(poison_row=40)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[LossScaleMonitor(update_freq=3, counters_in_logs=True), recorder])
    # Log points: batches 3, 6 | 9, 12, 15 (counted over epochs), 2 epoch ends, train end.
    assert reads == [3, 6, 8, 9, 12, 15, 16, 16]
    logs = recorder.batch_logs
    assert "loss_scale" not in logs[0] and "loss_scale" in logs[2]
    # Between log points the logs carry the values last read, as Python numbers (no tensor reads).
    assert all(type(entry["loss_scale"]) is float for entry in logs[2:])
    assert logs[3]["overflow_count"] == logs[2]["overflow_count"] == 0
    assert logs[5]["overflow_count"] == 1 and logs[5]["overflows_since_log"] == 1
    assert logs[8]["overflow_count"] == 1 and logs[8]["overflows_since_log"] == 0


@pytest.mark.parametrize("on_nan", ["warn", "stop"])
def test_forced_nan_prints_the_diagnosis_naming_the_layer(on_nan, capsys):
    keras.config.set_dtype_policy("mixed_float16")
    model = _model()
    opt = keras_amp.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=1.0, min_scale=1.0,
                                       on_min_scale="ignore")
    model.compile(optimizer=opt, loss="mse")
    x, y = regression_batch()
    monitor = LossScaleMonitor(update_freq=2, on_nan=on_nan, probe=(x[:16], y[:16]))
    recorder = BatchLogRecorder()
    with pytest.warns(keras_amp.AmpWarning, match="diagnosis: The loss is NaN or inf") as caught:
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                            callbacks=[monitor, recorder])
    text = str(monitor.diagnoses[0])
    names = [d.symptom.name for d in monitor.diagnoses]
    # A symptom seen at the first log point; the scale sitting at its floor needs two.
    assert names == (["non_finite_loss"] if on_nan == "stop" else ["non_finite_loss", "scale_at_floor"])
    assert "Does the forward pass itself produce the inf/NaN? -> yes" in text
    assert "Compute 'k' in float32" in text
    assert any("Compute 'k' in float32" in str(w.message) for w in caught)
    stopped = "Batch 1: Invalid loss, terminating training"  # keras.callbacks.TerminateOnNaN's line
    if on_nan == "stop":
        assert len(recorder.batch_logs) == 2 and len(history.epoch) == 1  # stopped at the first log point
        assert capsys.readouterr().out.count(stopped) == 1
    else:
        assert len(recorder.batch_logs) == 16 and len(history.epoch) == 2
        assert stopped not in capsys.readouterr().out
    # Guard: every step really overflowed (the scale sat at its floor of 1).
    assert int(opt.overflow_count.numpy()) == len(recorder.batch_logs)


def test_fixed_model_gives_no_diagnosis():
    keras.config.set_dtype_policy("mixed_float16")
    model = _model(gain_dtype="float32")
    # Learning rate 0: SGD diverges on a 1e5 gain in any precision; the test is about numerics.
    opt = keras_amp.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1.0, min_scale=1.0)
    model.compile(optimizer=opt, loss="mse")
    x, y = regression_batch()
    monitor = LossScaleMonitor(update_freq=2, on_nan="stop", probe=(x[:16], y[:16]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_amp.AmpWarning)
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[monitor])
    assert monitor.diagnoses == [] and len(history.epoch) == 2
    assert all(np.isfinite(history.history["loss"]))


@pytest.mark.parametrize("old", ["log_every", "check_every"])
def test_old_names_of_update_freq_warn_and_still_work(old):
    with pytest.warns(DeprecationWarning, match=f"`{old}` is deprecated.*use `update_freq`") as caught:
        monitor = LossScaleMonitor(**{old: 7})
    assert monitor.update_freq == 7 and caught[0].filename == __file__
    with pytest.warns(DeprecationWarning, match="`log_every` is deprecated.*use `update_freq`"):
        assert monitor.log_every == 7
    with pytest.raises(ValueError, match=rf"pass only `update_freq`.*Received: update_freq=5, {old}=7"):
        LossScaleMonitor(5, **{old: 7})
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=f"`{old}` must be an integer >= 1"):
        LossScaleMonitor(**{old: 0})  # the error names the argument as written
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert LossScaleMonitor(update_freq=7).update_freq == 7


MIXED = ("mixed_float16", "mixed_bfloat16")
_DATA_Q = "Does the batch itself (inputs or labels) contain NaN/inf?"


def _fit_with_nan(policy, where, probe_rows, callbacks=()):
    """A fit whose batch 5 (rows 40..47) holds one NaN in `where`; the monitor's probe is `probe_rows`."""
    keras.config.set_dtype_policy(policy)
    model = two_dense_model()
    inner = keras.optimizers.SGD(1e-3)
    # mixed_float16 trains with a loss-scale optimizer; mixed_bfloat16 needs none (and so has no scale).
    opt = keras_amp.LossScaleOptimizer(inner, initial_scale=256.0) if policy == "mixed_float16" else inner
    model.compile(optimizer=opt, loss="mse")
    x, y = regression_batch()
    (x if where == "inputs" else y)[41, 0] = np.nan
    monitor = LossScaleMonitor(update_freq=2, probe=(x[probe_rows], y[probe_rows]))
    with pytest.warns(keras_amp.AmpWarning, match="The loss is NaN or inf") as caught:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[monitor, *callbacks])
    return monitor, opt, caught


@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("where", ["inputs", "labels"])
@pytest.mark.parametrize("seen", ["in_the_step", "on_the_probe"])
def test_nan_in_the_data_is_diagnosed_first_as_data(policy, where, seen):
    probe_rows = slice(0, 16) if seen == "in_the_step" else slice(40, 48)
    monitor, opt, caught = _fit_with_nan(policy, where, probe_rows)
    (d,) = [d for d in monitor.diagnoses if d.symptom.name == "non_finite_loss"]
    assert d.steps == ((_DATA_Q, "yes"),), d
    assert d.actions[0].startswith("Repair or filter the data (")
    # Named: the training step (counted in the step) and, from the probe, the row and feature.
    assert f"NaN/inf in the training batch of step 6 of this fit (epoch 1, batch 5): {where} (1 batch)" \
        in d.actions[0]
    if seen == "on_the_probe":
        assert f"the probe batch's {where}: 1 of {8 if where == 'labels' else 64} values NaN/inf, " \
               "first at row 1, feature 0" in d.actions[0]
    text = str(d)
    assert "Lower the initial loss scale" not in text and not re.search(r"<[a-z]", text)
    # The warnings point at the user's fit call (this file), not into keras_amp or Keras.
    assert {w.filename for w in caught if issubclass(w.category, keras_amp.AmpWarning)} == {__file__}
    if policy == "mixed_float16":  # guard: the NaN batch really overflowed the loss-scale optimizer
        assert int(opt.overflow_count.numpy()) >= 1
    else:  # guard: no loss scale to halve (the old advice had an unfilled initial_scale there)
        assert not isinstance(opt, keras.optimizers.LossScaleOptimizer)


def test_clean_data_under_bfloat16_walks_one_branch():
    # A non-finite loss with finite data and no loss scale: the forward-pass question, then one leaf.
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")  # diverges: lr 1 on a 1e5 gain
    x, y = regression_batch()
    monitor = LossScaleMonitor(update_freq=2)
    with pytest.warns(keras_amp.AmpWarning, match="The loss is NaN or inf"):
        model.fit(x, y * 1e30, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    (d,) = [d for d in monitor.diagnoses if d.symptom.name == "non_finite_loss"]
    assert d.steps[:2] == ((_DATA_Q, "no"), ("Is the loss scaled (a LossScaleOptimizer)?", "no")), d
    assert len(d.actions) == 1 and d.actions[0].startswith("Answer first: Does the forward pass"), d


@pytest.mark.parametrize("probe", ["empty", "wrong_shape"])
def test_a_probe_that_cannot_run_is_a_warning_and_training_goes_on(probe):
    keras.config.set_dtype_policy("mixed_float16")
    model = two_dense_model()
    model.compile(optimizer=keras_amp.LossScaleOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
    x, y = regression_batch()
    batch = (x[:0], y[:0]) if probe == "empty" else (x[:16, :3], y[:16])
    monitor = LossScaleMonitor(update_freq=2, probe=batch)
    with pytest.warns(keras_amp.AmpWarning, match="the probe batch cannot be used") as caught:
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
    assert len(history.epoch) == 2 and monitor.diagnoses == []
    (w,) = [w for w in caught if issubclass(w.category, keras_amp.AmpWarning)]  # once, at the fit call
    assert w.filename == __file__
    assert "Traceback" not in str(w.message) and "\n" not in str(w.message)



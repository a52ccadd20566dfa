"""keras_amp.callbacks.trend_checks: the monitor's symptoms read from trends (zero gradients, step
time, validation swings, memory growth)."""

import os
import time
import warnings

import keras
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.callbacks import LossScaleMonitor, trend_checks
from tests.helpers import regression_batch, two_dense_model


def test_zero_gradients_diagnosed_as_underflow_and_cleared_by_a_larger_scale():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = regression_batch()

    def run(initial_scale):
        inp = keras.Input((8,))
        h = keras.layers.Dense(8, name="k")(inp)
        out = keras.layers.Dense(1, dtype="float32", name="head",
                                 kernel_initializer=keras.initializers.Constant(1e-8))(h)
        model = keras.Model(inp, out)
        opt = keras_amp.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=initial_scale,
                                           min_scale=1.0, dynamic_growth_steps=10_000)
        model.compile(optimizer=opt, loss="mse")
        monitor = LossScaleMonitor(update_freq=2, probe=(x[:16], y[:16]), zero_grad_steps=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", keras_amp.AmpWarning)
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
        return monitor.diagnoses

    low = run(1.0)
    assert [d.symptom.name for d in low] == ["zero_gradients"]
    assert "'k'" in low[0].detail
    assert ("Do the zeros underflow (fewer zeros at a larger loss scale)?", "yes") in low[0].steps
    # The scale it advises, where the probe found the zeros to be values, clears them.
    assert any(a.startswith("Raise the loss scale to where the zeros are values: initial_scale=4096 ")
               for a in low[0].actions), low[0].actions
    assert run(4096.0) == []


def _bare_monitor(**kwargs):
    keras.config.set_dtype_policy("float32")
    monitor = LossScaleMonitor(**kwargs)
    model = two_dense_model()
    model.compile(optimizer="sgd", loss="mse")
    monitor.set_model(model)
    monitor.on_train_begin()
    return monitor


def test_validation_swing():
    monitor = _bare_monitor(val_swing=0.5)
    monitor._memory_reader = lambda: ("rss", 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_amp.AmpWarning)
        for epoch, (val, acc) in enumerate([(1.0, 0.5), (1.2, 0.55), (3.0, 0.2)]):
            monitor.on_epoch_end(epoch, {"loss": 1.0, "val_loss": val, "val_accuracy": acc})
    (d,) = monitor.diagnoses
    assert d.symptom.name == "validation_swing"
    assert "val_loss 1.2 -> 3" in d.detail and "val_accuracy 0.55 -> 0.2" in d.detail


def test_memory_growth():
    monitor = _bare_monitor(memory_epochs=3)
    readings = iter([100, 90, 100, 110, 120, 130])  # rises at 4 epoch ends; needs 3 in a row
    monitor._memory_reader = lambda: ("rss", next(readings) * 2**20)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_amp.AmpWarning)
        for epoch in range(6):
            monitor.on_epoch_end(epoch, {"loss": 1.0})
            seen.append(len(monitor.diagnoses))
    assert seen == [0, 0, 0, 0, 1, 1]
    assert monitor.diagnoses[0].symptom.name == "memory_growth"
    assert "90.0 MiB -> 120.0 MiB" in monitor.diagnoses[0].detail
    assert monitor._memory_reader is not keras_amp.callbacks.loss_scale.memory_in_use
    kind, used = keras_amp.callbacks.loss_scale.memory_in_use()
    assert kind == "rss" and used > 10 * 2**20  # this process holds TensorFlow


def test_step_time_jump():
    monitor = _bare_monitor(update_freq=1, step_time_factor=3.0)
    monitor.on_epoch_begin(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_amp.AmpWarning)
        for batch in range(10):
            time.sleep(0.002 if batch < 7 else 0.05)
            monitor.on_train_batch_end(batch, {})
            if batch == 7:
                assert monitor.diagnoses == []  # guard: steady steps, then one slow one, raise nothing
    (d,) = monitor.diagnoses
    assert d.symptom.name == "step_time_jump"
    assert "input pipeline" in " ".join(d.actions)


def test_a_non_finite_validation_metric_is_a_swing_and_asks_about_overflows():
    monitor = _bare_monitor(val_swing=10.0)  # no finite change is large enough
    monitor._memory_reader = lambda: ("rss", 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_amp.AmpWarning)
        for epoch, val in enumerate([1.0, 2.0, float("nan")]):
            monitor.on_epoch_end(epoch, {"loss": 1.0, "val_loss": val})
    (d,) = monitor.diagnoses
    assert d.symptom.name == "validation_swing" and d.detail == "val_loss 2 -> nan"
    # SGD scales no loss, so no step is skipped: a finite training loss says none overflowed.
    assert d.steps[0] == ("Did steps overflow since the previous evaluation?", "no")
    assert d.steps[1] == ("Do the model's outputs and loss compute in float32?", "yes")


def test_without_loss_scaling_a_non_finite_training_loss_leaves_overflows_unknown():
    monitor = _bare_monitor(val_swing=10.0)
    monitor._memory_reader = lambda: ("rss", 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_amp.AmpWarning)
        for epoch, loss in enumerate([1.0, float("inf")]):
            monitor.on_epoch_end(epoch, {"loss": loss, "val_loss": [1.0, float("nan")][epoch]})
    (d,) = [d for d in monitor.diagnoses if d.symptom.name == "validation_swing"]
    assert d.steps == (("Did steps overflow since the previous evaluation?", "unknown"),)


def test_a_large_change_the_way_training_moves_is_learning_not_a_swing():
    monitor = _bare_monitor(val_swing=0.5)
    monitor._memory_reader = lambda: ("rss", 100)
    # (val_loss, loss, val_accuracy, accuracy): all four improve, then validation turns while training
    # goes on improving.
    history = [(6.1, 5.0, 0.1, 0.1), (3.06, 2.5, 0.3, 0.35), (1.5, 1.2, 0.6, 0.7), (0.94, 0.9, 0.7, 0.8),
               (2.5, 0.8, 0.3, 0.85)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_amp.AmpWarning)
        for epoch, (val, train, val_acc, acc) in enumerate(history):
            monitor.on_epoch_end(epoch, {"loss": train, "val_loss": val, "accuracy": acc, "val_accuracy": val_acc})
            if epoch == 3:
                assert monitor.diagnoses == []  # guard: the improving metrics raised nothing
    (d,) = monitor.diagnoses
    assert d.detail == "val_loss 0.94 -> 2.5; val_accuracy 0.7 -> 0.3"


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")), reason="with a GPU it reads GPU:0's memory")
def test_memory_in_use_is_the_resident_set_without_a_gpu():
    def statm_rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = statm_rss()
    kind, used = trend_checks.memory_in_use()
    after = statm_rss()
    assert kind == "rss"
    # The resident set moves between reads by what this process allocates meanwhile: a few pages.
    assert min(before, after) - 2**20 <= used <= max(before, after) + 2**20

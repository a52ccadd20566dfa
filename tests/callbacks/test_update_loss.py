"""keras_amp.callbacks.update_loss: LossScaleMonitor(update_loss_every=N) measures the weight updates
lost to rounding in one step of every N, and diagnoses layers whose updates vanish."""

import warnings

import keras
import numpy as np
import pytest

import keras_amp
from tests.helpers import BatchLogRecorder, regression_batch, two_dense_model


def test_update_loss_every_measures_and_diagnoses_vanishing_updates():
    """LossScaleMonitor(update_loss_every=N): a layer whose 16-bit weights lose their updates is
    named through the decision tree; a float32-master run reports nothing."""
    from keras_amp.optimizers import LeanAdam  # noqa: PLC0415

    x = np.random.RandomState(0).randn(64, 8).astype("float32")
    results = {}
    for name in ("none", "split"):
        keras_amp.enable("mixed_bfloat16")
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(1)])
        model.compile(LeanAdam(1e-4, compensation=name), "mse")
        monitor = keras_amp.callbacks.LossScaleMonitor(update_freq=4, update_loss_every=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
        results[name] = (monitor, caught, history)
        keras_amp.disable()
    bad, caught, _ = results["none"]
    assert max(max(m.values()) for m in bad.update_loss.values()) > 0.5
    assert [d.symptom.name for d in bad.diagnoses] == ["updates_vanish"]
    assert "LeanAdam" in str(bad.diagnoses[0]) and any("Weight updates vanish" in str(w.message) for w in caught)
    good, _, _ = results["split"]
    assert good.update_loss and all(m["lost"] < 1e-6 for m in good.update_loss.values())
    assert good.diagnoses == []
    with pytest.raises(ValueError, match="update_loss_every"):
        keras_amp.callbacks.LossScaleMonitor(update_loss_every=0)


def test_every_nth_step_is_measured_and_its_worst_fraction_logged():
    keras.config.set_dtype_policy("float32")
    model = two_dense_model()
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    monitor = keras_amp.callbacks.LossScaleMonitor(update_loss_every=2)
    recorder = BatchLogRecorder()
    model.fit(*regression_batch(n=40), batch_size=8, epochs=1, verbose=0, callbacks=[monitor, recorder])
    measured = [i for i, logs in enumerate(recorder.batch_logs) if "update_loss_max" in logs]
    assert measured == [1, 3]  # steps 2 and 4 of 5
    assert sorted(monitor.update_loss) == sorted(layer.path for layer in model.layers)
    worst = max(max(m.values()) for m in monitor.update_loss.values())
    assert recorder.batch_logs[3]["update_loss_max"] == worst
    # float32 weights keep Adam's 1e-3 steps: no layer loses most of its update.
    assert worst < 0.5 and monitor.diagnoses == []


def test_off_by_default_attaches_nothing():
    keras.config.set_dtype_policy("float32")
    model = two_dense_model()
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    monitor = keras_amp.callbacks.LossScaleMonitor()
    recorder = BatchLogRecorder()
    model.fit(*regression_batch(n=16), batch_size=8, epochs=1, verbose=0, callbacks=[monitor, recorder])
    assert monitor.update_loss_every is None and monitor._update_probe is None
    assert monitor.update_loss == {} and not any("update_loss_max" in logs for logs in recorder.batch_logs)

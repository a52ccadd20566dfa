"""Float32Fallback: the overflowing layer, and only it, moves to float32; the decision survives .keras."""

import io
import json
import logging as py_logging
import math
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from auto_precision_models import Amplify, regression_data, sensitive_model
from keras_amp.auto_precision import Float32Fallback, model_policies
from tests.helpers import WalkSpy, count_walks

X, Y = regression_data(n=64)
DS = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)


def _overflowing_model():
    model = sensitive_model("mixed_float16", sensitive=Amplify)
    model.compile(keras_amp.wrap(keras.optimizers.Adam(1e-2)), "mse")
    return model


def test_without_fallback_the_loss_stays_non_finite():
    model = _overflowing_model()
    history = model.fit(DS, epochs=2, verbose=0)
    assert not any(math.isfinite(v) for v in history.history["loss"])  # the edge is real


def test_fallback_moves_only_the_producing_layer_and_training_recovers(tmp_path):
    model = _overflowing_model()
    before = model_policies.policy_names(model)
    fallback = Float32Fallback((X[:16], Y[:16]), patience=2)
    history = model.fit(DS, epochs=3, verbose=0, callbacks=[fallback])
    assert [d.layer for d in fallback.decisions] == ["sensitive"]
    assert fallback.decisions[0].step == 2  # after `patience` overflowing checks
    assert "producer" in fallback.decisions[0].evidence and fallback.gave_up is None
    after = model_policies.policy_names(model)
    assert after["sensitive"] == "float32"
    assert {p: n for p, n in after.items() if p != "sensitive"} == {p: n for p, n in before.items() if p != "sensitive"}
    assert math.isfinite(history.history["loss"][-1])
    # The decision is in the layer's config: a reload trains the same way.
    model.save(tmp_path / "m.keras")
    reloaded = keras.models.load_model(tmp_path / "m.keras")
    assert model_policies.policy_names(reloaded) == after
    again = reloaded.fit(DS, epochs=1, verbose=0)
    assert math.isfinite(again.history["loss"][-1])


def test_cap_stops_moving_and_says_why():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, name="d1")(inp)
    h = Amplify(name="first")(h)
    h = Amplify(name="second")(h)
    out = keras.layers.Dense(1, name="out")(h)
    model = keras.Model(inp, out)
    model.compile(keras_amp.wrap(keras.optimizers.Adam(1e-2)), "mse")
    fallback = Float32Fallback((X[:16], Y[:16]), patience=1, max_layers=1)
    model.fit(DS, epochs=2, verbose=0, callbacks=[fallback])
    assert [d.layer for d in fallback.decisions] == ["first"]
    assert fallback.gave_up is not None and "max_layers=1" in fallback.gave_up and "second" in fallback.gave_up
    assert model.get_layer("second").dtype_policy.name == "mixed_float16"


def test_a_restart_from_a_file_brings_the_decisions_back(tmp_path):
    # A restart from a `.keras` file (load_model builds a new model): the fallback's record comes with it, so
    # `max_layers` counts the move made before the restart and the second layer is not moved too.
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = Amplify(name="second")(Amplify(name="first")(keras.layers.Dense(16, name="d1")(inp)))
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(keras_amp.wrap(keras.optimizers.Adam(1e-2)), "mse")
    fallback = Float32Fallback((X[:16], Y[:16]), patience=1, max_layers=1)
    model.fit(DS, epochs=1, verbose=0, callbacks=[fallback])
    assert [d.layer for d in fallback.decisions] == ["first"]  # guard: one move before the save
    model.save(tmp_path / "m.keras")
    model.save(tmp_path / "plain.keras")  # guard below: a model that never had decisions
    fresh = keras.Model.from_config(model.get_config())  # the weights-only resume: no callback set on it yet
    fresh.compile(keras_amp.wrap(keras.optimizers.Adam(1e-2)), "mse")
    fresh.load_weights(tmp_path / "m.keras")
    for reloaded in (keras.saving.load_model(tmp_path / "m.keras"), fresh):
        again = Float32Fallback((X[:16], Y[:16]), patience=1, max_layers=1)
        reloaded.fit(DS, epochs=1, verbose=0, callbacks=[again])
        assert again.decisions == fallback.decisions and again.gave_up is not None  # before: [], "second" moved
        assert reloaded.get_layer("second").dtype_policy.name == "mixed_float16"
        assert again.checkpoint_state()["step"] > fallback.checkpoint_state()["step"]  # the count went on


def test_a_model_without_decisions_adds_nothing_to_its_file(tmp_path):
    model = _overflowing_model()
    model.fit(DS, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as archive:
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r")
        names = []
        weights.visit(names.append)
    assert names and not any("_keras_amp_decisions" in n for n in names), names
    assert "_keras_amp_decisions" not in model.__dict__ and keras.saving.load_model(tmp_path / "m.keras")


def test_stock_optimizer_uses_the_loss_signal():
    model = sensitive_model("mixed_float16", sensitive=Amplify)  # compile auto-wraps in stock's scaler
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    fallback = Float32Fallback((X[:16], Y[:16]), patience=2)
    history = model.fit(DS, epochs=3, verbose=0, callbacks=[fallback])
    assert [d.layer for d in fallback.decisions] == ["sensitive"] and fallback.gave_up is None
    assert math.isfinite(history.history["loss"][-1])


@keras.saving.register_keras_serializable(package="keras_amp_tests")
class Shrink(keras.layers.Layer):
    """x * 1e-6: the gradient flowing back into the layer before it is ~1e-6, subnormal in float16."""

    def call(self, x):
        return (x * 1e-3) * 1e-3


def test_underflow_moves_the_underflowing_layer():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, name="d1")(inp)
    h = Shrink(name="shrink")(h)
    out = keras.layers.Dense(1, name="out")(h)
    model = keras.Model(inp, out)
    # Static scale 1: nothing lifts the gradients out of float16's subnormal range.
    model.compile(keras_amp.LossScaleOptimizer(keras.optimizers.SGD(1e-2), initial_scale=1.0, dynamic=False), "mse")
    from keras_amp.diagnostics.overflow import find_overflow

    flagged = [s.path for s in find_overflow(model, X[:16], Y[:16]).underflowing(0.5)]
    assert "d1" in flagged  # the edge: d1's weight gradients (~1e-6 * x) are subnormal in float16
    fallback = Float32Fallback((X[:16], Y[:16]), underflow_threshold=0.5, max_layers=len(flagged))
    model.fit(DS, epochs=1, verbose=0, callbacks=[fallback])
    assert [d.layer for d in fallback.decisions] == flagged
    assert all("underflow" in d.reason for d in fallback.decisions)
    assert model.get_layer("shrink").dtype_policy.name == "mixed_float16"  # not flagged, not moved
    after = find_overflow(model, X[:16], Y[:16])
    assert all(after.layer(p).gradients.underflow_fraction < 0.5 for p in flagged)


@pytest.mark.parametrize("signal", ["overflow", "underflow"])
def test_each_callback_hook_walks_the_model_at_most_once(signal, monkeypatch):
    if signal == "overflow":
        model, fallback = _overflowing_model(), Float32Fallback((X[:16], Y[:16]), patience=2)
    else:
        keras.config.set_dtype_policy("mixed_float16")
        inp = keras.Input((8,))
        h = Shrink(name="shrink")(keras.layers.Dense(16, name="d1")(inp))
        model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
        model.compile(keras_amp.LossScaleOptimizer(keras.optimizers.SGD(1e-2), initial_scale=1.0, dynamic=False), "mse")
        fallback = Float32Fallback((X[:16], Y[:16]), underflow_threshold=0.5, max_layers=3)
    walked = count_walks(monkeypatch)
    spy = WalkSpy(walked)
    model.fit(DS, epochs=2, verbose=0, callbacks=[fallback, spy])
    assert fallback.decisions, "guard: the fallback moved a layer (the moving hook walks)"
    assert max(n for _, n in spy.per_hook) == 1, spy.per_hook
    walking = [hook for hook, n in spy.per_hook if n]
    # The move (a probe and the policy change) reads one tree; each later epoch re-applies with one.
    underflow = ["epoch_end 0", "epoch_begin 1", "epoch_end 1"]
    assert walking == (["batch_end 1", "epoch_begin 1"] if signal == "overflow" else underflow)


@keras.saving.register_keras_serializable(package="keras_amp_tests")
class Exp(keras.layers.Layer):
    """exp(x) / 1e5: float16's exp overflows for x > 11.1, whatever the loss scale, where the result fits."""

    def call(self, x):
        return keras.ops.exp(x) * 1e-5


EXP_X = np.random.default_rng(0).uniform(0.0, 13.0, size=(64, 8)).astype("float32")  # every batch has x > 11.1
EXP_Y = np.zeros((64, 1), "float32")


def _exp_model(initial_scale=256.0):
    """x -> identity Dense -> Exp -> float32 Dense; SGD at 1e-9 keeps the weights (and so the overflows) put."""
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, kernel_initializer="identity", name="d1")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="out", dtype="float32")(Exp(name="expo")(h)))
    model.compile(keras_amp.LossScaleOptimizer(keras.optimizers.SGD(1e-9), initial_scale=initial_scale), "mse")
    return model


def _messages(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_the_scale_calibrating_is_not_a_layer_overflow_and_the_fallback_stays_on(caplog):
    # 2**15 is too high a scale for these gradients: the scaler skips steps while it backs off. That is
    # no layer's fault (the probe is finite at the floor): nothing moves, nothing stops, and a real
    # overflow afterwards is still moved at once.
    caplog.set_level(py_logging.INFO, logger="absl")
    model = _exp_model(initial_scale=2.0**15)
    small, target = EXP_X * 0.01, np.full_like(EXP_Y, 300.0)
    fallback = Float32Fallback((small[:8], target[:8]), patience=2)
    model.fit(small, target, batch_size=8, epochs=2, verbose=0, callbacks=[fallback])
    opt = model.optimizer
    assert int(opt.overflow_count) >= 2 and int(opt.iterations) > 0  # guard: skipped steps, then applied ones
    assert fallback.decisions == [] and fallback.gave_up is None  # before: a layer moved, or it stopped
    assert _messages(caplog, "the loss scale is calibrating")  # guard: the locator ran and saw why
    assert model.get_layer("expo").dtype_policy.name == "mixed_float16"
    assert fallback.checkpoint_state()["calibrating_from"] is None  # over: an applied step came
    # exp overflows now; a probe of these batches (a new callback continues the model's state)
    later = Float32Fallback((EXP_X[:8], EXP_Y[:8]), patience=2)
    model.fit(EXP_X, EXP_Y, batch_size=8, epochs=1, verbose=0, callbacks=[later])
    assert [(d.layer, d.step) for d in later.decisions] == [("expo", 16 + 2)], later.decisions
    assert "forward" in later.decisions[0].reason


def test_a_locator_run_that_moves_nothing_is_tried_again_later_then_stops(caplog):
    # A probe that does not overflow cannot name the layer: each run is a miss; the next needs twice
    # the evidence (patience 1, 2, 4 overflowing checks: runs after steps 1, 3 and 7).
    model = _exp_model()
    fallback = Float32Fallback((EXP_X[:8] * 0, EXP_Y[:8]), patience=1)
    model.fit(EXP_X, EXP_Y, batch_size=8, epochs=1, verbose=0, callbacks=[fallback])
    assert int(model.optimizer.overflow_count) == 8  # guard: every step overflowed
    misses = _messages(caplog, "no layer moved (miss")
    assert [m.split("(miss ")[1][:16] for m in misses] == ["1; it stops at 3", "2; it stops at 3"], misses
    assert "waits for 2 consecutive checks" in misses[0] and "waits for 4 consecutive" in misses[1]
    assert fallback.gave_up is not None and "3 locator runs in a row" in fallback.gave_up
    assert fallback.decisions == [] and fallback.checkpoint_state()["misses"] == 3


def test_a_checkpoint_that_stopped_after_one_locator_run_acts_again():
    # A file written before misses were counted stopped the fallback at its first empty locator run;
    # below max_layers that stop is taken as one miss (the next run needs 2 * patience checks), so the
    # overflowing layer is still moved.
    model = _exp_model()
    old = {"decisions": [], "gave_up": "the locator names 'functional', which is already float32 or not a layer "
           "this model can move", "step": 3, "streak": 0, "last_overflows": 0, "loss_blocked": False}
    data = np.frombuffer(json.dumps(old).encode("utf-8"), np.uint8)
    model_policies.decision_store(model).load_own_variables({"Float32Fallback": data})
    fallback = Float32Fallback((EXP_X[:8], EXP_Y[:8]), patience=2)
    model.fit(EXP_X, EXP_Y, batch_size=8, epochs=1, verbose=0, callbacks=[fallback])
    assert [(d.layer, d.step) for d in fallback.decisions] == [("expo", 3 + 2 * 2)]  # before: [], stopped
    assert fallback.gave_up is None and fallback.checkpoint_state()["misses"] == 0


def test_a_new_callback_in_a_later_fit_continues_the_models_decisions(tmp_path):
    # One callback per fit() (a notebook's habit): the second fit's decision is the model's, so a resume
    # with one new callback sets it again instead of relearning it with more skipped steps.
    model = _exp_model()
    first = Float32Fallback((EXP_X[:8], EXP_Y[:8]))
    model.fit(np.ones_like(EXP_X), EXP_Y, batch_size=8, epochs=1, verbose=0, callbacks=[first])
    assert first.decisions == [] and int(model.optimizer.overflow_count) == 0  # guard: nothing to decide yet
    fallback = Float32Fallback((EXP_X[:8], EXP_Y[:8]))
    model.fit(EXP_X, EXP_Y, batch_size=8, epochs=1, verbose=0, callbacks=[fallback])
    assert [(d.layer, d.step) for d in fallback.decisions] == [("expo", 8 + 2)]  # the step count went on
    assert int(model.optimizer.overflow_count) == 2
    model.save_weights(tmp_path / "m.weights.h5")
    fresh = _exp_model()
    fresh.load_weights(tmp_path / "m.weights.h5")
    again = Float32Fallback((EXP_X[:8], EXP_Y[:8]))
    fresh.fit(EXP_X, EXP_Y, batch_size=8, epochs=1, verbose=0, callbacks=[again])
    assert again.decisions == fallback.decisions
    assert int(fresh.optimizer.overflow_count) == 2  # before: 4, the move relearned
    with h5py.File(tmp_path / "m.weights.h5", "r") as f:
        names = []
        f.visit(names.append)
    assert [n for n in names if "Float32Fallback" in n] == ["_keras_amp_decisions/vars/Float32Fallback"], names


def test_two_fallbacks_in_one_fit_keep_their_own_state(tmp_path):
    model = _exp_model()
    first, second = Float32Fallback((EXP_X[:8], EXP_Y[:8])), Float32Fallback((EXP_X[:8], EXP_Y[:8]), patience=1)
    model.fit(EXP_X, EXP_Y, batch_size=8, epochs=1, verbose=0, callbacks=[first, second])
    assert first.checkpoint_state()["step"] == second.checkpoint_state()["step"] == 8  # not one count, twice
    assert [d.layer for d in second.decisions] == ["expo"] and first.decisions == []  # guard: states differ
    model.save_weights(tmp_path / "m.weights.h5")
    fresh = _exp_model()
    fresh.load_weights(tmp_path / "m.weights.h5")
    again = [Float32Fallback((EXP_X[:8], EXP_Y[:8])), Float32Fallback((EXP_X[:8], EXP_Y[:8]), patience=1)]
    fresh.fit(EXP_X, EXP_Y, batch_size=8, epochs=1, verbose=0, callbacks=again)
    assert [a.decisions for a in again] == [first.decisions, second.decisions]
    assert [a.checkpoint_state()["step"] for a in again] == [16, 16]


def test_a_probe_that_is_not_batches_is_refused_naming_probe():
    with pytest.raises(ValueError, match=r"`probe` must hold batches.*\.batch\(n\).*shapes \[\(8,\), \(1,\)\]"):
        Float32Fallback(tf.data.Dataset.from_tensor_slices((X[:8], Y[:8])))  # forgot .batch()
    with pytest.raises(ValueError, match="`probe` must hold at least one batch"):
        Float32Fallback(DS.take(0))
    model = _exp_model()
    one_sample = Float32Fallback((EXP_X[0],))  # one unbatched sample without labels: only the model tells
    with pytest.raises(ValueError, match=r"`probe` batches must fit model .*\(None, 8\).*x shape \(8,\)"):
        model.fit(EXP_X, EXP_Y, batch_size=8, epochs=1, verbose=0, callbacks=[one_sample])
    assert model_policies.global_step(model.optimizer) == 0  # refused before the first step

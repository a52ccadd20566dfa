"""Float32Fallback: the overflowing layer, and only it, moves to float32; the decision survives .keras."""

import io
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
    assert walking == (["batch_end 1", "epoch_begin 1"] if signal == "overflow" else ["epoch_end 0", "epoch_begin 1", "epoch_end 1"])

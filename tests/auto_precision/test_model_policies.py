"""keras_amp.auto_precision.model_policies: per-layer policies of a built model, read and set in
place, the steps counted from the optimizer, and the store that checkpoints the callbacks' decisions."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.auto_precision import model_policies
from keras_amp.optimizers import LossScaleOptimizer


def _nested(policy="mixed_bfloat16"):
    """inp -> block(Dense "inner_a", Dense "inner_b") -> Dense "head", built under `policy`."""
    keras.config.set_dtype_policy(policy)
    block = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="inner_a"),
                              keras.layers.Dense(4, name="inner_b")], name="block")
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(block(inp)), name="m")
    model.compile(keras.optimizers.SGD(1e-2), "mse")
    return model


def test_layers_and_policy_names_by_path_in_model_order():
    model = _nested()
    assert list(model_policies.layers_by_path(model)) == ["block", "block/inner_a", "block/inner_b", "head"]
    assert model_policies.layers_by_path(model)["block/inner_b"] is model.get_layer("block").get_layer("inner_b")
    assert set(model_policies.policy_names(model).values()) == {"mixed_bfloat16"}


def test_set_policies_sets_in_place_and_drops_the_traced_functions():
    model = _nested()
    x, y = np.ones((4, 4), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, verbose=0)
    assert model.train_function is not None
    weights = [w.numpy().copy() for w in model.weights]
    model_policies.set_policies(model, {"block/inner_b": "float32"})
    assert model_policies.policy_names(model) == {"block": "mixed_bfloat16", "block/inner_a": "mixed_bfloat16",
                                                  "block/inner_b": "float32", "head": "mixed_bfloat16"}
    assert model.train_function is None  # the next fit traces with the new policy
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(model.weights, weights))  # same variables
    assert model.get_layer("block").get_layer("inner_b")(tf.ones((1, 4))).dtype == "float32"


def test_set_policies_refuses_an_unknown_path_and_changes_nothing():
    model = _nested()
    with pytest.raises(ValueError, match=r"Unknown layer path\(s\) for model 'm': \['inner_a', 'nope'\]. "
                                         r"Allowed: the paths of its layers, e.g. \['block', 'block/inner_a'"):
        model_policies.set_policies(model, {"head": "float32", "nope": "float32", "inner_a": "float32"})
    assert model_policies.policy_names(model)["head"] == "mixed_bfloat16"


def test_temporary_policies_restore_even_after_an_error():
    model = _nested()
    before = model_policies.policy_names(model)
    with pytest.raises(RuntimeError, match="inside"):
        with model_policies.temporary_policies(model):
            model_policies.set_policies(model, {"head": "float32", "block/inner_a": "float32"})
            assert model_policies.policy_names(model)["head"] == "float32"
            raise RuntimeError("inside")
    assert model_policies.policy_names(model) == before


def test_reset_functions_forgets_train_test_and_predict():
    model = _nested()
    x, y = np.ones((4, 4), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, verbose=0)
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    model_policies.reset_functions(model)
    assert (model.train_function, model.test_function, model.predict_function) == (None, None, None)


def _rnn_model():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((3, 4))
    h = keras.layers.RNN(keras.layers.LSTMCell(4), name="rnn")(inp)
    model = keras_amp.apply_recipe(keras.Model(inp, keras.layers.Dense(1, name="out")(h)), "rnn")
    assert isinstance(model.get_layer("rnn").dtype_policy, keras_amp.Matmul16DTypePolicy)  # guard
    return model


def test_float32_policies_takes_a_matmul16_recurrence_with_its_cell():
    model = _rnn_model()
    assert model_policies.float32_policies(model, ["rnn/lstm_cell"]) == {"rnn/lstm_cell": "float32", "rnn": "float32"}
    assert model_policies.float32_policies(model, ["out"]) == {"out": "float32"}


def test_float32_policies_takes_the_layers_a_named_layer_calls():
    # A stock LSTM computes its gates in its cell, a sublayer with a policy of its own: naming the LSTM
    # alone had left the cell (and so the recurrence) in float16.
    keras.config.set_dtype_policy("mixed_float16")
    inp = keras.Input((5, 3))
    h = keras.layers.LSTM(4, name="lstm")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    wanted = model_policies.float32_policies(model, ["lstm"])
    assert wanted == {"lstm": "float32", "lstm/lstm_cell": "float32"}
    model_policies.set_policies(model, wanted)
    x = np.random.default_rng(0).normal(size=(2, 5, 3)).astype("float32")
    keras.config.set_dtype_policy("float32")
    twin = keras.Model.from_config(model.get_config())
    twin.set_weights(model.get_weights())
    np.testing.assert_array_equal(model.get_layer("lstm")(x), twin.get_layer("lstm")(x))  # float32 throughout
    assert model_policies.float32_policies(_nested(), ["block"]) == {
        "block": "float32", "block/inner_a": "float32", "block/inner_b": "float32"}


def test_an_rnn_cell_is_decided_with_its_outermost_rnn_other_layers_alone():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inp = keras.Input((5, 3))
    h = keras.layers.Bidirectional(keras.layers.GRU(4, return_sequences=True), name="bi")(inp)
    h = keras.layers.LSTM(4, name="lstm")(h)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    layers = model_policies.layers_by_path(model)
    units = {p: model_policies.decision_unit(layers, p) for p in layers}
    assert units == {"bi": "bi", "bi/forward_gru": "bi/forward_gru", "bi/forward_gru/gru_cell": "bi/forward_gru",
                     "bi/backward_gru": "bi/backward_gru", "bi/backward_gru/gru_cell": "bi/backward_gru",
                     "lstm": "lstm", "lstm/lstm_cell": "lstm", "out": "out"}
    assert model_policies.unit_members(layers, "lstm") == ["lstm", "lstm/lstm_cell"]
    # A wrapper's decision moves the layers below it, as `float32_policies` does; their own work is decided apart.
    bi = ["bi", "bi/forward_gru", "bi/forward_gru/gru_cell", "bi/backward_gru", "bi/backward_gru/gru_cell"]
    assert model_policies.unit_members(layers, "bi") == bi
    assert sorted(model_policies.unit_members(layers, "bi")) == sorted(model_policies.float32_policies(model, ["bi"]))
    assert model_policies.own_members(layers, "bi") == ["bi"]
    assert model_policies.own_members(layers, "bi/forward_gru") == ["bi/forward_gru", "bi/forward_gru/gru_cell"]
    assert model_policies.unit_members(layers, "out") == ["out"] == model_policies.own_members(layers, "out")
    assert model_policies.decision_unit(model_policies.layers_by_path(_nested()), "block/inner_a") == "block/inner_a"


def test_reapply_float32_changes_only_what_lost_it():
    model = _rnn_model()
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    assert model_policies.reapply_float32(model, ["rnn/lstm_cell", "gone"]) == ("rnn",)  # the cell already is
    assert model.get_layer("rnn").dtype_policy.name == "float32" and model.train_function is not None
    assert model_policies.reapply_float32(model, ["rnn/lstm_cell"]) == ()


def test_global_step_counts_every_step_of_ours_and_applied_steps_of_others():
    v = keras.Variable(np.ones(2, "float32"))
    sgd = keras.optimizers.SGD(0.1)
    assert model_policies.global_step(sgd) == 0  # not built: no step has run
    sgd.build([v])
    for _ in range(3):
        sgd.apply([tf.ones(2)], [v])
    assert model_policies.global_step(sgd) == 3
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    ours.build([v])
    for g in (1.0, float("inf"), 1.0):
        ours.apply([tf.fill([2], g)], [v])
    assert int(ours.iterations.numpy()) == 2  # guard: one step was skipped
    assert model_policies.global_step(ours) == 3


class _Owner:
    def __init__(self, state=None):
        self.state = state or {}
        self.restored = []

    def checkpoint_state(self):
        return self.state

    def restore_state(self, state):
        self.restored.append(state)


def test_register_names_owners_by_class_once_each():
    store = model_policies.DecisionStore()
    a, b = _Owner(), _Owner()
    assert [store.register(a), store.register(b), store.register(a)] == ["_Owner", "_Owner_1", "_Owner"]


def test_states_are_json_bytes_and_a_late_owner_gets_its_state():
    source = model_policies.DecisionStore()
    source.register(_Owner({"layers": ["head"], "step": 4}))
    saved = {}
    source.save_own_variables(saved)
    assert saved["_Owner"].dtype == np.uint8
    assert json.loads(saved["_Owner"].tobytes()) == {"layers": ["head"], "step": 4}
    target = model_policies.DecisionStore()
    target.load_own_variables(saved)  # loaded before any callback registered
    resaved = {}
    target.save_own_variables(resaved)  # a save in between keeps what was loaded
    assert resaved["_Owner"].tobytes() == saved["_Owner"].tobytes()
    late = _Owner()
    target.register(late)
    assert late.restored == [{"layers": ["head"], "step": 4}]


def test_decision_store_rides_along_in_the_weights_file(tmp_path):
    model = _nested("float32")
    store = model_policies.decision_store(model)
    assert model_policies.decision_store(model) is store and len(model.weights) == 6  # 3 Dense; nothing added
    store.register(_Owner({"float32": ["block/inner_a"]}))
    model.save_weights(tmp_path / "m.weights.h5")
    twin = _nested("float32")
    owner = _Owner()
    model_policies.decision_store(twin).register(owner)
    twin.load_weights(tmp_path / "m.weights.h5")
    assert owner.restored == [{"float32": ["block/inner_a"]}]

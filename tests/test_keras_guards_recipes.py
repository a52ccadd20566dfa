"""Behaviour guards for the Keras 3.15 internals keras_amp.model_graph / recipes / check rely on.

The sources they stand on are rows of the one guard table (tests/test_keras_guards.py: digests of
Normalization.build/finalize_state, Layer._flatten_layers, Functional.__init__, the trainer's
make_*_function); here is the behaviour a digest cannot show. Each test fails loudly if Keras
changes it; the module named in the test is the one to revisit.
"""

import inspect

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested")


def _graph_model():
    inp = keras.Input((4,), name="x")
    a = keras.layers.Dense(4, name="a")(inp)
    b = keras.layers.Dense(4, name="b")(inp)
    out = keras.layers.Add(name="sum")([a, b])
    return keras.Model(inp, out)


def test_functional_graph_internals_used_by_recipes_graph():
    # model_graph.graph: model._nodes_by_depth, Node.operation, Node.parent_nodes,
    # KerasTensor._keras_history.operation.
    model = _graph_model()
    nodes = [n for depth in model._nodes_by_depth.values() for n in depth]
    edges = {(p.operation.name, n.operation.name) for n in nodes for p in n.parent_nodes}
    assert edges == {("x", "a"), ("x", "b"), ("a", "sum"), ("b", "sum")}
    assert [n.operation.name for n in model.get_layer("a")._inbound_nodes] == ["a"]
    assert model.outputs[0]._keras_history.operation is model.get_layer("sum")
    assert isinstance(model.inputs[0]._keras_history.operation, keras.layers.InputLayer)


def test_flatten_layers_signature_used_by_model_graph():
    # model_graph.children: layer._flatten_layers(include_self=False, recursive=False).
    params = inspect.signature(keras.layers.Layer._flatten_layers).parameters
    assert {"include_self", "recursive"} <= set(params)
    mha = keras.layers.MultiHeadAttention(2, 4)
    x = np.ones((1, 3, 8), "float32")
    mha(x, x)
    children = list(mha._flatten_layers(include_self=False, recursive=False))
    assert mha._query_dense in children and mha not in children


def test_functional_operations_list_operator_nodes_in_graph_order():
    # model_graph.children(operations=True) / graph(): Function.operations holds layers and
    # operator nodes (keras.Operation, not Layer) in graph order; Model.layers only the layers.
    inp = keras.Input((4,), name="x")
    a = keras.layers.Dense(4, name="a")(inp)
    model = keras.Model(inp, keras.layers.Dense(2, name="b")(a * 2.0))
    ops = model.operations
    assert [type(op).__name__ for op in ops] == ["InputLayer", "Dense", "Multiply", "Dense"]
    assert not isinstance(ops[2], keras.layers.Layer) and isinstance(ops[2], keras.Operation)
    assert [l.name for l in model.layers] == ["x", "a", "b"]


def test_a_functional_models_own_policy_does_not_cast_its_inputs():
    # apply_recipe sets the model's own dtype_policy (its staleness record): harmless for a
    # functional model, which converts inputs per Input layer (_convert_input_args = False).
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(2, dtype="float32", kernel_initializer="ones")(inp))
    assert model._convert_input_args is False
    model.dtype_policy = "mixed_float16"
    x = np.full((1, 4), 1.0 + 2.0**-20, "float32")  # float16 would round this to 1.0
    np.testing.assert_array_equal(np.asarray(model(x)), np.full((1, 2), 4 * (1.0 + 2.0**-20), "float32"))


def test_a_policy_set_after_build_is_used_at_the_next_call():
    # apply_recipe sets layer.dtype_policy in place; Keras reads compute_dtype at every call,
    # and an RNN runs its cell with the cell's own policy.
    x = np.ones((1, 3, 4), "float32")
    lstm = keras.layers.LSTM(4, dtype="mixed_bfloat16")
    assert keras.backend.standardize_dtype(lstm(x).dtype) == "bfloat16"
    lstm.dtype_policy = "float32"
    lstm.cell.dtype_policy = "float32"
    assert keras.backend.standardize_dtype(lstm(x).dtype) == "float32"
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in lstm.weights)


def test_trainer_retraces_a_function_set_to_none_or_forced():
    # recipes._reset_compiled_functions sets the functions to None so the next fit/evaluate/predict
    # traces again; auto_precision calls make_train_function(force=True) mid-fit.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    for name in ("train", "test", "predict"):
        attr = f"{name}_function"
        make = getattr(model, f"make_{attr}")
        make()
        first = getattr(model, attr)
        make()
        assert first is not None and getattr(model, attr) is first  # kept while set
        setattr(model, attr, None)
        make()
        second = getattr(model, attr)
        assert second is not None and second is not first
        make(force=True)
        assert getattr(model, attr) is not second


def test_compile_auto_wraps_loss_scale_only_under_mixed_float16_model_policy():
    # check._scaling_findings explains this rule in its message.
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(4, dtype="mixed_float16")(inp))
    model.compile("sgd", "mse")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    keras.config.set_dtype_policy("mixed_float16")
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(4)(inp))
    model.compile("sgd", "mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert "auto_scale_loss" in inspect.signature(keras.Model.compile).parameters


NORMS = {
    "layer_norm": lambda: keras.layers.LayerNormalization(),
    "batch_norm": lambda: keras.layers.BatchNormalization(),
    "group_norm": lambda: keras.layers.GroupNormalization(groups=2),
    "rms_norm": lambda: keras.layers.RMSNormalization(),
}


def _norm_output(make, policy):
    rng = np.random.default_rng(0)
    # float32 inputs around 7e4: above float16's max (65504); squares ~1e9 overflow it too.
    x = (rng.normal(size=(4, 8)) * 1e4 + 7e4).astype("float32")
    layer = make()
    layer.dtype_policy = policy
    return layer, x, np.asarray(layer(x, training=True), dtype=np.float64)


@pytest.mark.parametrize("name", ["batch_norm", "rms_norm"])
def test_stock_batch_and_rms_norm_autocast_float32_inputs_to_float16(name):
    # check._INPUT_AUTOCAST_NORMS are flagged; the recipes' float32 policy holds.
    _, _, stock = _norm_output(NORMS[name], "mixed_float16")
    assert not np.all(np.isfinite(stock))
    _, _, fixed = _norm_output(NORMS[name], "float32")
    assert np.all(np.isfinite(fixed)) and np.abs(fixed).max() < 10


@pytest.mark.parametrize("name", ["layer_norm", "group_norm", "batch_norm", "rms_norm"])
def test_builtin_normalization_statistics(name):
    # layer_kinds.NORMALIZATION_LAYERS (layer/group norm) hold under mixed_float16 for float32 inputs;
    # batch/rms norm hold in the float32 policy apply_recipe gives them.
    policy = "mixed_float16" if name in ("layer_norm", "group_norm") else "float32"
    layer, x, y = _norm_output(NORMS[name], policy)
    x64 = x.astype(np.float64)
    if isinstance(layer, keras.layers.BatchNormalization):
        ref = (x64 - x64.mean(0)) / np.sqrt(x64.var(0) + layer.epsilon)
    elif isinstance(layer, keras.layers.GroupNormalization):
        g = x64.reshape(4, 2, 4)
        ref = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + layer.epsilon)).reshape(4, 8)
    elif isinstance(layer, keras.layers.RMSNormalization):
        ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
    else:
        ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + layer.epsilon)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-2)  # float16 output rounding of values ~O(2)


def test_unit_normalization_overflows_in_float16_so_check_flags_it():
    x = np.full((1, 8), 300.0, "float32")  # sum of squares 720000 > float16 max
    stock = keras.layers.UnitNormalization(dtype="mixed_float16")
    np.testing.assert_array_equal(np.asarray(stock(x), np.float64), 0.0)  # x / sqrt(inf): all zeros
    ours = keras.layers.UnitNormalization(dtype="float32")
    np.testing.assert_allclose(np.asarray(ours(x)), np.full((1, 8), 1 / np.sqrt(8)), rtol=1e-6)


def test_activity_regularizer_penalty_is_computed_in_the_compute_dtype():
    # layer_kinds.op_kind "loss": Layer.__call__ applies the regularizer to the 16-bit output.
    x = np.full((1, 8), 100.0, "float32")  # sum of squares 80000 > float16 max
    stock = keras.layers.ActivityRegularization(l2=1.0, dtype="mixed_float16")
    stock(x)
    assert keras.backend.standardize_dtype(stock.losses[0].dtype) == "float16" and not np.isfinite(float(stock.losses[0]))
    fixed = keras.layers.ActivityRegularization(l2=1.0, dtype="float32")
    fixed(x)
    assert float(fixed.losses[0]) == pytest.approx(80000.0, rel=1e-6)


def test_stock_attention_logits_are_float16_under_mixed_float16():
    # check flags stock MultiHeadAttention: QK^T logits and (dropout/scores path) softmax in float16.
    mha = keras.layers.MultiHeadAttention(1, 4, dtype="mixed_float16")
    x = np.ones((1, 2, 4), "float32")
    _, scores = mha(x, x, return_attention_scores=True)
    assert keras.backend.standardize_dtype(scores.dtype) == "float16"


def test_normalization_caches_its_mean_and_variance_in_the_compute_dtype():
    # recipes._refresh_build_time_state: build() (given mean/variance) and finalize_state()
    # (adapted) cast them to the compute dtype; a later policy change must recompute them, through
    # build_from_config(get_build_config()) or finalize_state().
    dtype = keras.backend.standardize_dtype
    given = keras.layers.Normalization(mean=[0.5], variance=[4.0], dtype="mixed_bfloat16")
    given.build((None, 1))
    assert given.get_build_config() == {"input_shape": (None, 1)}
    assert not given.weights  # build adds variables only when adapting
    assert dtype(given.mean.dtype) == dtype(given.variance.dtype) == "bfloat16"
    given.dtype_policy = "float32"
    assert dtype(given.mean.dtype) == "bfloat16"  # stale until rebuilt
    given.build_from_config(given.get_build_config())
    assert dtype(given.mean.dtype) == "float32" and float(given.variance[0, 0]) == 4.0

    adapted = keras.layers.Normalization(dtype="mixed_bfloat16")
    adapted.adapt(np.array([[1.0], [2.0], [4.0]], "float32"))
    assert dtype(adapted.mean.dtype) == "bfloat16" and dtype(adapted.adapt_mean.dtype) == "float32"
    adapted.dtype_policy = "float32"
    adapted.finalize_state()
    assert dtype(adapted.mean.dtype) == "float32"
    np.testing.assert_allclose(float(adapted.mean[0, 0]), 7.0 / 3.0, rtol=1e-6)

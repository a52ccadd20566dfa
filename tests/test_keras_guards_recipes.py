"""Guards for the Keras 3.15 internals and behaviours keras_amp.recipes / keras_amp.check rely on.

Each test fails loudly if Keras changes the thing underneath; the module named in the test is the
one to revisit.
"""

import inspect

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested")


def test_keras_version_is_the_one_written_against():
    assert keras.__version__.startswith("3.15"), keras.__version__


def _graph_model():
    inp = keras.Input((4,), name="x")
    a = keras.layers.Dense(4, name="a")(inp)
    b = keras.layers.Dense(4, name="b")(inp)
    out = keras.layers.Add(name="sum")([a, b])
    return keras.Model(inp, out)


def test_functional_graph_internals_used_by_recipes_graph():
    # recipes._graph: model._nodes_by_depth, Node.operation, Node.parent_nodes, layer._inbound_nodes,
    # KerasTensor._keras_history.operation.
    model = _graph_model()
    nodes = [n for depth in model._nodes_by_depth.values() for n in depth]
    edges = {(p.operation.name, n.operation.name) for n in nodes for p in n.parent_nodes}
    assert edges == {("x", "a"), ("x", "b"), ("a", "sum"), ("b", "sum")}
    assert [n.operation.name for n in model.get_layer("a")._inbound_nodes] == ["a"]
    assert model.outputs[0]._keras_history.operation is model.get_layer("sum")
    assert isinstance(model.inputs[0]._keras_history.operation, keras.layers.InputLayer)


def test_flatten_layers_signature_used_by_check():
    # check._children: layer._flatten_layers(include_self=False, recursive=False).
    params = inspect.signature(keras.layers.Layer._flatten_layers).parameters
    assert {"include_self", "recursive"} <= set(params)
    mha = keras.layers.MultiHeadAttention(2, 4)
    x = np.ones((1, 3, 8), "float32")
    mha(x, x)
    children = list(mha._flatten_layers(include_self=False, recursive=False))
    assert mha._query_dense in children and mha not in children


def test_clone_model_recursive_passes_leaf_layers_and_takes_input_tensors():
    # apply_recipe: clone_function sees every leaf layer of nested functional models, not the
    # nested model itself; input_tensors keeps the input names.
    inner_in = keras.Input((4,))
    inner = keras.Model(inner_in, keras.layers.Dense(4, name="inner_dense")(inner_in), name="inner")
    inp = keras.Input((4,), name="x")
    model = keras.Model(inp, inner(keras.layers.Dense(4, name="outer_dense")(inp)))
    seen = []

    def clone_function(layer):
        seen.append(layer.name)
        return layer.__class__.from_config(layer.get_config())

    clone = keras.models.clone_model(
        model, input_tensors=keras.Input((4,), name="x"), clone_function=clone_function, recursive=True
    )
    assert sorted(seen) == ["inner_dense", "outer_dense"]
    assert clone.inputs[0].name == "x"


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
    # check._FLOAT32_INSIDE_NORMS (layer/group norm) hold under mixed_float16 for float32 inputs;
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
    # recipes.op_kind "loss": Layer.__call__ applies the regularizer to the 16-bit output.
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


def test_wrappers_rebuild_inner_layers_from_their_own_serialized_configs():
    # recipes._retarget_wrapped: the wrapper's dtype does not reach the layers inside it, so
    # apply_recipe rewrites config["layer"] / config["backward_layer"]. Bidirectional is not a Wrapper.
    bi = keras.layers.Bidirectional(keras.layers.LSTM(4, dtype="mixed_bfloat16"))
    td = keras.layers.TimeDistributed(keras.layers.Dense(4, dtype="mixed_bfloat16"))
    assert not isinstance(bi, keras.layers.Wrapper) and isinstance(td, keras.layers.Wrapper)
    for layer, keys in ((bi, ("layer", "backward_layer")), (td, ("layer",))):
        config = layer.get_config()
        config["dtype"] = "float32"
        assert all(isinstance(config[k]["config"]["dtype"], dict) for k in keys)
        rebuilt = type(layer).from_config(config)
        inner = [rebuilt.forward_layer, rebuilt.backward_layer] if layer is bi else [rebuilt.layer]
        assert [i.dtype_policy.name for i in inner] == ["mixed_bfloat16"] * len(keys)

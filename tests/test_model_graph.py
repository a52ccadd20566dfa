"""keras_amp.model_graph: islands, walking every kind of model, graph regions, staleness."""

import warnings

import keras
import numpy as np
import pytest

import keras_amp
from keras_amp import layer_kinds
from keras_amp import model_graph as mg

pytestmark = pytest.mark.filterwarnings("ignore:mixed_.* requested")


def functional_with_operator_and_nested():
    inp = keras.Input((8,), name="x")
    a = keras.layers.Dense(8, name="a")(inp)
    b = keras.layers.Dense(8, name="b")(inp)
    summed = a + b  # an operator node: a keras.Operation, not a layer
    inner_in = keras.Input((8,))
    inner = keras.Model(inner_in, keras.layers.Dense(8, name="inner_dense")(inner_in), name="inner")
    y = keras.layers.LayerNormalization(name="ln")(inner(summed))
    out = keras.layers.Activation("softmax", name="probs")(keras.layers.Dense(3, name="head")(y))
    return keras.Model(inp, out, name="functional")


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(10, 8, name="embed")
        self.attention = keras.layers.MultiHeadAttention(2, 4, name="attention")
        self.logits = keras.layers.Dense(10, name="logits")

    def call(self, tokens):
        h = self.embed(tokens)
        return self.logits(self.attention(h, h))


def subclassed():
    model = Subclassed(name="sub")
    model(np.zeros((1, 4), "int32"))
    return model


def test_walk_reaches_operator_nodes_nested_and_subclassed_layers():
    model = functional_with_operator_and_nested()
    paths = [p for p, _ in mg.walk(model)]
    assert paths == ["a", "b", "inner", "inner/inner_dense", "ln", "head", "probs"]
    with_ops = dict(mg.walk(model, operations=True))
    ops = [p for p, node in with_ops.items() if not mg.is_layer(node)]
    assert len(ops) == 1 and isinstance(with_ops[ops[0]], keras.Operation)  # the `a + b` node
    sub = dict(mg.walk(subclassed()))
    assert {"embed", "attention", "attention/query", "attention/softmax", "logits"} <= set(sub)
    # into= stops the descent; leaves are what has no sublayers (or is not entered).
    assert "attention/query" not in dict(mg.walk(subclassed(), into=lambda l: not isinstance(l, keras.layers.MultiHeadAttention)))
    assert [p for p, _ in mg.leaves(model)] == ["a", "b", "inner/inner_dense", "ln", "head", "probs"]


def test_walk_yields_a_shared_layer_once():
    shared = keras.layers.Dense(4, name="shared")
    inp = keras.Input((4,))
    model = keras.Model(inp, shared(shared(inp)))
    assert [p for p, _ in mg.walk(model)] == ["shared"]


def test_graph_edges_and_boundaries_cross_operator_nodes_and_nested_models():
    model = functional_with_operator_and_nested()
    g = mg.graph(model)
    assert [n.name for n in g.first] == ["a", "b"] and [n.name for n in g.last] == ["probs"]
    by_id = {id(node): path for path, node in mg.walk(model, operations=True)}
    assert sorted(by_id[i] for i in mg.boundary(model, first=True)) == ["a", "b"]
    # probs (no weights) -> head (weighted): one output region.
    assert sorted(by_id[i] for i in mg.boundary(model, first=False)) == ["head", "probs"]
    # A parameter-free operator node at the input belongs to the first region, up to the weighted layer.
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(2, name="d")(inp * 2.0))
    by_id = {id(node): path for path, node in mg.walk(model, operations=True)}
    first = sorted(by_id[i] for i in mg.boundary(model, first=True))
    assert "d" in first and len(first) == 2


def test_neighbour_dtypes_look_through_operator_nodes_and_stop_at_inputs_and_outputs():
    model = functional_with_operator_and_nested()
    model.get_layer("b").dtype_policy = "mixed_bfloat16"
    by_name = {layer.name: layer for _, layer in mg.walk(model)}
    up = mg.neighbour_dtypes(model, lambda l: l.compute_dtype, upstream=True)
    down = mg.neighbour_dtypes(model, lambda l: l.compute_dtype, upstream=False)
    # The nested model is fed through `a + b`: the dtypes of a and b.
    assert sorted(up[id(by_name["inner"])]) == ["bfloat16", "float32"]
    assert up[id(by_name["ln"])] == ("float32",) and down[id(by_name["ln"])] == ("float32",)
    assert up[id(by_name["a"])] is None  # a model input feeds it
    assert down[id(by_name["probs"])] is None  # it produces the model output
    # The nested model's own graph is mapped too: its layer is fed by the nested model's input.
    assert up[id(by_name["inner_dense"])] is None
    # A subclassed model's layers are not in a graph: unknown.
    assert id(subclassed().logits) not in mg.neighbour_dtypes(subclassed(), str, upstream=True)


def test_graph_refuses_subclassed_models_and_boundary_falls_back_to_attribute_order():
    model = subclassed()
    with pytest.raises(TypeError, match="Received: model of type Subclassed"):
        mg.graph(model)
    by_id = {id(node): path for path, node in mg.walk(model)}
    assert [by_id[i] for i in mg.boundary(model, first=True)] == ["embed"]
    assert [by_id[i] for i in mg.boundary(model, first=False)] == ["logits"]


def test_layer_classes():
    assert keras.layers.Conv2D in mg.CONV_LAYERS and keras.layers.Dense in mg.HEAVY_LAYERS


def test_islands_are_marked_by_class_not_by_attribute():
    class Island(mg.Float32Island, keras.layers.Dense):
        pass

    assert mg.is_island(Island(2)) and not mg.is_island(keras.layers.Dense(2, dtype="float32"))
    # A float32 wrapper's op kind is not its inner layer's: it already computes it in float32.
    class Wrapped(mg.Float32Island, keras.layers.Wrapper):
        def call(self, x):
            return self.layer(x)

    assert layer_kinds.op_kind(Wrapped(keras.layers.Softmax())) is None


def test_stale_model_is_found_without_a_marker_and_fresh_ones_are_not():
    stale = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)], name="stale")
    keras_amp.enable("mixed_bfloat16")
    fresh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    assert mg.is_stale(stale) and not mg.is_stale(fresh)
    with pytest.warns(keras_amp.AmpWarning, match=r"'stale' computes in float32.*built before enable\(\)"):
        assert mg.warn_if_built_before_enable(stale, caller="test") is True
    # Built after enable(), every heavy layer pinned to float32 by hand: deliberate, not stale.
    pinned = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype="float32")])
    # The model's own policy records what it was made for: converting a stale model sets it.
    stale.dtype_policy = "mixed_bfloat16"
    for model in (pinned, stale):
        with warnings.catch_warnings():
            warnings.simplefilter("error", keras_amp.AmpWarning)
            assert mg.warn_if_built_before_enable(model) is False
    keras_amp.disable()
    assert not mg.is_stale(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype="bfloat16")]))


def test_stale_ignores_islands():
    class Head(mg.Float32Island, keras.layers.Dense):
        pass

    keras_amp.enable("mixed_float16")
    inp = keras.Input((4,))
    head_only = keras.Model(inp, Head(2, dtype="float32")(inp))
    head_only.dtype_policy = "float32"  # as if built before enable(); only an island inside
    assert not mg.is_stale(head_only)

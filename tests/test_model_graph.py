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


class Block(keras.layers.Layer):
    """A composite layer holding a layer that its owner also holds (shared in two places)."""

    def __init__(self, shared, **kwargs):
        super().__init__(**kwargs)
        self.shared = shared
        self.own = keras.layers.Dense(2, name="own")


class SharedOwner(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        shared = keras.layers.Dense(2, name="shared")
        self.block = Block(shared, name="block")  # tracked first: the shared layer's first place
        self.shared = shared


def _pairs(entries):
    return [(path, id(node)) for path, node in entries]


def _not_block(layer):
    return not isinstance(layer, Block)


def _not_attention(layer):
    return not isinstance(layer, keras.layers.MultiHeadAttention)


def _nested_sequential():
    inner = keras.Sequential([keras.layers.Dense(4, name="inner_a"), keras.layers.Dense(4, name="inner_b")], name="inner")
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="d"), inner, keras.layers.Dropout(0.1)])


@pytest.mark.parametrize("make, into", [
    (_nested_sequential, lambda l: l.name != "inner"),
    (functional_with_operator_and_nested, lambda l: l.name != "inner"),
    (subclassed, _not_attention),
    (SharedOwner, _not_block),
], ids=["sequential_nested", "functional_operator_nodes", "subclassed", "shared_layer"])
def test_layer_tree_walks_give_what_the_walks_give(make, into):
    model = make()
    tree = mg.layer_tree(model)
    for operations in (False, True):
        for pred in (None, into, lambda l: False):
            assert _pairs(mg.walk(model, operations=operations, into=pred, tree=tree)) == _pairs(
                mg.walk(model, operations=operations, into=pred)), (operations, pred)
    for _, node in mg.walk(model, operations=True):
        for operations in (False, True):
            assert [id(c) for c in tree.children(node, operations=operations)] == [
                id(c) for c in mg.children(node, operations=operations)]
    for upstream in (False, True):
        assert mg.neighbour_dtypes(model, lambda l: l.name, upstream=upstream, tree=tree) == (
            mg.neighbour_dtypes(model, lambda l: l.name, upstream=upstream))
    keras_amp.enable("mixed_bfloat16")  # the models were built under float32: stale
    assert mg.is_stale(model, tree=tree) and mg.is_stale(model)
    assert mg.layer_tree(model, tree) is tree


def test_layer_tree_keeps_a_shared_layer_at_the_first_place_each_walk_enters():
    model = SharedOwner()
    tree = mg.layer_tree(model)
    assert [p for p, _ in mg.walk(model, tree=tree)] == ["block", "block/shared", "block/own"]
    # Not entering `block` hides its entries, so the shared layer's first place is now its second:
    # a walk of the tree is a walk, not the full list filtered by path.
    assert [p for p, _ in mg.walk(model, into=_not_block, tree=tree)] == ["block", "shared"]


def test_layer_tree_reads_policies_fresh_and_belongs_to_one_model():
    model = functional_with_operator_and_nested()
    tree = mg.layer_tree(model)
    model.get_layer("head").dtype_policy = "float16"
    assert dict(mg.walk(model, tree=tree))["head"].dtype_policy.name == "float16"
    with pytest.raises(ValueError, match=r"`tree` must be the LayerTree of `model`.*Received: the tree of 'functional'"):
        list(mg.walk(subclassed(), tree=tree))
    with pytest.raises(TypeError, match="`tree` must be a keras_amp.model_graph.LayerTree or None"):
        mg.walk(model, tree=dict(mg.walk(model)))


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

"""Model inspection: the layer taxonomy, float32 islands, walking any model, its graph, staleness.

The one place that knows how a Keras model is put together. `walk()` reaches every layer of a
Sequential, functional (operator nodes such as `x + y` included on request), nested or subclassed
model; `layer_tree()` reads that once for a caller that walks a model several times (`tree=`);
`graph()` gives a functional model's edges; `boundary()` the layers at its inputs or outputs;
`neighbour_dtypes()` what each layer of a graph takes and feeds; `is_island()` says whether a
layer is a deliberate float32 island; `is_stale()` whether a model was built before
`keras_amp.enable()`. recipes, check and diagnostics stand on this module.

Written against Keras 3.15.1: a functional model's graph is recorded only in private attributes
(`_nodes_by_depth`, `Node.parent_nodes`, `KerasTensor._keras_history`) and a layer's children only
in `Layer._flatten_layers`; keras_amp._compat pins them and tests/test_keras_guards_recipes.py
guards their behaviour.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Iterator

import keras

from keras_amp import _compat
from keras_amp import policy as amp_policy
from keras_amp import validation

# Every Keras convolution class: heavy layers, and the "cnn" recipe's convolutions.
CONV_LAYERS = (
    keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
    keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D, keras.layers.SeparableConv2D,
)
# Layers whose compute dtype decides mixed-precision speed (the matmuls and convolutions).
_FUNCTIONAL = _compat.original("keras.src.models.functional.Functional")
HEAVY_LAYERS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Embedding,
    keras.layers.MultiHeadAttention,
) + CONV_LAYERS


class Float32Island:
    """Marker mixin: a layer that keeps its sensitive numerics in float32 under any policy.

    keras_amp's island layers (`keras_amp.layers.Float32`, `OutputHead`, the float32-inside
    normalisation, attention and recurrent layers) inherit it. An island is correct by
    construction: `check_model` does not flag it, `is_stale` does not count it, and the
    walkers do not look inside it unless asked.
    """


def is_island(layer: Any) -> bool:
    """Whether `layer` is a float32 island (an instance of `Float32Island`)."""
    return isinstance(layer, Float32Island)


def is_graph(layer: Any) -> bool:
    """Whether `layer` is a model whose layer graph Keras records (Sequential or functional)."""
    if isinstance(layer, keras.Sequential):
        return True
    # A functional model is a Functional (its graph lives in Function's `_nodes_by_depth`); on a
    # Keras where that class or its graph changed, the walk is off and says so once.
    return _FUNCTIONAL is not None and _compat.warn_off(_compat.MODEL_GRAPH) and isinstance(layer, _FUNCTIONAL)


def is_layer(node: Any) -> bool:
    """Whether a graph node is a layer (operator nodes such as `x + y` are `keras.Operation`s)."""
    return isinstance(node, keras.layers.Layer)


def children(layer: Any, *, operations: bool = False) -> list:
    """`layer`'s direct sublayers in model order (graph order for Sequential/functional models).

    Input layers are left out. With `operations=True`, a functional model's operator nodes
    (`x + y`, `ops.softmax(x)` applied to symbolic tensors: `keras.Operation`s, not layers)
    are included at their place in the graph.
    """
    operations = validation.check_bool("operations", operations)
    if isinstance(layer, keras.Sequential):
        found = list(layer.layers)
    elif is_graph(layer):
        found = [op for op in layer.operations if operations or is_layer(op)]
    elif is_layer(layer):
        # Keras 3.15 API (also used by summary()): tracked sublayers in attribute order.
        found = list(layer._flatten_layers(include_self=False, recursive=False))
    else:
        return []
    return [c for c in found if not isinstance(c, keras.layers.InputLayer)]


def walk(
    model: Any,
    *,
    operations: bool = False,
    into: Callable[[Any], bool] | None = None,
    tree: LayerTree | None = None,
) -> Iterator[tuple[str, Any]]:
    """Yields `(path, layer)` for every layer under `model`, parents before their children.

    Works on Sequential, functional, nested and subclassed models and on any layer. The path
    is the chain of names below `model` ("block/attention/query"). A layer shared in several
    places is yielded once, at its first place.

    Args:
        model: A `keras.Model` or `keras.layers.Layer`; itself is not yielded.
        operations: Bool, default False. Also yield a functional model's operator nodes
            (`keras.Operation`s, not layers), which have no sublayers.
        into: Callable or None. `into(layer) -> bool` decides whether to visit `layer`'s
            sublayers; None visits all of them. `lambda l: not is_island(l)` stops at islands.
        tree: `LayerTree` or None (default: read `model`). `layer_tree(model)`, read once by a
            caller that walks `model` several times: the walk reads it instead of the model.

    Example:
        >>> for path, layer in keras_amp.model_graph.walk(model):
        ...     print(path, layer.compute_dtype)
    """
    # Checked here, not at the first next(): a generator function would defer the error.
    operations = validation.check_bool("operations", operations)
    if into is not None:
        validation.check_callable("into", into)
    if tree is None:
        return _walk(model, operations, into)
    tree = layer_tree(model, tree)
    return _visit(model, into, lambda layer: tree.children(layer, operations=operations))


def _walk(model: Any, operations: bool, into: Callable[[Any], bool] | None,
          record: dict | None = None) -> Iterator[tuple[str, Any]]:
    """The one reader of a model's layer tree; `record` keeps each layer's `children` by id."""

    def read(layer):
        found = children(layer, operations=operations)
        if record is not None:
            record[id(layer)] = tuple(found)
        return found

    return _visit(model, into, read)


def _visit(model: Any, into: Callable[[Any], bool] | None,
           children_of: Callable[[Any], list]) -> Iterator[tuple[str, Any]]:
    seen: set[int] = set()

    def visit(parent, prefix):
        for child in children_of(parent):
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}{child.name}"
            yield path, child
            if is_layer(child) and (into is None or into(child)):
                yield from visit(child, f"{path}/")

    yield from visit(model, "")


@dataclasses.dataclass(frozen=True, eq=False)
class LayerTree:
    """A model's layer tree, read once by `layer_tree(model)` and passed to every later walk of it.

    It keeps which layers (and operator nodes) sit directly under which, not their dtype
    policies: a walk of it yields the layers themselves, whose policies are read when asked, so
    a policy set in place since is seen. A walk replays `walk`'s visit over the kept lists, so
    `walk(model, into=..., tree=tree)` yields what `walk(model, into=...)` yields, a shared layer
    included (once, at the first place the walk enters). Read it again after something adds
    layers (building an unbuilt model creates the sublayers a layer makes in `build()`).

    Args:
        model: The model (or layer) that was read.
        sublayers: Dict. id(layer) -> tuple `children(layer, operations=True)` for `model` and
            every layer under it.
    """

    model: Any
    sublayers: dict

    def children(self, layer: Any, *, operations: bool = False) -> list:
        """`children(layer, operations=...)`, read from the tree for `model` and the layers under it."""
        operations = validation.check_bool("operations", operations)
        found = self.sublayers.get(id(layer))
        if found is None:  # an operator node (no sublayers), or a layer from elsewhere
            return children(layer, operations=operations)
        return [c for c in found if operations or is_layer(c)]


def layer_tree(model: Any, tree: LayerTree | None = None) -> LayerTree:
    """`model`'s `LayerTree`: `tree` when given (it must be `model`'s), else one walk of `model`."""
    if tree is None:
        sublayers: dict[int, tuple] = {}
        for _ in _walk(model, True, None, sublayers):
            pass
        return LayerTree(model, sublayers)
    validation.check_type("tree", tree, LayerTree, "a keras_amp.model_graph.LayerTree or None")
    if tree.model is not model:
        raise ValueError(
            "`tree` must be the LayerTree of `model` (model_graph.layer_tree(model)). Received: the tree "
            f"of {getattr(tree.model, 'name', tree.model)!r} for model {getattr(model, 'name', model)!r}"
        )
    return tree


def leaves(model: Any, *, into: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """`(path, layer)` for the layers under `model` with no sublayers (or not descended into)."""
    if into is not None:
        validation.check_callable("into", into)
    return [
        (path, layer) for path, layer in walk(model, into=into)
        if not (into is None or into(layer)) or not children(layer)
    ]


@dataclasses.dataclass(frozen=True)
class Graph:
    """A Sequential or functional model's graph, one level deep (nested models are nodes).

    Args:
        nodes: Tuple. Layers and operator nodes in graph order, input layers left out.
        predecessors: Dict. id(node) -> list of nodes feeding it.
        successors: Dict. id(node) -> list of nodes it feeds.
        first: Tuple. Nodes fed by a model input.
        last: Tuple. Nodes producing a model output.
    """

    nodes: tuple
    predecessors: dict
    successors: dict
    first: tuple
    last: tuple


def graph(model: keras.Model) -> Graph:
    """The `Graph` of a Sequential or functional `model`; TypeError for any other model."""
    if isinstance(model, keras.Sequential):
        layers = children(model)
        preds = {id(b): [a] for a, b in zip(layers, layers[1:])}
        succs = {id(a): [b] for a, b in zip(layers, layers[1:])}
        return Graph(tuple(layers), preds, succs, tuple(layers[:1]), tuple(layers[-1:]))
    if not is_graph(model):
        raise TypeError(
            "`model` must be a Sequential or functional keras.Model: a subclassed model's graph is "
            f"not recorded by Keras. Received: model of type {type(model).__name__}"
        )
    preds: dict[int, list] = {}
    succs: dict[int, list] = {}
    first: list = []
    for nodes in model._nodes_by_depth.values():
        for node in nodes:
            op = node.operation
            for parent in node.parent_nodes:
                if isinstance(parent.operation, keras.layers.InputLayer):
                    if op not in first and not isinstance(op, keras.layers.InputLayer):
                        first.append(op)
                    continue
                preds.setdefault(id(op), []).append(parent.operation)
                succs.setdefault(id(parent.operation), []).append(op)
    last: list = []
    for tensor in keras.tree.flatten(model.outputs):
        op = tensor._keras_history.operation
        if op not in last and not isinstance(op, keras.layers.InputLayer):
            last.append(op)
    nodes = tuple(children(model, operations=True))
    order = {id(n): i for i, n in enumerate(nodes)}
    first.sort(key=lambda n: order.get(id(n), 0))
    return Graph(nodes, preds, succs, tuple(first), tuple(last))


def _has_weights(node: Any) -> bool:
    return is_layer(node) and bool(node.weights)


def boundary(model: keras.Model, *, first: bool) -> set[int]:
    """ids of the layers and operator nodes from the inputs (`first`) or outputs up to the first weighted layer.

    "First"/"last" layers are those reached from the inputs (outputs) through parameter-free
    layers and operator nodes up to the first layer with weights, so `Rescaling -> Conv2D` or
    `Dense -> Activation("softmax")` are one region. Nested Sequential/functional models are
    entered; any other layer with sublayers (a wrapper, a composite block) counts as one layer.
    For a subclassed `model`, whose call order Keras does not record, the attribute order of its
    weighted leaves stands in.
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    first = validation.check_bool("first", first)
    found: set[int] = set()
    if not is_graph(model):
        weighted = [layer for _, layer in leaves(model) if layer.weights]
        if weighted:
            found.add(id(weighted[0] if first else weighted[-1]))
        return found
    g = graph(model)
    step = g.successors if first else g.predecessors
    stack, seen = list(g.first if first else g.last), set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if is_graph(node):
            found |= boundary(node, first=first)
        else:
            found.add(id(node))
        if _has_weights(node):
            continue
        stack.extend(step.get(id(node), []))
    return found


def neighbour_dtypes(model: keras.Model, dtype_of: Callable[[Any], str], *, upstream: bool,
                     tree: LayerTree | None = None) -> dict[int, tuple[str, ...] | None]:
    """For each node of every Sequential/functional graph in `model`: the dtypes next to it.

    `upstream=True`: the dtypes of what feeds it; False: of what it feeds. `dtype_of(layer)` says
    what a layer (or nested model) computes in; operator nodes (`x + y`) are looked through to the
    layers around them. None when a model input (upstream) or output (downstream) is among them,
    whose dtype is not a layer's. Layers called from a subclassed model's or a composite layer's
    own code are not in the map: their neighbours are unknown. `tree`: as for `walk`.
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    validation.check_callable("dtype_of", dtype_of)
    upstream = validation.check_bool("upstream", upstream)
    found: dict[int, tuple[str, ...] | None] = {}
    graphs = [model] + [layer for _, layer in walk(model, tree=tree) if is_graph(layer)]
    for owner in graphs:
        if not is_graph(owner) and not isinstance(owner, keras.Sequential):
            continue
        g = graph(owner)
        edges = g.predecessors if upstream else g.successors
        boundary_nodes = {id(n) for n in (g.first if upstream else g.last)}

        def around(node, seen):
            if id(node) in boundary_nodes:
                return None
            dtypes = []
            for n in edges.get(id(node), []):
                if id(n) in seen:
                    continue
                seen.add(id(n))
                if is_layer(n):
                    dtypes.append(dtype_of(n))
                    continue
                inner = around(n, seen)  # an operator node: the layers beyond it
                if inner is None:
                    return None
                dtypes.extend(inner)
            return dtypes

        for node in g.nodes:
            if is_layer(node):
                inner = around(node, {id(node)})
                found[id(node)] = None if inner is None else tuple(inner)
    return found


def _not_island(layer: Any) -> bool:
    return not is_island(layer)


def is_stale(model: Any, *, tree: LayerTree | None = None) -> bool:
    """Whether `model` was built before `keras_amp.enable()` (and not converted since).

    True when a mixed policy is in force, the model's own dtype policy (set from the global
    policy when the model is constructed, and by `apply_recipe`) is another one, and none of
    its heavy layers (Dense, EinsumDense, Embedding, MultiHeadAttention, convolutions; islands
    and what is inside them left out) computes in the policy in force. Needs no mark on the
    model: a `.keras` reload under `enable()` takes the policy in force. `tree`: as for `walk`.
    """
    config = amp_policy.config()
    if config is None or not isinstance(model, keras.layers.Layer):
        return False
    if model.dtype_policy.name == config.policy:
        return False
    heavy = [layer for _, layer in walk(model, into=_not_island, tree=tree) if isinstance(layer, HEAVY_LAYERS)]
    heavy = [layer for layer in heavy if not is_island(layer)]
    return bool(heavy) and all(layer.compute_dtype != config.compute_dtype for layer in heavy)


def warn_if_built_before_enable(model: Any, *, caller: str = "keras_amp") -> bool:
    """Warns (an `AmpWarning`) and returns True when `is_stale(model)`."""
    validation.check_type("caller", caller, str, "a string")
    if not is_stale(model):
        return False
    config = amp_policy.config()
    found = sorted({layer.dtype_policy.name for _, layer in walk(model) if isinstance(layer, HEAVY_LAYERS)})
    warnings.warn(
        f"{caller}: every Dense/Conv/Embedding/attention layer of model {getattr(model, 'name', model)!r} "
        f"computes in {', '.join(found)}, none in keras_amp.enable()'s {config.policy!r}: it was probably "
        "built before enable(), so mixed precision does nothing for it. Build the model after "
        "keras_amp.enable(), or convert it with keras_amp.apply_recipe().",
        amp_policy.AmpWarning,
        stacklevel=3,
    )
    return True

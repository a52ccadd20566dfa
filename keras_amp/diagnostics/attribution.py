"""Op-to-layer attribution: which layer created each op of a traced step (the package's one mapping).

`find_overflow`, the gradient statistics (through `keras_amp.diagnostics.traced_step`) and `audit_model`
stand on this module. While a step is traced, `attributing` wraps each layer's (and each
functional operator node's) `call` for the duration of the trace only, recording which graph ops
it created; `assign_owners` gives each op to the innermost layer that created it. TensorFlow
(2.21) creates the gradient of an op made in name scope S under "gradient_tape/S/", and a scope
is unique in its graph, so each gradient op maps back to the layer that created the ops of S.
Keras casts a layer's inputs to its compute dtype in the caller's scope (a functional model's):
those casts go to the layer they feed, and their gradients, by dataflow, to the layer on the
16-bit side (`_adopt_gradient_casts`).
Loop and branch bodies (an RNN's cell) are graphs of their own, recorded the same way
(`body_owners`); what no layer call created there belongs to the layer running the loop. This is
exact where reading layer names out of scopes is not: scopes are uniquified per graph (with a
layer "dense" called twice beside a layer named "dense_1", a call of "dense" can run in scope
"dense_1"), and subclassed models record no layer graph at all. Written against Keras 3.15.1:
`Layer.__call__` and `Operation.__call__` run `self.call`, so an instance attribute `call`
sees every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import keras
import tensorflow as tf

from keras_amp import model_graph

INPUT = "(input)"
LOSS = "(loss)"
GRADIENT_SUM = "(gradient sum)"
_GRADIENT_PREFIX = "gradient_tape/"


@dataclasses.dataclass
class Trace:
    """What tracing recorded: the ops of the step and their owners, and each layer's outputs.

    Args:
        ops: List of tf.Operation, in creation (topological) order.
        owners: List of str, the layer path owning each op (or INPUT, LOSS, GRADIENT_SUM).
        backward_start: Int. Index of the first op of the backward pass.
        model_end: Int. Index of the first op after the model's call (the loss's first).
        model_outputs: List of the model call's output tensors.
        layer_outputs: Dict path -> list of output tensors (every call of the layer).
        layer_dtypes: Dict path -> the layer's compute dtype.
        graph: The step's FuncGraph while it is traced.
        events: List of `(op count, path, +1 enter / -1 exit)` recorded by `attributing`.
        bodies: Dict id(body graph) -> (graph, events): the same for loop and branch bodies.
    """

    ops: list = dataclasses.field(default_factory=list)
    owners: list = dataclasses.field(default_factory=list)
    backward_start: int = 0
    model_end: int = 0
    model_outputs: list = dataclasses.field(default_factory=list)
    layer_outputs: dict = dataclasses.field(default_factory=dict)
    layer_dtypes: dict = dataclasses.field(default_factory=dict)
    graph: Any = None
    events: list = dataclasses.field(default_factory=list)
    bodies: dict = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def attributing(model: keras.Model, trace: Trace, *, tree: model_graph.LayerTree | None = None):
    """Wraps every sublayer's and operator node's `call` while a step is traced; restores them.

    The traced function must set `trace.graph` to its graph before it calls `model`. `tree`: the
    model's `model_graph.layer_tree`, when the caller has read it (None: the model is walked).
    """
    events = trace.events
    targets = list(model_graph.walk(model, operations=True, tree=tree))
    saved = []
    for path, target in targets:
        had_own = "call" in vars(target)
        original = target.call
        trace.layer_dtypes[path] = getattr(target, "compute_dtype", None)

        def wrapper(*args, __original=original, __path=path, **kwargs):
            graph = tf.compat.v1.get_default_graph()
            if graph is trace.graph:
                log = events
            else:
                # Inside a loop or branch body (an RNN's cell): a graph of its own, see body_owners.
                log = trace.bodies.setdefault(id(graph), (graph, []))[1]
            log.append((len(graph.get_operations()), __path, 1))
            outputs = __original(*args, **kwargs)
            log.append((len(graph.get_operations()), __path, -1))
            if graph is trace.graph:  # a body's tensors cannot be read from the step
                trace.layer_outputs.setdefault(__path, []).extend(
                    t for t in keras.tree.flatten(outputs) if tf.is_tensor(t) and t.dtype.is_floating)
            return outputs

        functools.update_wrapper(wrapper, original)
        # object.__setattr__: a plain function is not state Keras should track; restored below.
        object.__setattr__(target, "call", wrapper)
        saved.append((target, had_own, original))
    try:
        yield
    finally:
        for target, had_own, original in saved:
            if had_own:
                object.__setattr__(target, "call", original)
            else:
                object.__delattr__(target, "call")


def assign_owners(trace: Trace, ops: list, forward_end: int, model_start: int, model_end: int,
                  model_label: str) -> None:
    """Sets `trace.ops`, `.backward_start` and `.owners` from the events `attributing` recorded.

    `ops` are the traced graph's ops in creation order; `model_start:model_end` the model call and
    `forward_end` the start of the backward pass. Ops of the model outside every sublayer are
    owned by `model_label`.
    """
    trace.ops = ops
    trace.backward_start = forward_end
    trace.model_end = model_end
    trace.owners = _owners(ops, trace.events, model_label, forward_end, model_start, model_end)


def _owners(ops: list, events: list, model_name: str, forward_end: int, model_start: int,
            model_end: int) -> list[str]:
    """The innermost layer creating each op; backward ops take their forward op's owner."""
    owners = []
    for i, owner in enumerate(_innermost(forward_end, events)):
        if owner is not None:
            owners.append(owner)
        elif i < model_start:
            owners.append(INPUT)
        elif i < model_end:
            owners.append(model_name)
        else:
            owners.append(LOSS)
    by_scope = _scope_owners(ops[:forward_end], owners, model_name)
    _adopt_input_casts(ops[:forward_end], owners, model_name)
    for op in ops[forward_end:]:
        owners.append(_backward_owner(op.name, by_scope))
    _adopt_gradient_casts(ops, owners, forward_end, model_name)
    return owners


def _innermost(count: int, events: list) -> list[str | None]:
    """For ops 0..count-1 of one graph, the innermost layer whose call was open at its creation."""
    owners = []
    stack: list[str] = []
    events = sorted(events, key=lambda e: e[0])  # stable: same-index enter/exit keep call order
    k = 0
    for i in range(count):
        while k < len(events) and events[k][0] <= i:
            _, path, step = events[k]
            if step == 1:
                stack.append(path)
            elif stack:
                stack.pop()
            k += 1
        owners.append(stack[-1] if stack else None)
    return owners


def body_owners(trace: Trace, body: Any, owner: str) -> list[str]:
    """The layer creating each op of a loop/branch body graph; `owner`, the layer running it, otherwise.

    An RNN's cell, called in its loop's body, owns the ops of its call there. The gradient loop's
    body runs no layer call; TensorFlow (2.21, graph-mode gradients) names its ops
    "gradients/<forward body op>_grad/...", which leads back to the forward op's layer. The rest
    (the loop's bookkeeping) belongs to `owner`.
    """
    ops = body.get_operations()
    graph, events = trace.bodies.get(id(body), (None, []))
    if graph is body:
        return [o if o is not None else owner for o in _innermost(len(ops), events)]
    forward = _body_op_owners(trace)
    return [_body_gradient_owner(op.name, forward) or owner for op in ops]


def _body_op_owners(trace: Trace) -> dict[str, str]:
    """Op name -> layer for the ops layers created in loop/branch bodies (names with two owners left out)."""
    found: dict[str, str | None] = {}
    for graph, events in trace.bodies.values():
        for op, owner in zip(graph.get_operations(), _innermost(len(graph.get_operations()), events)):
            if owner is not None:
                found[op.name] = owner if found.get(op.name, owner) == owner else None
    return {name: owner for name, owner in found.items() if owner is not None}


def _body_gradient_owner(name: str, forward: dict[str, str]) -> str | None:
    """The layer of the forward op X in "...gradients/X_grad/...", or None."""
    ends = [i for i in range(len(name)) if name.startswith("_grad/", i)]
    starts = [i + len("gradients/") for i in range(len(name)) if name.startswith("gradients/", i)]
    for end in reversed(ends):
        for start in starts:
            if start < end and name[start:end] in forward:
                return forward[name[start:end]]
    return None


def _scope_owners(ops: list, owners: list, model_name: str) -> dict[str, str]:
    """Forward name scope -> the layer whose call created the ops directly in it.

    A name scope is unique within a graph, and TensorFlow creates the gradient of an op made in
    scope S under "gradient_tape/S/", so the scope leads back to the forward op's layer. Where
    one scope holds ops of several owners (a functional model's own ops beside its operator
    nodes'), their common enclosing path owns it.
    """
    found: dict[str, set] = {}
    for op, owner in zip(ops, owners):
        found.setdefault(op.name.rpartition("/")[0], set()).add(owner)
    by_scope = {}
    for scope, paths in found.items():
        if len(paths) == 1:
            by_scope[scope] = paths.pop()
        elif not paths & {INPUT, LOSS}:
            split = [p.split("/") if p != model_name else [] for p in paths]
            common = []
            for names in zip(*split):
                if len(set(names)) > 1:
                    break
                common.append(names[0])
            by_scope[scope] = "/".join(common) or model_name
    return by_scope


def _adopt_input_casts(ops: list, owners: list, model_name: str) -> None:
    """Gives a layer the casts of its inputs to its compute dtype.

    Keras casts a layer's inputs in `Layer.__call__` before `call` (outside the layer's name
    scope), so those casts are created in the caller's context; they belong to the layer they feed.
    """
    index = {op.name: i for i, op in enumerate(ops)}
    for i, op in enumerate(ops):
        if op.type != "Cast":
            continue
        consumers = {index[c.name] for t in op.outputs for c in t.consumers() if c.name in index}
        users = {owners[j] for j in consumers}
        if len(users) != 1:
            continue
        owner, caller = users.pop(), owners[i]
        # Only a caller's cast feeding one of its sublayers: a layer's own output cast stays its own.
        if owner not in (INPUT, LOSS, caller) and (caller == model_name or owner.startswith(caller + "/")):
            owners[i] = owner


def _containers(owners: list, model_name: str) -> set[str]:
    """The model and every layer path that holds another owner's path: callers of sublayers."""
    return {model_name} | {o.rsplit("/", k)[0] for o in owners for k in range(1, o.count("/") + 1)}


def float_cast(op: Any) -> tuple[Any, Any] | None:
    """(source dtype, target dtype) of a Cast between float widths (float16 and float32); None otherwise."""
    if op.type != "Cast":
        return None
    src, dst = op.inputs[0].dtype, op.outputs[0].dtype
    return (src, dst) if src.is_floating and dst.is_floating and src.size != dst.size else None


def linked_owners(ops: list, owners: list, i: int, lo: int, *, downstream: bool,
                  index: dict | None = None) -> list[str]:
    """Owners of the ops in `ops[lo:]` that take op i's output (`downstream`) or feed its input.

    Gradient sums (the AddN of a tensor used twice) are looked through to the layers beyond them.
    `index`: op name -> position in `ops`, when the caller has built it.
    """
    index = {op.name: j for j, op in enumerate(ops)} if index is None else index
    seen, todo, found = {i}, [i], []
    while todo:
        op = ops[todo.pop()]
        near = [c for t in op.outputs for c in t.consumers()] if downstream else [t.op for t in op.inputs]
        for j in (index.get(n.name) for n in near):
            if j is None or j < lo or j in seen:
                continue
            seen.add(j)
            if owners[j] == GRADIENT_SUM:
                todo.append(j)
            elif owners[j] not in found:
                found.append(owners[j])
    return found


def _adopt_gradient_casts(ops: list, owners: list, forward_end: int, model_name: str) -> None:
    """Gives the gradient of a caller's cast to the layer on its 16-bit side, found by dataflow.

    The casts `Layer.__call__` makes of a layer's inputs sit in the caller's name scope (a
    functional model's), and so do their gradients: the gradient of a float32 head's input, cast
    down to float16 for the float16 layer whose output fed it, is named after no layer. What it
    casts decides: a cast to a narrower float belongs to the one layer whose gradient ops take its
    output (the gradient of that layer's output), a cast to a wider one to the layer whose
    gradient ops feed it. A caller's own ops taking it (attention's scores) keep it the caller's.
    The loss's cast of a 16-bit output to float32 (Keras's `Loss.__call__`, or a user's loss) is
    such a cast too: its gradient, cast down for the output layer, is that layer's.
    """
    containers = _containers(owners, model_name)
    index = {op.name: j for j, op in enumerate(ops)}
    for i in range(forward_end, len(ops)):
        dtypes = float_cast(ops[i]) if owners[i] in containers or owners[i] == LOSS else None
        if dtypes is None:
            continue
        found = linked_owners(ops, owners, i, forward_end, downstream=dtypes[1].size < dtypes[0].size, index=index)
        if len(found) == 1 and found[0] not in (INPUT, LOSS):
            owners[i] = found[0]


def _backward_owner(name: str, by_scope: dict) -> str:
    if not name.startswith(_GRADIENT_PREFIX):
        return GRADIENT_SUM  # AddN of a tensor used twice, the cast of a gradient to its variable
    # "gradient_tape/<forward scope>/<the gradient function's own names>": the longest prefix that
    # is a forward scope is the forward op's.
    parts = name[len(_GRADIENT_PREFIX):].split("/")
    for end in range(len(parts) - 1, -1, -1):
        owner = by_scope.get("/".join(parts[:end]))
        if owner is not None:
            return owner
    return GRADIENT_SUM

"""`audit_model()`: run one batch and record the dtype each numerically sensitive op ran in.

The forward pass (and, with `backward=True`, the gradient of a scalar made from the outputs) is
traced as one `tf.function` and then executed, so the batch really runs. The traced graph is the
record: each op's type (`Softmax`, `Rsqrt`, `SparseSoftmaxCrossEntropyWithLogits`, ...), its
input dtype, and its name, whose name scopes carry the Keras layer path (Keras opens a name scope
per layer call; autodiff puts the backward ops under "gradient_tape/"). Bodies of `tf.while_loop`
and other function-valued attributes (RNNs) are read too. Because the graph is what actually ran,
raw `tf.*` calls, subclassed models and third-party layers (keras-hub) are covered, not only known
layer classes.

The graph-reading parts (`traced_graph`, `graph_ops`, `layer_path`, `phase_of`, `op_dtype`) are
public for other diagnostics (the overflow locator) to reuse.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator

import keras
import tensorflow as tf

from keras_amp import model_graph, op_rules
from keras_amp import validation

# TF op type -> hazard kind (the kinds of `keras_amp.op_rules.RULES`); a kind is a hazard in the
# dtypes of `op_rules.HAZARD_DTYPES`.
# Left out on purpose: FusedBatchNorm* (TF computes its statistics in float32 for 16-bit x),
# Log/Log1p/Softplus (results fit, kernels round once), Sum/Mean in the backward pass (the
# broadcast reductions autodiff inserts everywhere; the loss-scale optimizer catches overflow).
SENSITIVE_OPS = {
    "Softmax": "softmax",
    "LogSoftmax": "softmax",
    "Rsqrt": "normalization",
    "RsqrtGrad": "normalization",
    "SquaredDifference": "normalization",
    "Exp": "exp",
    "Expm1": "exp",
    "Pow": "exp",
    "SoftmaxCrossEntropyWithLogits": "loss",
    "SparseSoftmaxCrossEntropyWithLogits": "loss",
    "L2Loss": "loss",
    "Mean": "reduction",
    "Sum": "reduction",
    "EuclideanNorm": "reduction",
    "Cumsum": "reduction",
}
KIND_DTYPES = op_rules.HAZARD_DTYPES
_FORWARD_ONLY = ("reduction",)
# Attention scores: a softmax whose logits come, through these elementwise/shape ops, from a matmul
# of two activations (QK^T; a Dense layer's matmul has a weight operand). A 16-bit QK^T overflows
# float16 (entries near 300) even when the softmax after it runs in float32, as in Keras's fused
# `dot_product_attention` path; the audit records that matmul with kind "attention".
_MATMULS = ("Einsum", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "MatMul")
_PASS_THROUGH = (
    "Cast", "Mul", "AddV2", "Add", "Sub", "RealDiv", "SelectV2", "Select", "Maximum", "Minimum",
    "Reshape", "Transpose", "ExpandDims", "Squeeze", "Identity", "Neg", "Tanh", "StopGradient",
)
_WEIGHT_PATH = ("Cast", "Identity", "Reshape", "Transpose", "ExpandDims", "Squeeze")
PHASES = ("forward", "backward")
_GRADIENT_SCOPE = "gradient_tape"


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One sensitive op as it ran.

    Args:
        op_type: String. TensorFlow op type ("Softmax").
        category: String. Hazard kind ("attention", "softmax", "normalization", "exp", "loss",
            "reduction"): `SENSITIVE_OPS`, and "attention" for a QK^T matmul feeding a softmax.
        layer_path: String. Path of the innermost Keras layer whose call ran it ("block/mha"),
            "" for ops outside every layer of the model.
        dtype: String. The dtype it computed in (its first floating-point input).
        phase: String. "forward" or "backward".
        op_name: String. The op's full graph name.
    """

    op_type: str
    category: str
    layer_path: str
    dtype: str
    phase: str
    op_name: str

    @property
    def low_precision(self) -> bool:
        """Whether this op computed in a 16-bit dtype where its kind is a hazard."""
        if self.phase == "backward" and self.category in _FORWARD_ONLY:
            return False
        return self.dtype in KIND_DTYPES.get(self.category, ())


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Every sensitive op of one traced and executed batch, in graph order.

    Args:
        model: String. The model's name.
        records: Tuple of `OpRecord`s (sensitive ops in any dtype).
    """

    model: str
    records: tuple[OpRecord, ...]

    def low_precision(self) -> list[OpRecord]:
        """The sensitive-op records that computed in float16/bfloat16 where that is a hazard."""
        return [r for r in self.records if r.low_precision]

    def __str__(self) -> str:
        low = self.low_precision()
        lines = [f"audit_model({self.model!r}): {len(self.records)} sensitive op(s), {len(low)} in 16 bits"]
        for r in low:
            lines.append(f"  [{r.category}] {r.layer_path or self.model}: {r.op_type} in {r.dtype} ({r.phase})")
        return "\n".join(lines)


def _scalar(outputs: Any) -> tf.Tensor:
    """A float32 scalar depending on every floating-point output."""
    parts = [
        tf.reduce_sum(tf.cast(o, tf.float32))
        for o in keras.tree.flatten(outputs)
        if o is not None and o.dtype.is_floating
    ]
    return tf.add_n(parts) if parts else tf.constant(0.0)


def traced_graph(model: keras.Model, x: Any, *, training: bool = False, backward: bool = True):
    """Traces `model(x)` (+ the backward pass) as a `tf.function`, runs it once; returns the graph."""
    inputs = keras.tree.map_structure(tf.convert_to_tensor, x)

    def step(inputs):
        with tf.GradientTape() as tape:
            total = _scalar(model(inputs, training=training))
        if not backward:
            return total
        # Read after the call: an unbuilt model creates its variables in it.
        grads = [g for g in tape.gradient(total, model.trainable_variables) if g is not None]
        # Returning the gradients keeps every backward op live, so the batch really runs them.
        return total, grads

    function = tf.function(step)
    concrete = function.get_concrete_function(inputs)
    function(inputs)
    return concrete.graph


def graph_ops(graph: tf.Graph, prefix: str = "") -> Iterator[tuple[str, tf.Operation]]:
    """(full name, op) for every op of `graph`, with the bodies of loops/conditionals/calls inside."""
    for op in graph.get_operations():
        name = f"{prefix}{op.name}"
        yield name, op
        for attr in op.node_def.attr.values():
            if not attr.HasField("func"):
                continue
            function = graph._get_function(attr.func.name)  # TF 2.21: the nested FuncGraph's owner
            body = getattr(function, "graph", None)
            if body is not None:
                yield from graph_ops(body, f"{name}/")


def phase_of(op_name: str) -> str:
    """"backward" for ops autodiff created (under "gradient_tape/"), "forward" otherwise."""
    return "backward" if op_name.split("/", 1)[0] == _GRADIENT_SCOPE else "forward"


def _matches(scope: str, name: str) -> bool:
    # TF makes a reused name scope unique by appending "_<n>".
    return scope == name or re.fullmatch(re.escape(name) + r"_\d+", scope) is not None


def _child(layer: Any, scope: str) -> Any:
    found = [c for c in model_graph.children(layer) if model_graph.is_layer(c)]
    for child in found:
        if child.name == scope:
            return child
    return next((c for c in found if _matches(scope, c.name)), None)


def layer_path(op_name: str, model: keras.layers.Layer) -> str:
    """The path below `model` of the innermost layer whose name scope holds `op_name`, or "".

    Scopes that name no sublayer (an op's own scope such as "moments", a while loop) are skipped.
    """
    parts = op_name.split("/")[:-1]
    if parts and parts[0] == _GRADIENT_SCOPE:
        parts = parts[1:]
    if not parts or not _matches(parts[0], model.name):
        return ""
    path, layer = [], model
    for scope in parts[1:]:
        child = _child(layer, scope)
        if child is not None:
            path.append(child.name)
            layer = child
    return "/".join(path)


def _is_weight(tensor: tf.Tensor) -> bool:
    op = tensor.op
    while op.type in _WEIGHT_PATH and op.inputs:
        op = op.inputs[0].op
    return op.type in ("ReadVariableOp", "ResourceGather")


def scores_matmul(softmax: tf.Operation) -> tf.Operation | None:
    """The QK^T matmul (two activation operands) feeding `softmax`'s logits, or None."""
    stack, seen = [t.op for t in softmax.inputs if t.dtype.is_floating], set()
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in _MATMULS:
            operands = [t for t in op.inputs if t.dtype.is_floating]
            if len(operands) == 2 and not any(_is_weight(t) for t in operands):
                return op
        elif op.type in _PASS_THROUGH:
            stack.extend(t.op for t in op.inputs if t.dtype.is_floating)
    return None


def op_dtype(op: tf.Operation) -> str | None:
    """The floating-point dtype `op` computed in: its first float input's, else its first output's."""
    for tensor in list(op.inputs) + list(op.outputs):
        if tensor.dtype.is_floating:
            return tensor.dtype.name
    return None


def audit_model(model: keras.Model, x: Any, *, training: bool = False, backward: bool = True) -> AuditReport:
    """Runs one batch of `model` and records the dtype each sensitive op ran in, by layer path.

    Args:
        model: A `keras.Model` (Sequential, functional, nested, subclassed, keras-hub).
        x: The model's input: a tensor/array, or the dict/list structure the model takes.
        training: Bool, default False. Passed to the model call (dropout and friends).
        backward: Bool, default True. Also trace and run the gradient of the sum of the
            float outputs with respect to the trainable variables.

    Returns:
        An `AuditReport`; `.low_precision()` lists the sensitive ops that ran in 16 bits.

    Example:
        >>> report = keras_amp.diagnostics.audit_model(model, x)
        >>> [(r.layer_path, r.op_type) for r in report.low_precision()]
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    validation.check_bool("training", training)
    validation.check_bool("backward", backward)
    graph = traced_graph(model, x, training=training, backward=backward)
    records, scores = [], set()
    for name, op in graph_ops(graph):
        category = SENSITIVE_OPS.get(op.type)
        dtype = op_dtype(op) if category else None
        if dtype is None:
            continue
        phase = phase_of(name)
        records.append(OpRecord(op.type, category, layer_path(name, model), dtype, phase, name))
        if category == "softmax" and phase == "forward":
            matmul = scores_matmul(op)
            if matmul is not None and matmul.name not in scores:
                scores.add(matmul.name)
                full = name[: len(name) - len(op.name)] + matmul.name  # same (possibly nested) graph
                records.append(
                    OpRecord(matmul.type, "attention", layer_path(full, model), op_dtype(matmul), phase, full)
                )
    return AuditReport(model=model.name, records=tuple(records))

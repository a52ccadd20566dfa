"""`audit_model()`: run one batch and record the dtype each numerically sensitive op ran in.

The forward pass (and, with `backward=True`, the gradient of a scalar made from the outputs) is
traced as one `tf.function` and then executed, so the batch really runs. The traced graph is the
record: each op's type (`Softmax`, `Rsqrt`, `SparseSoftmaxCrossEntropyWithLogits`, ...) and its
input dtype. The layer that ran each op comes from `keras_amp.diagnostics.attribution` (the one
op-to-layer mapping of the package, shared with `find_overflow`): each layer's `call` is
watched while the function is traced, which is exact where name scopes are not (a layer called
twice, a layer named like another's uniquified scope). Backward ops are those the gradient
computation created, by creation order (TF makes some outside the "gradient_tape/" name scope).
Bodies of `tf.while_loop` and other function-valued attributes (RNNs) are read too: an op there
belongs to the layer whose call created it (an RNN's cell), else to the layer running the loop.
Because the graph is what actually ran, raw `tf.*` calls, subclassed models and third-party
layers (keras-hub) are covered, not only known layer classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import keras
import tensorflow as tf

from keras_amp import model_graph, op_rules
from keras_amp.op_rules import dataflow
from keras_amp import validation
from keras_amp.diagnostics import attribution
from keras_amp.diagnostics import user_site

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
_MATMULS = dataflow.MATMULS
_PASS_THROUGH = (
    "Cast", "Mul", "AddV2", "Add", "Sub", "RealDiv", "SelectV2", "Select", "Maximum", "Minimum",
    "Reshape", "Transpose", "ExpandDims", "Squeeze", "Identity", "Neg", "Tanh", "StopGradient", "BiasAdd",
    "BiasAddV1",
)
_WEIGHT_PATH = ("Cast", "Identity", "Reshape", "Transpose", "ExpandDims", "Squeeze")
PHASES = ("forward", "backward")


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
    output_dtypes: tuple[str, ...] = ()  # the model call's outputs as they ran (flattened), not their specs
    output_layers: tuple[str, ...] = ()  # the innermost layer producing each of them ("" when none)

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


def _call(model: keras.Model, inputs: Any, training: bool) -> Any:
    """`model(inputs)`; the model's ValueError or TypeError on the input names the argument `x`."""
    try:
        return model(inputs, training=training)
    except (ValueError, TypeError) as e:
        shapes = keras.tree.map_structure(lambda t: tuple(t.shape), inputs)
        raise type(e)(f"The model {model.name!r} could not run on `x` (shapes {shapes}): {user_site.one_line(e)} "
                      "`x` must be one batch of the model's input (the error it raised is this one's cause).") from e


def trace(model: keras.Model, x: Any, *, training: bool = False, backward: bool = True,
          tree: model_graph.LayerTree | None = None) -> attribution.Trace:
    """Traces `model(x)` (+ the backward pass) with ops attributed to layers; runs it once.

    `tree`: the model's `model_graph.layer_tree`, when the caller has read it (None: walked here).
    """
    inputs = keras.tree.map_structure(tf.convert_to_tensor, x)
    if not model.built:
        # Sublayers a layer creates in build() (MultiHeadAttention's projections) must exist
        # before attribution wraps them; tracing builds the model without running the batch.
        tf.function(lambda i: _call(model, i, training), autograph=False).get_concrete_function(inputs)
        tree = None  # read before the build: without those sublayers
    recorded = attribution.Trace()

    def step(inputs):
        graph = tf.compat.v1.get_default_graph()
        recorded.graph = graph
        model_start = len(graph.get_operations())
        with tf.GradientTape() as tape:
            outputs = _call(model, inputs, training)
            recorded.model_outputs = [t for t in keras.tree.flatten(outputs) if tf.is_tensor(t)]
            model_end = len(graph.get_operations())
            total = _scalar(outputs)
        forward_end = len(graph.get_operations())
        result = total
        if backward:
            grads = [g for g in tape.gradient(total, model.trainable_variables) if g is not None]
            # Returning the gradients keeps every backward op live, so the batch really runs them.
            result = (total, grads)
        attribution.assign_owners(recorded, graph.get_operations(), forward_end, model_start, model_end, "")
        return result

    with attribution.attributing(model, recorded, tree=tree):
        concrete = tf.function(step, autograph=False).get_concrete_function(inputs)
    concrete(inputs)  # the function traced under attribution (calling the tf.function could retrace)
    return recorded


def _owner(owner: str) -> str:
    # The model's own ops, its input conversion, the scalar and gradient sums: outside every layer.
    return "" if owner in (attribution.INPUT, attribution.LOSS, attribution.GRADIENT_SUM) else owner


def graph_ops(trace: attribution.Trace) -> Iterator[tuple[str, tf.Operation, str, str]]:
    """(full name, op, layer path, phase) for every traced op, with loop/branch bodies inside.

    An op in a nested body (a `tf.while_loop`, an RNN's cell) runs in the pass of the op that
    runs the body, and belongs to the layer whose call created it there, else to that op's layer.
    """
    for i, (op, owner) in enumerate(zip(trace.ops, trace.owners)):
        phase = "backward" if i >= trace.backward_start else "forward"
        yield from _with_bodies(trace, op, op.name, trace.graph, _owner(owner), phase)


def _with_bodies(trace, op: tf.Operation, name: str, graph, path: str, phase: str):
    yield name, op, path, phase
    for attr in op.node_def.attr.values():
        if not attr.HasField("func"):
            continue
        function = graph._get_function(attr.func.name)  # TF 2.21: the nested FuncGraph's owner
        body = getattr(function, "graph", None)
        if body is not None:
            owners = attribution.body_owners(trace, body, path)
            for inner, owner in zip(body.get_operations(), owners):
                yield from _with_bodies(trace, inner, f"{name}/{inner.name}", body, owner, phase)


_CALLS = ("PartitionedCall", "StatefulPartitionedCall")

# A tensor seen from inside nested function calls: the (call op, body graph) frames, outermost first.
_Frames = tuple


def _call_body(op: tf.Operation):
    """The body graph of a function-call op (an XLA-compiled `tf.function`'s call), or None."""
    try:
        name = op.get_attr("f").name
    except (ValueError, AttributeError):
        return None
    function = op.graph._get_function(name)  # TF 2.21: the nested FuncGraph's owner
    return getattr(function, "graph", None)


def _outside(tensor: tf.Tensor, frames: _Frames):
    """A body's argument placeholder -> (the call's matching input, the outer frames), else None."""
    if not frames or tensor.op.type != "Placeholder":
        return None
    call, body = frames[-1]
    index = next((i for i, t in enumerate(body.inputs) if t is tensor), None)
    if index is None or index >= len(call.inputs):
        return None
    return call.inputs[index], frames[:-1]


def _is_weight(tensor: tf.Tensor, frames: _Frames = ()) -> bool:
    while True:
        op = tensor.op
        if op.type in _WEIGHT_PATH and op.inputs:
            tensor = op.inputs[0]
            continue
        outer = _outside(tensor, frames)
        if outer is None:
            return op.type in ("ReadVariableOp", "ResourceGather")
        tensor, frames = outer


def scores_matmul(softmax: tf.Operation) -> tuple[str, tf.Operation] | None:
    """The QK^T matmul (two activation operands) feeding `softmax`'s logits, or None.

    Returns `(name, op)`: the matmul's name relative to `softmax`'s graph, "call/inner" when it runs
    inside a function call (keras_amp's float32 scores are an XLA-compiled call whose operands are
    16-bit and whose body casts them to float32 before the einsum).
    """
    stack = [(t, ()) for t in softmax.inputs if t.dtype.is_floating]
    seen = set()
    while stack:
        tensor, frames = stack.pop()
        key = (tensor.name, tuple(id(body) for _, body in frames))
        if key in seen:
            continue
        seen.add(key)
        op = tensor.op
        if op.type in _MATMULS:
            operands = [t for t in op.inputs if t.dtype.is_floating]
            if len(operands) == 2 and not any(_is_weight(t, frames) for t in operands):
                return "/".join([call.name for call, _ in frames] + [op.name]), op
        elif op.type == "IdentityN":
            # tf.custom_gradient (keras_amp's float32 scores) wraps its outputs in IdentityN:
            # output i is input i.
            stack.append((op.inputs[tensor.value_index], frames))
        elif op.type in _CALLS:
            body = _call_body(op)
            if body is not None and tensor.value_index < len(body.outputs):
                stack.append((body.outputs[tensor.value_index], frames + ((op, body),)))
        elif op.type in _PASS_THROUGH:
            stack.extend((t, frames) for t in op.inputs if t.dtype.is_floating)
        else:
            outer = _outside(tensor, frames)
            if outer is not None:
                stack.append(outer)
    return None


def op_dtype(op: tf.Operation) -> str | None:
    """The floating-point dtype `op` computed in: its first float input's, else its first output's."""
    for tensor in list(op.inputs) + list(op.outputs):
        if tensor.dtype.is_floating:
            return tensor.dtype.name
    return None


def audit_model(model: keras.Model, x: Any, *, training: bool = False, backward: bool = True,
                tree: model_graph.LayerTree | None = None) -> AuditReport:
    """Runs one batch of `model` and records the dtype each sensitive op ran in, by layer path.

    Args:
        model: A `keras.Model` (Sequential, functional, nested, subclassed, keras-hub).
        x: The model's input: a tensor/array, or the dict/list structure the model takes.
        training: Bool, default False. Passed to the model call (dropout and friends).
        backward: Bool, default True. Also trace and run the gradient of the sum of the
            float outputs with respect to the trainable variables.
        tree: `keras_amp.model_graph.LayerTree` or None (default: the model is walked). The
            model's `model_graph.layer_tree(model)`, for a caller that has read it already.

    Returns:
        An `AuditReport`; `.low_precision()` lists the sensitive ops that ran in 16 bits.

    Example:
        >>> report = keras_amp.diagnostics.audit_model(model, x)
        >>> [(r.layer_path, r.op_type) for r in report.low_precision()]
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    if x is None:
        raise TypeError("`x` must be the model's input: an array, a tensor or the structure the model "
                        "takes. Received: x=None")
    validation.check_bool("training", training)
    validation.check_bool("backward", backward)
    traced = trace(model, x, training=training, backward=backward, tree=tree)
    path_of, records, scores = {}, [], set()
    for name, op, path, phase in graph_ops(traced):
        path_of[name] = path
        category = SENSITIVE_OPS.get(op.type)
        if op.type == "Sqrt" and phase == "forward" and dataflow.is_statistic(op.inputs[0]):
            category = "normalization"  # (x - mean) / sqrt(var + eps): a root of a statistic
        dtype = op_dtype(op) if category else None
        if dtype is None:
            continue
        records.append(OpRecord(op.type, category, path, dtype, phase, name))
        if category == "softmax" and phase == "forward":
            found = scores_matmul(op)
            full = None if found is None else name[: len(name) - len(op.name)] + found[0]
            if full is not None and full not in scores:
                matmul = found[1]
                scores.add(full)
                # The matmul's own creator: QK^T in an attention layer, the softmax in its sublayer.
                records.append(OpRecord(matmul.type, "attention", path_of.get(full, path),
                                        op_dtype(matmul), phase, full))
    return AuditReport(model=model.name, records=tuple(records),
                       output_dtypes=tuple(t.dtype.name for t in traced.model_outputs),
                       output_layers=_output_layers(traced.model_outputs, path_of, model.name))


def _output_layers(outputs: list, path_of: dict[str, str], model_name: str) -> tuple[str, ...]:
    """The innermost layer whose op produced each output, through the model's own identities and casts
    (a block's last sublayer, where the model's graph names the block)."""
    found = []
    for t in outputs:
        op = t.op
        while path_of.get(op.name, "") in ("", model_name) and op.type in ("Identity", "Cast") and op.inputs:
            op = op.inputs[0].op
        found.append(path_of.get(op.name, ""))
    return tuple(found)

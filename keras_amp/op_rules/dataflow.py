"""Attention scores and normalisation statistics found by dataflow, recomputed in float32.

A softmax does not know how its logits were written: `einsum` with any equation, `ops.matmul`,
`q @ k`, `tf.matmul`, plus a scale, a bias, a mask, reshapes and transposes. The traced graph
does. When a softmax (or log-softmax) is called in graph mode (`fit`, `tf.function` custom
loops, `jit_compile`), `float32_logits` walks its input back through value-preserving
element-wise and shape ops (`SCORES_PATH`) and stops at the first matmul on each path. A matmul
of two activations (no weight operand: QK^T, not a Dense layer) with a 16-bit result is an
attention-score term; DeBERTa's disentangled attention has three, and each is found. When one
is found, the chain from the matmuls to the softmax is rebuilt in float32: each score matmul as
a 16-bit product with float32 accumulation and result (`numerics.attention.float32_scores`), each
op on the path as the same op on float32 operands, and the softmax runs on that. The original
16-bit ops stay in the graph without a consumer; TensorFlow's function runtime and XLA prune
them, so they never run.

Normalisation statistics are found the same way (`float32_statistic`): `rsqrt(x)` or `sqrt(x)`
whose argument comes, through element-wise ops (`+ eps`, a scale), from a mean or sum
reduction, is a statistic; the reduction and its argument (squares, deviations from a mean) are
rebuilt in float32 from the 16-bit leaves, and the result is rounded back to the dtype the
layer's code expects. `x * rsqrt(mean(x**2) + eps)` (T5's and other RMS norms) and
`(x - mean) / sqrt(var + eps)` written with `keras.ops` are both covered.

A 16-bit constant that is infinite on such a path (keras-hub T5's `(1 - mask) * -1e9`, which
float16 rounds to -inf, and 0 * -inf is NaN) is rebuilt in float32 as float32's largest finite
value / 1024 (`_MASK_EXTREME`, with its sign): finite, so `0 * it` is 0, and below any float32 score,
so the mask still removes the position.

Nothing here reads a class, layer or attribute name. In eager execution there is no graph to
read, so these two rules do nothing there (the op-level softmax and normalisation rules still
apply); `keras_amp.diagnostics.audit_model` traces the step and reports what ran.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import numpy as np
import tensorflow as tf

from keras_amp.custom_gradient import is_transparent
from keras_amp.numerics import attention as amp_attention
from keras_amp.op_rules.table import LOW_PRECISION

MATMULS = ("Einsum", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "MatMul")
# Value-preserving element-wise and shape ops a score passes through on its way to a softmax.
# A mask is an `AddV2` of a large negative number or a `SelectV2`; a soft cap is `Tanh`;
# relative-position terms are gathered (`GatherV2`) or sliced.
SCORES_PATH = frozenset({
    "Cast", "Identity", "StopGradient", "Mul", "AddV2", "Add", "Sub", "RealDiv", "Neg", "Maximum",
    "Minimum", "SelectV2", "Select", "Tanh", "Reshape", "Transpose", "ExpandDims", "Squeeze",
    "GatherV2", "GatherNd", "StridedSlice", "Slice", "Tile", "BroadcastTo", "ConcatV2", "Pad",
    "PadV2", "Pack", "BiasAdd",
})
REDUCTIONS = frozenset({"Mean", "Sum"})
# A statistic's chain, as states: from the root's argument ("above": `+ eps`, a scale,
# var = E[x^2] - E[x]^2) to a reduction; inside it ("argument") to the squaring op; inside that
# ("deviation") to a centring `x - mean`; then only to the value being normalised, which is
# taken as it is (the residual stream, a projection: not part of the statistic).
_PASS = frozenset({"Cast", "Identity", "StopGradient", "Reshape", "ExpandDims", "Squeeze"})
_ABOVE = _PASS | {"AddV2", "Add", "BiasAdd", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "Square", "BroadcastTo"}
_SQUARING = frozenset({"Square", "SquaredDifference", "Mul", "Abs", "Pow"})  # Pow: `x ** 2` (Gemma3n)
# Ops whose 16-bit result changes a value (not a cast or a reshape): what makes a chain "16-bit".
_VALUE_PRESERVING = _PASS | {"Transpose", "GatherV2", "GatherNd", "StridedSlice", "Slice", "Tile",
                             "BroadcastTo", "ConcatV2", "Pad", "PadV2", "Pack"}
SCORES, ABOVE, ARGUMENT, DEVIATION, CENTRED = "scores", "above", "argument", "deviation", "centred"


def _next_state(op_type: str, state: str) -> str | None:
    """The walk's state for `op_type`'s inputs when `op_type` is on the path in `state`, else None."""
    if state == SCORES:
        return SCORES if op_type in SCORES_PATH else None
    if op_type in REDUCTIONS:
        return ARGUMENT
    if op_type in _PASS:
        return state
    if state == ABOVE and op_type in _ABOVE:
        return ABOVE
    if state == ARGUMENT and op_type in _SQUARING:
        return DEVIATION
    if state == DEVIATION and op_type == "Sub":
        return CENTRED
    return None


# A walk longer than this is no attention or normalisation chain: left alone.
_MAX_OPS = 400
# A 16-bit infinite constant in a score chain (a mask bias that overflowed, `(1 - mask) * -1e9` in
# float16) becomes this in float32: finite, so `0 * it` stays 0, and below any float32 score with room
# to be scaled or added a few times over (float16's -65504 was not: float32 scores pass it).
_MASK_EXTREME = float(np.finfo(np.float32).max) / 1024
_WEIGHT_PATH = ("Cast", "Identity", "Reshape", "Transpose", "ExpandDims", "Squeeze")


def graph_tensor(x: Any) -> bool:
    """Whether `x` is a tensor of a graph being traced (it has a producing op to read)."""
    return not tf.executing_eagerly() and isinstance(x, tf.Tensor) and hasattr(x, "op")


def _low(t: tf.Tensor) -> bool:
    return t.dtype.is_floating and t.dtype.name in LOW_PRECISION


def is_weight(t: tf.Tensor) -> bool:
    """Whether `t` is a variable's value (through casts and reshapes): a layer's weight."""
    while t.op.type in _WEIGHT_PATH and t.op.inputs:
        t = t.op.inputs[0]
    return t.op.type in ("ReadVariableOp", "ResourceGather", "VarHandleOp")


def is_scores_matmul(op: tf.Operation) -> bool:
    """A matmul/einsum of two activations with a 16-bit result (QK^T and its relatives)."""
    if op.type not in MATMULS or len(op.inputs) != 2 or not _low(op.outputs[0]):
        return False
    return not any(is_weight(t) for t in op.inputs)


def _infinite_constant(t: tf.Tensor) -> bool:
    if t.op.type != "Const" or not _low(t):
        return False
    return bool(np.any(np.isinf(tf.get_static_value(t).astype(np.float32))))


def _up(t: tf.Tensor) -> tf.Tensor:
    """`t` in float32 (a 16-bit infinite constant as a finite float32 extreme, `_MASK_EXTREME`)."""
    if not _low(t):
        return t
    if _infinite_constant(t):
        value = np.clip(tf.get_static_value(t).astype(np.float32), -_MASK_EXTREME, _MASK_EXTREME)
        return tf.constant(value, tf.float32)
    return tf.cast(t, tf.float32)


@functools.lru_cache(maxsize=None)
def _raw_op(op_type: str) -> tuple[Any, tuple[str, ...]]:
    """`tf.raw_ops.<op_type>` and its keyword names: the op def's inputs, then its attributes that
    are not inferred from the inputs, in op-def order (`tf.raw_ops` renames a few: Mean's
    `reduction_indices` is `axis`, so they are matched by position)."""
    fn = getattr(tf.raw_ops, op_type)
    return fn, tuple(p for p in inspect.signature(fn).parameters if p != "name")


def _rebuild(op: tf.Operation, inputs: list) -> tf.Tensor:
    """`op`'s first output recomputed by the same op type and attributes on `inputs`."""
    if op.type == "Cast":
        return inputs[0] if op.outputs[0].dtype.is_floating else tf.cast(inputs[0], op.outputs[0].dtype)
    op_def = op.op_def
    inferred = set()
    for arg in op_def.input_arg:
        inferred.update(a for a in (arg.type_attr, arg.number_attr, arg.type_list_attr) if a)
    values, i = [], 0
    for arg in op_def.input_arg:
        if arg.number_attr or arg.type_list_attr:
            n = op.get_attr(arg.number_attr) if arg.number_attr else len(op.get_attr(arg.type_list_attr))
            values.append(list(inputs[i:i + n]))
            i += n
        else:
            values.append(inputs[i])
            i += 1
    values += [op.get_attr(attr.name) for attr in op_def.attr if attr.name not in inferred]
    fn, names = _raw_op(op.type)
    # tf.raw_ops go through the generated op functions, which record the op on gradient tapes.
    return fn(**dict(zip(names, values)))


def _matmul_equation(op: tf.Operation) -> str | None:
    """The einsum equation of a MatMul / BatchMatMul op, or None when batch dims may broadcast."""
    a, b = op.inputs
    ra, rb = a.shape.rank, b.shape.rank
    if ra is None or ra != rb or ra < 2 or ra > 10:
        return None
    if op.type == "MatMul":
        adj_a, adj_b = op.get_attr("transpose_a"), op.get_attr("transpose_b")
    else:
        adj_a, adj_b = op.get_attr("adj_x"), op.get_attr("adj_y")
    for da, db in zip(a.shape[:-2], b.shape[:-2]):
        if da != db:  # a known 1 against n broadcasts: no closed-form einsum gradient
            return None
    batch = "abcdefgh"[: ra - 2]
    left = batch + ("ji" if adj_a else "ij")
    right = batch + ("kj" if adj_b else "jk")
    return f"{left},{right}->{batch}ik"


def _float32_matmul(op: tf.Operation, xla_scores: bool) -> tf.Tensor:
    """A score matmul's result in float32: 16-bit products, float32 accumulation and result."""
    a, b = op.inputs
    if a.dtype != b.dtype:
        return tf.cast(op.outputs[0], tf.float32)  # mixed 16-bit dtypes: Keras promotes these itself
    equation = op.get_attr("equation").decode() if op.type == "Einsum" else _matmul_equation(op)
    if equation is None:
        # Broadcast batch dims: a float32 matmul of the exact float32 copies (TF's gradient).
        return _rebuild(op, [tf.cast(a, tf.float32), tf.cast(b, tf.float32)])
    return amp_attention.float32_scores(equation, a, b, 1.0, compiled=xla_scores)


class _Walk:
    """One trigger's walk: which tensors reach a target along the path, then their rebuild.

    Scores: a tensor reaches when it is a score matmul's result, a 16-bit infinite constant, or
    a `SCORES_PATH` op's output with a reaching input. Statistics: when it is a reduction, an
    op inside a reduction's argument, or an op above one with a reaching input.
    """

    def __init__(self, state: str, xla_scores: bool = True):
        self._start = state
        self._xla_scores = xla_scores
        self._reach: dict[tuple[str, str], bool] = {}
        self._built: dict[tuple[str, str], tf.Tensor] = {}
        self.low = False  # some value-changing op on a reaching path computed in 16 bits
        self.dtypes: set[str] = set()  # the dtypes value-changing ops on reaching paths compute in

    def _target(self, op: tf.Operation, state: str) -> bool:
        return state == SCORES and is_scores_matmul(op)

    def reaches(self, t: tf.Tensor, state: str | None = None) -> bool:
        state = state or self._start
        key = (t.name, state)
        if key in self._reach:
            return self._reach[key]
        if len(self._reach) > _MAX_OPS:
            raise _TooLong
        self._reach[key] = False  # a graph has no cycles; this only bounds re-entry
        op = t.op
        if is_transparent(op):  # keras_amp's own custom gradient over ops it may rebuild: output i is input i
            self._reach[key] = self.reaches(op.inputs[t.value_index], state)
            return self._reach[key]
        inner = _next_state(op.type, state) if t.dtype.is_floating else None
        if self._target(op, state) or (state == SCORES and _infinite_constant(t)):
            found = True
        elif inner is not None:
            hits = [self.reaches(i, inner) for i in op.inputs if i.dtype.is_floating]
            found = any(hits) or inner in (ARGUMENT, DEVIATION, CENTRED)
        else:
            found = False
        if found and t.dtype.is_floating and op.type not in _VALUE_PRESERVING:
            self.dtypes.add(t.dtype.name)
            self.low = self.low or _low(t)
        self._reach[key] = found
        return found

    def build(self, t: tf.Tensor, state: str | None = None) -> tf.Tensor:
        state = state or self._start
        key = (t.name, state)
        if key in self._built:
            return self._built[key]
        op = t.op
        if is_transparent(op) and self._reach.get(key):
            self._built[key] = self.build(op.inputs[t.value_index], state)
            return self._built[key]
        inner = _next_state(op.type, state) if t.dtype.is_floating else None
        if self._target(op, state):
            result = _float32_matmul(op, self._xla_scores)
        elif self._reach.get(key) and inner is not None:
            inputs = [
                self.build(i, inner) if i.dtype.is_floating and self._reach.get((i.name, inner)) else _up(i)
                for i in op.inputs
            ]
            result = _rebuild(op, inputs)
        else:
            result = _up(t)
        self._built[key] = result
        return result


class _TooLong(Exception):
    pass


def _run(x: Any, state: str, xla_scores: bool = True) -> tf.Tensor | None:
    if not graph_tensor(x) or not x.dtype.is_floating:
        return None
    walk = _Walk(state, xla_scores)
    try:
        if not walk.reaches(x) or not walk.low:
            return None
    except _TooLong:
        return None
    return walk.build(x)


def float32_logits(x: Any, *, xla_scores: bool) -> tf.Tensor | None:
    """`x` (a softmax's input) rebuilt in float32 from its score matmuls, or None.

    `xla_scores`: each score matmul as an XLA computation (`numerics.attention.float32_scores`).

    None when `x` is not a graph tensor, no 16-bit score matmul (or 16-bit infinite constant)
    reaches it through `SCORES_PATH` ops, or the walk exceeds its bound.
    """
    return _run(x, SCORES, xla_scores)


def float32_statistic(x: Any) -> tf.Tensor | None:
    """`x` (a root's argument) rebuilt in float32 when it is a normalisation statistic, or None.

    A statistic: a mean or sum reduction reaches `x` through element-wise ops, and some op on
    that chain computed in 16 bits.
    """
    return _run(x, ABOVE)


def statistic_dtype(x: tf.Tensor) -> str | None:
    """The least precise dtype a value-changing op of `x`'s statistic chain computes in (`x` a
    root's argument), or None when `x` is no normalisation statistic (see `is_statistic`). The one
    definition of a statistic, shared by the op rules, the audit and `layer_kinds`."""
    walk = _Walk(ABOVE)
    try:
        if not (isinstance(x, tf.Tensor) and getattr(x, "graph", None) is not None and walk.reaches(x)):
            return None
    except _TooLong:
        return None
    return min(walk.dtypes, key=lambda d: tf.as_dtype(d).size, default=None)


def is_statistic(x: tf.Tensor) -> bool:
    """Whether graph tensor `x` is computed (through `+ eps`, a scale) from a mean or sum reduction
    of squares or deviations: the argument of a normalisation's root. For the audit."""
    try:
        return isinstance(x, tf.Tensor) and getattr(x, "graph", None) is not None and _Walk(ABOVE).reaches(x)
    except _TooLong:
        return False

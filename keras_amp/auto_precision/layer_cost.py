"""What each layer computes itself in one traced forward pass: its floating-point operations.

`search_precision` asks it which layers are worth a decision. A layer's own operations are the
ops the layer's `call` created and none of its sublayers did (`keras_amp.diagnostics.audit`'s
attribution, the package's one op-to-layer mapping; loop bodies included), counted from their
static shapes in the traced graph:

    matmul, batched matmul, einsum   output elements x contracted size (multiply-adds)
    convolutions                     output elements x kernel elements per output (multiply-adds)
    depthwise convolution            output elements x kernel height x width
    any other floating-point op      output elements (one rounding each)
    selection and data movement      0: relu, max/min, max-pooling, select, abs/neg, reshape,
                                     transpose, slicing, gathers, concatenation, padding, identity,
                                     casts, variable reads; their result is one of their inputs'
                                     values, so a float32 policy cannot make it more precise

So Dropout at inference (no op) and Activation("relu") cost 0, and keras.applications' hard-swish
Activation, which multiplies, does not.
"""

from __future__ import annotations

import math
import re
from typing import Any

import keras

from keras_amp import model_graph
from keras_amp.diagnostics import audit

_EXACT = frozenset((
    "Identity", "IdentityN", "StopGradient", "Cast", "ReadVariableOp", "ResourceGather", "Const",
    "Placeholder", "Relu", "Relu6", "Maximum", "Minimum", "Max", "Min", "MaxPool", "MaxPoolV2",
    "MaxPool3D", "Select", "SelectV2", "Neg", "Abs", "Sign", "Reshape", "Transpose", "ExpandDims",
    "Squeeze", "ConcatV2", "Pack", "Unpack", "Split", "SplitV", "Slice", "StridedSlice", "GatherV2",
    "GatherNd", "Pad", "PadV2", "MirrorPad", "Tile", "BroadcastTo", "ZerosLike", "OnesLike", "Fill",
    "Reverse", "ReverseV2", "TensorListStack", "TensorListFromTensor", "TensorListGetItem",
    "TensorListSetItem", "TensorListReserve", "Enter", "Exit", "Merge", "Switch", "NextIteration",
))
_MATMULS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
_CONVS = ("Conv2D", "Conv3D", "Conv")
_TRANSPOSED_CONVS = ("Conv2DBackpropInput", "Conv3DBackpropInputV2")


def _size(shape) -> int:
    return math.prod(1 if d is None else d for d in shape)


def _shape(tensor) -> list:
    return tensor.shape.as_list() if tensor.shape.rank is not None else []


def _einsum_contracted(op) -> int:
    """The product of the sizes of the indices an einsum sums over (in its inputs, not its output)."""
    equation = op.get_attr("equation")
    equation = equation.decode() if isinstance(equation, bytes) else equation
    inputs, output = equation.replace(" ", "").split("->")
    sizes: dict[str, int] = {}
    for spec, tensor in zip(inputs.split(","), op.inputs):
        shape = _shape(tensor)
        left, _, right = spec.partition("...")
        for letter, dim in zip(left, shape[: len(left)]):
            sizes[letter] = dim or 1
        for letter, dim in zip(right, shape[len(shape) - len(right):] if right else []):
            sizes[letter] = dim or 1
    kept = set(re.sub(r"\.\.\.", "", output))
    return math.prod(size for letter, size in sizes.items() if letter not in kept)


def op_flops(op) -> int:
    """Floating-point operations of one graph op (multiply-adds for matmuls and convolutions)."""
    outputs = [t for t in op.outputs if t.dtype.is_floating]
    if not outputs or op.type in _EXACT or any(attr.HasField("func") for attr in op.node_def.attr.values()):
        return 0  # no float result, an exact op, or a call/loop whose body is counted op by op
    out = _size(_shape(outputs[0]))
    if op.type in _MATMULS:
        a = _shape(op.inputs[0])
        transposed = op.get_attr("transpose_a") if op.type == "MatMul" else op.get_attr("adj_x")
        return out * ((a[-2] if transposed else a[-1]) or 1)
    if op.type == "Einsum":
        return out * _einsum_contracted(op)
    if op.type in _CONVS:
        return out * _size(_shape(op.inputs[1])[:-1])
    if op.type == "DepthwiseConv2dNative":
        return out * _size(_shape(op.inputs[1])[:2])
    if op.type in _TRANSPOSED_CONVS:
        kernel = _shape(op.inputs[1])  # (..., output channels, input channels)
        return _size(_shape(op.inputs[2])) * _size(kernel[:-2]) * (kernel[-2] or 1)
    return out


def _own_weights(layer) -> int:
    inner = {id(v) for child in model_graph.children(layer) for v in child.weights}
    return sum(1 for v in layer.weights if id(v) not in inner)


def layer_flops(model: keras.Model, x: Any, *, tree: model_graph.LayerTree | None = None) -> dict[str, int]:
    """Path -> floating-point operations the layer's own call computed in one forward pass on `x`.

    Traced in inference mode (as `search_precision` measures), under the policies set now.
    `tree`: the model's `model_graph.layer_tree`, when the caller has read it.
    """
    trace = audit.trace(model, x, training=False, backward=False, tree=tree)
    flops: dict[str, int] = {}
    for _, op, path, phase in audit.graph_ops(trace):
        if path and phase == "forward":
            flops[path] = flops.get(path, 0) + op_flops(op)
    return flops


def costs_something(layer, flops: int) -> bool:
    """Whether `layer` is worth a precision decision: weights of its own, or floating-point work."""
    return flops > 0 or _own_weights(layer) > 0

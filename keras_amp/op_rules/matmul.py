"""The matmul rule: 16-bit matmuls inside layers with a `Matmul16DTypePolicy`.

The policy itself (`keras_amp.matmul16_policy`) is a float32 policy; this rule is what makes its
layers' matmuls 16-bit. The rule replaces the TensorFlow backend's `matmul` (which
`keras.ops.matmul` calls by attribute). When the innermost calling layer (`Layer.__call__` runs
`call` inside `name_scope(self.name, caller=self)`, as the scores-einsum rule reads) has this
policy, or is a float32 layer called inside one (an RNN's cell), and both operands are dense
floating tensors, it computes `cast(matmul(cast(a, 16-bit), cast(b, 16-bit)), float32)`: float32
accumulation in the kernel, one rounding of the result to 16 bits, the same numbers as
`keras_amp.layers.LSTM`'s matmuls. A weight read in an RNN's time loop is cast once, before the
loop, and its gradient summed over the steps in float32 (`numerics.islands.weight_matmul`).
Every other matmul calls the original. The check runs while tracing, not at every step.

Not reached: matmuls written as `einsum` (EinsumDense), convolutions (ConvLSTM cells), fused
kernels (cuDNN: a float32 RNN layer on a GPU runs its cuDNN kernel in float32).

A second case, `unautocast_weight`: a mixed layer (16-bit compute, float32 variables) that turned
Keras's autocasting off multiplies a 16-bit activation by its own weight, read as stored. Keras's
`Embedding` sets `autocast=False` (it casts the rows it gathers), so `ReversibleEmbedding`'s
reverse projection, the vocabulary head of keras-hub's language models, reads its untied
`reverse_embeddings` (or, tied, the transposed `embeddings`) in float32 and upcasts the 16-bit
hidden state: a float32 matmul of the largest weight, where Keras documents the projection in the
compute dtype (`reverse_dtype=None`). The rule computes it as `float32_logits`: the weight cast to
the activation's 16-bit dtype, float32 accumulation and the float32 result Keras returns. Its
weight is then read only through a 16-bit cast, so a frozen one is stored in 16 bits
(`keras_amp.memory`) with the same results. A float32 activation (`reverse_dtype="float32"`, an
explicit choice) is left alone, and so is every matmul with autocasting on.

A third case, `upcast_weight`: where this device's 16-bit matmul kernels are Eigen's (bfloat16
without oneDNN, as on an AVX2-only CPU; float16 on a CPU without float16 instructions), which are
slower than its float32 kernels and truncate their sums (`numerics.islands.float32_kernels`), a
16-bit activation times a 2-D weight of its dtype (Dense, and a weight Keras's autocast reads) is
computed from float32 kernels on exact upcasts of both operands, forward and backward, each product
rounded once to the 16-bit dtype: the product Keras asks for, rounded once where Eigen truncates.
The einsum-rows rule does the same for EinsumDense. Products of two activations (attention scores)
are the scores rules'. Not under XLA, nor in a SavedModel being written.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from keras_amp.dtypes import LOW_PRECISION
from keras_amp.matmul16_policy import Matmul16DTypePolicy
from keras_amp.numerics.islands import (autocast_scope_dtype, calling_layers, cast_weight, float32_kernels,
                                        upcast_matmul, weight_matmul)
from keras_amp.numerics.logits_matmul import float32_logits
from keras_amp.op_rules.dataflow import is_weight

# Ops between a variable's read and a matmul operand that only move values (a tied head transposes).
_MOVES = ("Identity", "Transpose")


def innermost_caller() -> Any:
    """The innermost layer whose `call` is running, or None."""
    callers = calling_layers()
    return callers[0] if callers else None


def matmul16_policy() -> Matmul16DTypePolicy | None:
    """The policy of the nearest calling layer with a `Matmul16DTypePolicy`, when every layer
    called inside it computes in float32 (an RNN's float32 cell, a float32 sublayer); else None."""
    for caller in calling_layers():
        policy = getattr(caller, "dtype_policy", None)
        if isinstance(policy, Matmul16DTypePolicy):
            return policy
        if getattr(policy, "compute_dtype", None) != "float32":
            return None
    return None


def _dense(x: Any) -> bool:
    return not isinstance(x, (tf.SparseTensor, tf.RaggedTensor))


def _is_weight_read(x: Any) -> bool:
    """A Keras variable, or (graph mode) a tensor read from a variable through transposes."""
    if isinstance(x, keras.Variable):
        return keras.backend.is_float_dtype(x.dtype) and x._autocast
    op = getattr(x, "op", None) if not tf.executing_eagerly() else None
    while op is not None and op.type in _MOVES and op.inputs:
        op = op.inputs[0].op
    return op is not None and op.type == "ReadVariableOp" and op.outputs[0].dtype.is_floating


def unautocast_weight(x1: Any, x2: Any) -> str | None:
    """The 16-bit dtype in which `x1 @ x2` is a mixed layer's activation times a weight read
    without autocasting (module doc), or None."""
    caller = innermost_caller()
    policy = getattr(caller, "dtype_policy", None)
    low = getattr(policy, "compute_dtype", None)
    if low not in LOW_PRECISION or getattr(policy, "variable_dtype", None) != "float32":
        return None
    if autocast_scope_dtype() is not None or not (_dense(x1) and _dense(x2)):
        return None  # autocasting is on: Keras already casts the weight
    dtype = getattr(x1, "dtype", None)  # None for a Python list: left to the original
    if dtype is None or keras.backend.standardize_dtype(dtype) != low:
        return None
    if len(getattr(x1, "shape", ())) < 2 or len(getattr(x2, "shape", ())) != 2:
        return None
    return low if _is_weight_read(x2) else None


def _rank(x: Any) -> int | None:
    """`x`'s number of axes, None where unknown (a Python list, a tensor of unknown rank)."""
    shape = getattr(x, "shape", None)
    try:
        return None if shape is None else len(shape)
    except (TypeError, ValueError):  # TensorShape(None)
        return None


def upcast_weight(x1: Any, x2: Any) -> bool:
    """Whether `x1 @ x2` is a 16-bit activation (rank 2 or more) times a 2-D weight read in its
    dtype (an autocast variable, or a variable's value in graph mode), built where this device's
    16-bit matmul kernels are Eigen's (`islands.float32_kernels`): module doc."""
    if not (_dense(x1) and _dense(x2)) or (_rank(x1) or 0) < 2 or _rank(x2) != 2:
        return False
    dtypes = [getattr(x, "dtype", None) for x in (x1, x2)]
    if any(d is None for d in dtypes):
        return False
    low = keras.backend.standardize_dtype(dtypes[0])
    if low not in LOW_PRECISION or keras.backend.standardize_dtype(dtypes[1]) != low:
        return False
    weight = isinstance(x2, keras.Variable) or (not tf.executing_eagerly() and hasattr(x2, "op") and is_weight(x2))
    return weight and float32_kernels(low)


def matmul16(original: Callable) -> Callable:
    def matmul(x1, x2):
        policy = matmul16_policy()
        if policy is None:
            low = unautocast_weight(x1, x2)
            if low is not None:
                return float32_logits(x1, tf.cast(x2, low))
            if upcast_weight(x1, x2):
                return upcast_matmul(tf.convert_to_tensor(x1), tf.convert_to_tensor(x2), original)
            return original(x1, x2)
        if not (_dense(x1) and _dense(x2)):
            return original(x1, x2)
        dtypes = [getattr(x, "dtype", None) for x in (x1, x2)]  # Python lists: left to the original
        if not all(d is not None and keras.backend.is_float_dtype(d) for d in dtypes):
            return original(x1, x2)
        out_dtype = keras.backend.result_type(*dtypes)
        low = policy.matmul_dtype
        if isinstance(x2, keras.Variable) and len(x2.shape) == 2:  # a cell's kernel: summed in float32 over steps
            return tf.cast(weight_matmul(cast_weight(x1, low), x2, low, matmul=original), out_dtype)
        return tf.cast(original(cast_weight(x1, low), cast_weight(x2, low)), out_dtype)

    matmul.__name__ = matmul.__qualname__ = original.__name__
    return matmul

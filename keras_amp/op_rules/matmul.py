"""The matmul rule: 16-bit matmuls inside layers with a `Matmul16DTypePolicy`.

The policy itself (`keras_amp.matmul16_policy`) is a float32 policy; this rule is what makes its
layers' matmuls 16-bit. The rule replaces the TensorFlow backend's `matmul` (which
`keras.ops.matmul` calls by attribute). When the innermost calling layer (`Layer.__call__` runs
`call` inside `name_scope(self.name, caller=self)`, as the scores-einsum rule reads) has this
policy, or is a float32 layer called inside one (an RNN's cell), and both operands are dense
floating tensors, it computes `cast(matmul(cast(a, 16-bit), cast(b, 16-bit)), float32)`: float32
accumulation in the kernel, one rounding of the result to 16 bits, the same numbers as
`keras_amp.layers.LSTM`'s matmuls. A weight read in an RNN's time loop is cast once, before the
loop (`numerics.islands.cast_weight`). Every other matmul calls the original. The check runs
while tracing, not at every step.

Not reached: matmuls written as `einsum` (EinsumDense), convolutions (ConvLSTM cells), fused
kernels (cuDNN: a float32 RNN layer on a GPU runs its cuDNN kernel in float32).
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from keras_amp.matmul16_policy import Matmul16DTypePolicy
from keras_amp.numerics.islands import calling_layers, cast_weight


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


def matmul16(original: Callable) -> Callable:
    def matmul(x1, x2):
        policy = matmul16_policy()
        if policy is None:
            return original(x1, x2)
        if not (_dense(x1) and _dense(x2)):
            return original(x1, x2)
        dtypes = [getattr(x, "dtype", None) for x in (x1, x2)]  # Python lists: left to the original
        if not all(d is not None and keras.backend.is_float_dtype(d) for d in dtypes):
            return original(x1, x2)
        out_dtype = keras.backend.result_type(*dtypes)
        low = policy.matmul_dtype
        return tf.cast(original(cast_weight(x1, low), cast_weight(x2, low)), out_dtype)

    matmul.__name__ = matmul.__qualname__ = original.__name__
    return matmul

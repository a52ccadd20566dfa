"""The einsum-rows rule: an activation times a weight, as one 2-D matmul of the activation's rows.

Keras's TensorFlow `einsum` writes an EinsumDense's equations (`abc,cde->abde` splitting heads,
`abcd,cde->abe` merging them, `abc,cd->abd`) as `tf.matmul` of the rank-3 input by the kernel
reshaped to 2-D: a batched matmul with the kernel broadcast over the batch. Its values are the
same dot products as one 2-D matmul of the input's rows, but in 16 bits two things differ:

    the kernel's gradient: TensorFlow's batched-matmul gradient is a product per batch element,
        each rounded to 16 bits, then summed over the batch; as one 2-D matmul it is one product
        over every row with float32 accumulation, rounded once (bfloat16, (32, 128, 256) input:
        99.98% of entries correctly rounded against 57.6%);
    fusion: a bias added after the 2-D matmul (the bias rule, `bias_add.py`) is fused into it by
        oneDNN (float32 addition, one rounding); after a batched matmul and a reshape it is not.

So in graph mode the rule rebuilds such a batched matmul as `reshape(matmul(rows, kernel))`, where
nothing else reads it yet (it was made inside Keras's `einsum`), and leaves the original without a
consumer, to be pruned. Only where one operand is rank 3 or more and the other a 2-D weight (a
variable's value: an einsum of two activations may be an attention score term, which the scores
rule finds by its matmul), the first not adjointed, both of the result's 16-bit dtype. Any other
einsum, and eager execution, is Keras's. Where the device's 16-bit matmul kernels are Eigen's
(`numerics.islands.float32_kernels`), the 2-D matmul is float32 kernels' on exact upcasts, rounded
once, forward and backward (the matmul rule's third case).
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from keras_amp.dtypes import LOW_PRECISION
from keras_amp.numerics.islands import float32_kernels, upcast_matmul
from keras_amp.op_rules.dataflow import is_weight

_BATCH_MATMULS = ("BatchMatMulV2", "BatchMatMulV3")


def weight_matmul(m: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, bool] | None:
    """(a, b, transpose_b) where `m` is a batched matmul of a rank-3+ `a` by a 2-D weight `b` (a
    variable's value, `dataflow.is_weight`) broadcast over its batch axes, all three of one 16-bit
    dtype, `a` not adjointed; else None. In graph mode only."""
    if tf.executing_eagerly() or not hasattr(m, "op") or m.op.type not in _BATCH_MATMULS:
        return None
    op = m.op
    a, b = op.inputs[0], op.inputs[1]
    if op.get_attr("adj_x") or a.shape.rank is None or a.shape.rank < 3 or b.shape.rank != 2:
        return None
    if m.dtype.name not in LOW_PRECISION or not a.dtype == b.dtype == m.dtype or a.shape[-1] is None:
        return None
    if not is_weight(b):  # two activations (DeBERTa's relative-position score terms): the scores rule's
        return None
    return a, b, op.get_attr("adj_y")


def as_rows(y: tf.Tensor) -> tf.Tensor | None:
    """`y` rebuilt on one 2-D matmul of the activation's rows (module doc), or None where `y` is not
    such a batched matmul, or that matmul's reshape, that nothing else reads."""
    if tf.executing_eagerly() or not hasattr(y, "op") or y.consumers():
        return None
    m, shape = y, None
    if y.op.type == "Reshape":
        m, shape = y.op.inputs[0], y.op.inputs[1]
        if m.consumers() != [y.op]:
            return None
    found = weight_matmul(m)
    if found is None:
        return None
    a, b, transpose_b = found
    rows = tf.reshape(a, [-1, a.shape[-1]])
    if float32_kernels(rows.dtype):  # Eigen's 16-bit kernels: float32 ones on exact upcasts (matmul rule)
        rows = upcast_matmul(rows, tf.transpose(b) if transpose_b else b)
    else:
        rows = tf.matmul(rows, b, transpose_b=transpose_b)
    if shape is None:
        shape = tf.concat([tf.shape(a)[:-1], tf.shape(rows)[-1:]], 0)
    out = tf.reshape(rows, shape)
    out.set_shape(y.shape)
    return out


def einsum_rows(original: Callable) -> Callable:
    """Replaces the TF backend's `einsum`: its result rebuilt by `as_rows` where that applies."""

    def einsum(subscripts, *operands, **kwargs):
        y = original(subscripts, *operands, **kwargs)
        rebuilt = as_rows(y) if isinstance(y, tf.Tensor) else None
        return y if rebuilt is None else rebuilt

    einsum.__name__ = einsum.__qualname__ = original.__name__
    return einsum

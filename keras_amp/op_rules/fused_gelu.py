"""A bfloat16 gelu fused into its matmul for inference, on a CPU with oneDNN.

keras_amp computes gelu in float32 from the 16-bit pre-activation (`upcast_recompute_gelu`): one XLA
computation that reads the bfloat16 tensor and writes the bfloat16 result. For inference, oneDNN
does better: TensorFlow's remapper fuses `MatMul -> BiasAdd -> gelu` of bfloat16 tensors into one
`_MklFusedMatMul` whose epilogue adds the bias and applies gelu to the float32 accumulator, rounding
once. That is the float32 gelu of the float32 pre-activation, one rounding fewer than keras_amp's
own path, and the activation costs a fraction of a separate pass over memory.

The fusion needs what the remapper matches, so this path is taken only where it is certain:

- graph mode, with no gradient tape recording (`could_possibly_record`): training keeps the
  pre-activation for the gradient, and a second consumer stops the fusion;
- bfloat16 on a CPU where oneDNN runs bfloat16 natively (`hardware.DeviceInfo.cpu_fast_bfloat16`),
  no GPU or TPU;
- the pre-activation is a `BiasAdd` of a 2-D `MatMul` (Keras's Dense; through the bias rule's
  transparent IdentityN), or its reshape that keeps the last axis (a Dense on a sequence: gelu is
  applied to the rows, then reshaped), read by nothing else yet.

Anywhere else the float32 path stays: an unfused bfloat16 gelu would round after every op. One case
cannot be seen when the gelu is traced: a reader of the pre-activation added after it (Keras's Dense
has none; code that returns the pre-activation too). There the remapper does not fuse, and that gelu
runs as TensorFlow's bfloat16 ops: stock mixed_bfloat16's numerics (no overflow in bfloat16), tested.
Rebuilding the matmul for the gelu does not avoid it: Grappler merges the copy back first.
"""

from __future__ import annotations

import tensorflow as tf

from keras_amp import _compat
from keras_amp.custom_gradient import is_transparent
from keras_amp.numerics import islands
from keras_amp.op_rules import bias_add

_could_possibly_record = _compat.original("tensorflow.python.eager.record.could_possibly_record")


def device_fuses() -> bool:
    """Whether this machine's devices run the fused bfloat16 kernel: a CPU alone, oneDNN bfloat16 native."""
    return islands.native_bfloat16_cpu()


def _matmul_bias(x16: tf.Tensor) -> tf.Tensor | None:
    """The BiasAdd of a 2-D MatMul (through the bias rule's IdentityN) that `x16` is, or that `x16`
    reshapes with its last axis kept (the bias rule's Dense on a sequence), each read by nothing else
    so far; else None."""
    if len(x16.consumers()) > 1:
        return None
    rows = bias_add.reshaped_rows(x16)
    if rows is not None and len(rows.consumers()) > 1:
        return None
    t = x16 if rows is None else rows
    op = t.op
    if is_transparent(op):
        if t.value_index != 0:
            return None
        op = op.inputs[0].op
    if op.type != "BiasAdd":
        return None
    matmul = op.inputs[0]
    # Pruned before the remapper runs: the bias rule's IdentityN, and a reshape read by nothing (the
    # one the bias rule replaced: tensordot's, of the matmul's rows back to the input's rank).
    readers = [c for c in matmul.consumers()
               if not is_transparent(c) and not (c.type == "Reshape" and not c.outputs[0].consumers())]
    return t if matmul.op.type == "MatMul" and matmul.shape.rank == 2 and len(readers) == 1 else None


def inference_gelu(x16: tf.Tensor, approximate: bool, out_dtype: tf.DType) -> tf.Tensor | None:
    """`gelu(x16)` as the fusable bfloat16 op, cast to `out_dtype`, where the module doc's conditions
    hold; else None (the caller computes it in float32)."""
    if (x16.dtype != tf.bfloat16 or tf.executing_eagerly() or not device_fuses()
            or not _compat.warn_off(_compat.OP_GELU_FUSION) or _could_possibly_record()):
        return None
    biased = _matmul_bias(x16)
    if biased is None:
        return None
    y = tf.nn.gelu(biased, approximate=approximate)
    if biased is not x16:  # element-wise: gelu of the rows, then x16's reshape
        y = tf.reshape(y, x16.op.inputs[1])
        y.set_shape(x16.shape)
    return tf.cast(y, out_dtype)

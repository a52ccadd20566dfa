"""Layer normalisation as oneDNN's fused float32 kernel, for inference on a CPU.

keras_amp's layer normalisation (`upcast_recompute.py`) is Keras's float32 arithmetic on the
upcast: moments, rsqrt, scale and shift as separate TensorFlow ops, each a pass over a float32
tensor. For inference, TensorFlow's oneDNN build has one kernel for all of it, `_MklLayerNorm`
(mean and variance over the last axis, then scale and offset). Fed the same float32 upcast and
Keras's float32 gamma and beta, it computes the same float32 normalisation in one pass, and the
result is rounded to 16 bits once, as before: the same numbers up to float32 rounding.

TensorFlow has no Python function for that op (the remapper makes it from a pattern Keras's ops
do not match), so it is created by name, pinned by its registered op def (`_compat`), and taken
only where it is certain to run and nothing needs its gradient (it has none):

- graph mode, with no gradient tape recording (`could_possibly_record`);
- a CPU alone with oneDNN on (`hardware.DeviceInfo.onednn_enabled`), no GPU or TPU (no other kernel);
- normalisation over the last axis only, of a statically known size, with gamma and beta (if any)
  of that size.

Anywhere else, keras_amp's float32 ops stay.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from keras_amp import _compat, hardware

_could_possibly_record = _compat.original("tensorflow.python.eager.record.could_possibly_record")
OP_TYPE = "_MklLayerNorm"


@functools.lru_cache(maxsize=None)
def device_fuses() -> bool:
    """Whether this machine runs the fused kernel: a CPU alone, with oneDNN on."""
    device = hardware.detect()
    return not device.gpus and not device.tpu_count and device.onednn_enabled is True


def _vector(p: tf.Tensor | None, size: int, fill: float) -> tf.Tensor | None:
    """`p` as a (size,) float32 vector (`fill` where None), or None where it is not one of that size."""
    if p is None:
        return tf.fill([size], tf.constant(fill, tf.float32))
    if p.dtype != tf.float32 or p.shape.num_elements() != size:
        return None
    return tf.reshape(p, [size]) if p.shape.rank != 1 else p


def inference_layer_norm(x: tf.Tensor, gamma: tf.Tensor | None, beta: tf.Tensor | None,
                         axes: list[int], epsilon: float) -> tf.Tensor | None:
    """The float32 layer normalisation of the float32 `x` over `axes`, as one fused kernel where the
    module doc's conditions hold; else None (the caller computes it op by op)."""
    rank = x.shape.rank
    if (tf.executing_eagerly() or x.dtype != tf.float32 or rank is None or axes != [rank - 1]
            or x.shape[-1] is None or not device_fuses()
            or not _compat.warn_off(_compat.OP_LAYER_NORM_FUSION) or _could_possibly_record()):
        return None
    size = x.shape[-1]
    scale, offset = _vector(gamma, size, 1.0), _vector(beta, size, 0.0)
    if scale is None or offset is None:
        return None
    rows = tf.reshape(x, [-1, size])
    graph = tf.compat.v1.get_default_graph()
    op = graph.create_op(
        OP_TYPE, [rows, scale, offset], [tf.float32], name="fused_layer_norm",
        attrs={"T": tf.compat.v1.AttrValue(type=tf.float32.as_datatype_enum),
               "epsilon": tf.compat.v1.AttrValue(f=float(epsilon))})
    y = tf.reshape(op.outputs[0], tf.shape(x))
    y.set_shape(x.shape)
    return y

"""Layer normalisation's forward pass as oneDNN's fused float32 kernel, on a CPU.

keras_amp's layer normalisation (`upcast_recompute.py`) is Keras's float32 arithmetic on the
upcast: moments, rsqrt, scale and shift as separate TensorFlow ops, each a pass over a float32
tensor. TensorFlow's oneDNN build has one kernel for the forward pass, `_MklLayerNorm` (mean and
variance over the last axis, then scale and offset). Fed the same float32 upcast and Keras's
float32 gamma and beta, it computes the same float32 normalisation in one pass, and the result is
rounded to 16 bits once, as before: the same numbers up to float32 rounding.

The kernel has no gradient: keras_amp's custom gradient around it (`upcast_recompute`) computes
the same backward pass as without it, from the mean and variance recomputed there from the 16-bit
input (the op-by-op forward pass keeps them from its own). TensorFlow has no Python function for
the op (its remapper makes it from a pattern Keras's ops do not match), so it is created by name,
pinned by its registered op def (`_compat`), and taken only where it is certain to run:

- graph mode, outside XLA (`jit_compile=True`: XLA has no kernel for the op), and not while
  `tf.saved_model.save` traces (`model.export()`): a SavedModel keeps portable ops (the op exists
  only in oneDNN builds of TensorFlow). A function traced before it is saved is saved as traced;
- a CPU alone with oneDNN on (`hardware.DeviceInfo.onednn_enabled`), no GPU or TPU (no other kernel);
- normalisation over the last axis only, of a statically known size, with gamma and beta (if any)
  of that size.

Anywhere else, keras_amp's float32 ops stay.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from keras_amp import _compat, hardware

OP_TYPE = "_MklLayerNorm"
_in_save_context = _compat.original("tensorflow.python.saved_model.save_context.in_save_context")
_in_xla_context = _compat.original("tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext")


@functools.lru_cache(maxsize=None)
def device_fuses() -> bool:
    """Whether this machine runs the fused kernel: a CPU alone, with oneDNN on."""
    device = hardware.detect()
    return not device.gpus and not device.tpu_count and device.onednn_enabled is True


def fusable(x: tf.Tensor, gamma: tf.Tensor | None, beta: tf.Tensor | None, axes: list[int]) -> bool:
    """Whether the float32 layer normalisation of `x` over `axes` can be the fused kernel (module doc)."""
    rank = x.shape.rank
    if (tf.executing_eagerly() or x.dtype != tf.float32 or rank is None or axes != [rank - 1]
            or x.shape[-1] is None or not device_fuses() or not _compat.warn_off(_compat.OP_LAYER_NORM_FUSION)
            or _in_save_context() or _in_xla_context(tf.compat.v1.get_default_graph())):
        return False
    return all(p is None or (p.dtype == tf.float32 and p.shape.num_elements() == x.shape[-1]) for p in (gamma, beta))


def layer_norm(x: tf.Tensor, gamma: tf.Tensor | None, beta: tf.Tensor | None, epsilon: float) -> tf.Tensor:
    """The float32 layer normalisation of the float32 `x` over its last axis, one fused kernel; only
    where `fusable`. It has no gradient: keras_amp's custom gradient around it gives one."""
    size = x.shape[-1]
    scale = tf.fill([size], 1.0) if gamma is None else tf.reshape(gamma, [size])
    offset = tf.fill([size], 0.0) if beta is None else tf.reshape(beta, [size])
    graph = tf.compat.v1.get_default_graph()
    op = graph.create_op(
        OP_TYPE, [tf.reshape(x, [-1, size]), scale, offset], [tf.float32], name="fused_layer_norm",
        attrs={"T": tf.compat.v1.AttrValue(type=tf.float32.as_datatype_enum),
               "epsilon": tf.compat.v1.AttrValue(f=float(epsilon))})
    y = tf.reshape(op.outputs[0], tf.shape(x))
    y.set_shape(x.shape)
    return y

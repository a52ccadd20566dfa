"""The silu rule: silu on a gradient that does not keep traced graphs alive, its 16-bit passes fused.

Keras's TensorFlow backend computes `silu` (and `swish`) as `tf.nn.silu`, a `tf.custom_gradient`
(the backward pass recomputes the sigmoid instead of keeping it). In graph mode TensorFlow 2.21
registers each call's gradient closure process-wide and never removes it (`keras_amp.custom_gradient`),
so every graph traced through a silu stays alive with the variables it captured. Every keras-hub
decoder with a SwiGLU feed-forward block (Llama, Mistral, Qwen) has one. The cost
keras_amp cannot afford: `keras_amp.memory.prepare` traces the forward pass to find which frozen
weights are read in 16 bits and then replaces their float32 storage, but the trace held the float32
buffers, so a LoRA model kept both copies (a 4-layer keras-hub Llama: 48 MiB in use instead of 16).
The rule runs on keras_amp's `custom_gradient`, whose closure is freed with its graph.

On a 16-bit input with keras_amp's XLA kernels on (`enable(xla_scores=True)`, the default) the
backward pass is one XLA computation (`numerics.silu.backward`: float32 arithmetic, one rounding)
instead of TensorFlow's six 16-bit element-wise ops, and so is the forward pass except where
TensorFlow's own 16-bit ops are faster: bfloat16 on a CPU alone whose oneDNN runs bfloat16 natively
(`islands.onednn_bfloat16_kernels`; its `x * sigmoid(x)` there keeps TensorFlow's two roundings). Otherwise,
and for float32 inputs, the rule is `tf.nn.silu`'s arithmetic, op for op (forward `x * sigmoid(x)`;
backward the sigmoid recomputed after the incoming gradient, `dy * (s * (1 + x * (1 - s)))`).
Eager calls are TensorFlow's.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from keras_amp.custom_gradient import custom_gradient
from keras_amp.numerics import islands
from keras_amp.numerics import silu as silu_numerics

_16BIT = (tf.float16, tf.bfloat16)


def graph_freeing_silu(original: Callable, *, xla_scores: bool = True) -> Callable:
    """Replaces the TF backend's `silu` (module doc)."""

    def silu(x):
        x = tf.convert_to_tensor(x)
        if tf.executing_eagerly() or not x.dtype.is_floating:
            return original(x)
        fused = xla_scores and x.dtype in _16BIT
        tf_forward = not fused or islands.onednn_bfloat16_kernels(x.dtype)

        @custom_gradient
        def f(features):
            def grad(dy):
                if fused:
                    return silu_numerics.backward(features, tf.cast(dy, features.dtype))
                with tf.control_dependencies([dy]):  # recomputed in the backward pass, as TF's
                    slope = silu_numerics.derivative(features)
                return dy * slope

            y = features * tf.sigmoid(features) if tf_forward else silu_numerics.forward(features)
            return y, grad

        return f(x)

    silu.__name__ = silu.__qualname__ = original.__name__
    return silu

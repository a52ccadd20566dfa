"""The silu rule: TensorFlow's silu, with a gradient that does not keep traced graphs alive.

Keras's TensorFlow backend computes `silu` (and `swish`) as `tf.nn.silu`, a `tf.custom_gradient`
(the backward pass recomputes the sigmoid instead of keeping it). In graph mode TensorFlow 2.21
registers each call's gradient closure process-wide and never removes it (`keras_amp.custom_gradient`),
so every graph traced through a silu stays alive with the variables it captured. Every keras-hub
decoder with a SwiGLU feed-forward block (Llama, Mistral, Qwen) has one. The cost
keras_amp cannot afford: `keras_amp.memory.prepare` traces the forward pass to find which frozen
weights are read in 16 bits and then replaces their float32 storage, but the trace held the float32
buffers, so a LoRA model kept both copies (a 4-layer keras-hub Llama: 48 MiB in use instead of 16).

The rule is `tf.nn.silu`'s arithmetic, op for op (forward `x * sigmoid(x)`; backward the sigmoid
recomputed after the incoming gradient, `dy * (s * (1 + x * (1 - s)))`), on keras_amp's
`custom_gradient`, whose closure is freed with its graph. In every dtype; eager calls are unchanged.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from keras_amp.custom_gradient import custom_gradient


def graph_freeing_silu(original: Callable) -> Callable:
    """Replaces the TF backend's `silu` (module doc)."""

    def silu(x):
        x = tf.convert_to_tensor(x)
        if tf.executing_eagerly() or not x.dtype.is_floating:
            return original(x)

        @custom_gradient
        def f(features):
            def grad(dy):
                with tf.control_dependencies([dy]):  # recomputed in the backward pass, as TF's
                    sigmoid = tf.sigmoid(features)
                return dy * (sigmoid * (1.0 + features * (1.0 - sigmoid)))

            return features * tf.sigmoid(features), grad

        return f(x)

    silu.__name__ = silu.__qualname__ = original.__name__
    return silu

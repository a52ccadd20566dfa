"""gelu's float32 derivative, and gelu from a 16-bit input as two XLA computations.

keras_amp's gelu rule (`op_rules.upcast_recompute.upcast_recompute_gelu`) evaluates gelu and its
derivative in float32 and keeps only the 16-bit input for the backward pass. Unfused, each
direction is an upcast, a chain of float32 element-wise ops (each one pass over an
activation-sized float32 tensor) and a downcast. Here each direction is one XLA computation: the
forward pass reads the 16-bit input once and writes the rounded result, the backward pass reads
the 16-bit input and the incoming gradient and writes the gradient. The float32 formulas are the
same (Keras's own gelu forward, `derivative` backward); XLA's erfc and tanh round within a few
float32 ulps of TensorFlow's kernels, far below the one 16-bit rounding of the result.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

_SQRT_2_OVER_PI = 0.7978845608028654
_RSQRT_2 = 0.7071067811865476
_RSQRT_2PI = 0.3989422804014327
_TANH_COEFF = 0.044715


def derivative(x: tf.Tensor, approximate: bool) -> tf.Tensor:
    """d gelu(x) / dx in `x`'s dtype: Phi(x) + x phi(x), or the tanh form's closed derivative."""
    if approximate:
        x2 = x * x
        t = tf.tanh(_SQRT_2_OVER_PI * (x + _TANH_COEFF * x * x2))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_COEFF * x2)
    return 0.5 * tf.math.erfc(-x * _RSQRT_2) + x * tf.exp(-0.5 * x * x) * _RSQRT_2PI


def compiled(gelu: Callable) -> tuple[Callable, Callable]:
    """`(forward, backward)` XLA computations around `gelu` (Keras's float32 gelu).

    `forward(x16, approximate, dtype)` is `gelu(float32(x16))` rounded to `dtype`;
    `backward(x16, dy, approximate)` is `dy * derivative(float32(x16))` in float32, rounded to
    `dy`'s dtype. `approximate` is a Python bool and `dtype` a `tf.DType` (each value its own trace).
    """

    @tf.function(jit_compile=True, autograph=False)
    def forward(x16: tf.Tensor, approximate: bool, dtype: tf.DType) -> tf.Tensor:
        return tf.cast(gelu(tf.cast(x16, tf.float32), approximate=approximate), dtype)

    @tf.function(jit_compile=True, autograph=False)
    def backward(x16: tf.Tensor, dy: tf.Tensor, approximate: bool) -> tf.Tensor:
        slope = derivative(tf.cast(x16, tf.float32), approximate)
        return tf.cast(tf.cast(dy, tf.float32) * slope, dy.dtype)

    return forward, backward

"""silu's derivative, and silu from a 16-bit input as XLA computations (`op_rules.silu`).

TensorFlow computes silu in the input's dtype: forward `x * sigmoid(x)` (two ops, two roundings),
backward the sigmoid recomputed and five more element-wise ops, each a pass over an
activation-sized 16-bit tensor. Here each direction is one XLA computation that reads the 16-bit
tensors once, computes in float32 and rounds the result once: within one 16-bit rounding of
float64, where TensorFlow's ops round after every step.
"""

from __future__ import annotations

import tensorflow as tf


def derivative(x: tf.Tensor) -> tf.Tensor:
    """d silu(x) / dx in `x`'s dtype: `s (1 + x (1 - s))` with `s = sigmoid(x)`, as TensorFlow's."""
    s = tf.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@tf.function(jit_compile=True, autograph=False)
def forward(x16: tf.Tensor) -> tf.Tensor:
    """`silu(float32(x16))`, rounded to `x16`'s dtype once."""
    x = tf.cast(x16, tf.float32)
    return tf.cast(x * tf.sigmoid(x), x16.dtype)


@tf.function(jit_compile=True, autograph=False)
def backward(x16: tf.Tensor, dy: tf.Tensor) -> tf.Tensor:
    """`dy * silu'(x16)` in float32, rounded to `dy`'s dtype once."""
    return tf.cast(tf.cast(dy, tf.float32) * derivative(tf.cast(x16, tf.float32)), dy.dtype)

"""Sparse softmax cross-entropy in float32 from 16-bit logits, as two XLA computations.

For a language model's vocabulary-sized logits the float32 loss is one of the largest non-matmul
costs of a step: TensorFlow's kernel needs a float32 copy of the logits (an upcast the size of the
logits), and its gradient `softmax - onehot` is a second logits-sized float32 tensor, which
keras_amp's upcast-recompute rule recomputes in the backward pass by running the kernel again.

Here the forward pass is one XLA computation that reads the 16-bit logits and returns, per row,
the loss `logsumexp(x) - x[label]` and `logsumexp(x)` (float32, max-shifted as TensorFlow's
kernel is); the backward pass is one more that reads the 16-bit logits again and returns
`(exp(x - logsumexp) - onehot) * d_loss` in float32. The upcast happens inside each computation
and is never stored; what the backward pass keeps is the 16-bit logits (kept anyway) and one
float32 per row. Labels outside `[0, classes)` raise `InvalidArgumentError`, as TensorFlow's CPU
kernel does (XLA's gather would clamp them).

`is_cross_entropy_call(op)` tells a graph's call of the forward computation, so that a reader of
a traced loss (`check_model`'s output findings) knows it for a float32 softmax cross-entropy from
logits; the names of the traced calls are recorded as they are created.
"""

from __future__ import annotations

import tensorflow as tf

from keras_amp.custom_gradient import custom_gradient

# Function names of the traced forward computations (`tf.function` gives each trace its own).
_FORWARD_CALLS: set[str] = set()


@tf.function(jit_compile=True, autograph=False)
def _forward(logits16: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    x = tf.cast(logits16, tf.float32)
    top = tf.reduce_max(x, axis=-1, keepdims=True)
    lse = tf.squeeze(top, -1) + tf.math.log(tf.reduce_sum(tf.exp(x - top), axis=-1))
    return lse - tf.gather(x, labels, axis=1, batch_dims=1), lse


@tf.function(jit_compile=True, autograph=False)
def _backward(logits16: tf.Tensor, labels: tf.Tensor, lse: tf.Tensor, d_loss: tf.Tensor) -> tf.Tensor:
    x = tf.cast(logits16, tf.float32)
    onehot = tf.one_hot(labels, tf.shape(x)[-1], dtype=tf.float32)
    return (tf.exp(x - lse[:, None]) - onehot) * d_loss[:, None]


def _checked(labels: tf.Tensor, classes: tf.Tensor) -> tf.Tensor:
    """`labels` once every one is in [0, classes) (TensorFlow's CPU kernel's contract)."""
    message = "Received a label value outside the valid range of [0, classes) in the sparse cross-entropy."
    with tf.control_dependencies([
        tf.debugging.assert_non_negative(labels, message=message),
        tf.debugging.assert_less(labels, tf.cast(classes, labels.dtype), message=message),
    ]):
        return tf.identity(labels)


def sparse_cross_entropy(labels: tf.Tensor, logits: tf.Tensor, logits16: tf.Tensor) -> tf.Tensor:
    """Per-example float32 cross-entropy of integer `labels` (rank r - 1) and `logits` (rank r),
    the float32 upcast of the 16-bit `logits16`. Differentiable in `logits`; the gradient is
    computed from `logits16`, so the float32 `logits` is not kept for the backward pass."""
    classes = tf.shape(logits16)[-1]
    flat16 = tf.reshape(logits16, [-1, classes])
    flat_labels = _checked(tf.reshape(tf.cast(labels, tf.int32), [-1]), classes)

    @custom_gradient
    def cross_entropy(logits):
        # The value does not depend on `logits` (only on its 16-bit source): the gradient below is
        # the only path, and `logits` is read by nothing, so TensorFlow drops the upcast.
        per_row, lse = _forward(flat16, flat_labels)
        if not tf.executing_eagerly():
            _FORWARD_CALLS.add(per_row.op.get_attr("f").name)

        def grad(d_loss):
            d_rows = tf.reshape(tf.cast(d_loss, tf.float32), [-1])
            return tf.reshape(_backward(flat16, flat_labels, lse, d_rows), tf.shape(logits))

        return tf.reshape(per_row, tf.shape(labels)), grad

    return cross_entropy(logits)


def is_cross_entropy_call(op: tf.Operation) -> bool:
    """Whether graph op `op` calls this module's forward computation (a float32 softmax
    cross-entropy of its first input, the 16-bit logits)."""
    if op.type not in ("PartitionedCall", "StatefulPartitionedCall"):
        return False
    try:
        return op.get_attr("f").name in _FORWARD_CALLS
    except (ValueError, AttributeError):
        return False

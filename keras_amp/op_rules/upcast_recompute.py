"""Float32 normalisation and loss that keep 16-bit tensors, not float32 copies, for the backward pass.

Keras computes moments, batch and layer normalisation and the cross-entropies in float32 (or the
op rules make it). Their 16-bit input is cast up first, and TensorFlow's autodiff then keeps the
float32 copy alive until the backward pass: twice the bytes of the activation it came from, for
every BatchNormalization, LayerNormalization and the vocabulary-sized logits. The upcast is exact,
so it can be redone in the backward pass from the 16-bit tensor instead. The rules here do that:

    forward:   the same float32 ops as Keras (bit-identical results)
    saved:     the 16-bit source of the input, plus per-channel/per-row statistics
    backward:  x = cast(x16, float32), then the closed-form float32 gradient

"The 16-bit source" of a float32 input `x` is `x16` when `x` is the output of a graph `Cast` from
float16/bfloat16 (Keras's autocast, `ops.cast(inputs, "float32")`, a `Loss` casting `y_pred`);
a 16-bit input is its own source. Each rule takes `x` itself as its differentiable input and
returns the gradient for `x`, so a tape that watches `x` gets every contribution. The source is
only what the gradient function closes over, so TensorFlow frees the float32 copy once the forward
ops have read it (inside `tf.function`, where `fit` runs). In eager execution, and for float32
inputs that are not upcasts, the Keras original runs unchanged. Under `enable(xla_scores=True)` the
sparse cross-entropy and gelu run as XLA computations from the 16-bit tensor instead
(`numerics.cross_entropy`, `numerics.gelu`): the same float32 formulas, within float32 rounding of
TensorFlow's kernels.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from keras_amp.custom_gradient import custom_gradient
from keras_amp.numerics import cross_entropy
from keras_amp.numerics import gelu as gelu_numerics
from keras_amp.op_rules import fused_gelu
from keras_amp.op_rules import fused_layer_norm

_16BIT = (tf.float16, tf.bfloat16)


def source16(x: Any) -> tf.Tensor | None:
    """The float16/bfloat16 tensor that `x` holds exactly (itself, or the input of the graph Cast
    that made the float32 `x`), or None."""
    if not isinstance(x, tf.Tensor):
        return None
    if x.dtype in _16BIT:
        return x
    if x.dtype != tf.float32:
        return None
    try:
        op = x.op  # eager tensors have no producing op
    except AttributeError:
        return None
    if op.type == "Cast" and op.inputs[0].dtype in _16BIT:
        return op.inputs[0]
    return None


def recompute_upcast(x16: tf.Tensor, *grads: Any) -> tf.Tensor:
    """`cast(x16, float32)` for a gradient function, run only once the incoming gradients exist.

    Without the control edge TensorFlow's executor runs the cast, and everything the gradient
    function derives from it without the incoming gradient, as soon as `x16` exists: during the
    forward pass, keeping the float32 results alive until the backward pass. Grappler would also
    merge an unordered cast with the forward pass's identical one.
    """
    with tf.control_dependencies([g for g in grads if g is not None]):
        return tf.cast(tf.identity(x16), tf.float32)


def _sum_to(t: tf.Tensor, shape: tf.TensorShape) -> tf.Tensor:
    """`t` summed over the axes that broadcasting a tensor of `shape` to `t`'s shape expanded."""
    rank, target = t.shape.rank, shape.rank
    lead = rank - target
    axes = list(range(lead)) + [
        lead + i for i, d in enumerate(shape) if d == 1 and t.shape[lead + i] != 1
    ]
    summed = tf.reduce_sum(t, axis=axes, keepdims=True) if axes else t
    return tf.reshape(summed, shape)


def _count(x: tf.Tensor, axes: list[int]) -> tf.Tensor:
    shape = tf.shape(x)
    return tf.cast(tf.reduce_prod(tf.gather(shape, axes)), tf.float32)


def _axes(axes: Any, rank: int) -> list[int]:
    axes = [axes] if isinstance(axes, int) else list(axes)
    return sorted(a % rank for a in axes)


def _float32_moments(x: tf.Tensor, x16: tf.Tensor, axes: list[int], keepdims: bool):
    """Mean and (biased) variance of float32 `x` over `axes`; the backward pass reads `x16`."""


    @custom_gradient
    def moments(x):
        mean, variance = tf.nn.moments(x, axes, keepdims=True)

        def grad(d_mean, d_variance):
            # d mean / dx = 1/n; d var / dx = 2 (x - mean) / n (the mean's own dependence on x
            # contributes sum(x - mean) = 0).
            # Every full-size tensor here is made from an incoming gradient, so none runs (and
            # waits) in the forward pass.
            n = _count(x16, axes)
            if d_variance is None and d_mean is None:
                return tf.zeros(tf.shape(x16), tf.float32)
            if d_variance is None:
                return tf.broadcast_to(tf.reshape(d_mean, tf.shape(mean)) / n, tf.shape(x16))
            centered = recompute_upcast(x16, d_mean, d_variance) - mean
            dx = tf.reshape(d_variance, tf.shape(variance)) * (2.0 / n) * centered
            if d_mean is not None:
                dx += tf.reshape(d_mean, tf.shape(mean)) / n
            return dx

        if not keepdims:
            return (tf.squeeze(mean, axes), tf.squeeze(variance, axes)), grad
        return (mean, variance), grad

    return moments(x)


def upcast_recompute_moments(original: Callable) -> Callable:
    def moments(x, axes, keepdims=False, synchronized=False):
        x16 = None if synchronized else source16(x)
        if x16 is None:
            return original(x, axes, keepdims=keepdims, synchronized=synchronized)
        ori_dtype = x.dtype
        x = tf.cast(x, tf.float32)
        mean, variance = _float32_moments(x, x16, _axes(axes, x.shape.rank), keepdims)
        if ori_dtype == tf.float16:
            # Keras's contract for 16-bit inputs: statistics clipped to float16's range and cast back.
            mean = tf.cast(tf.clip_by_value(mean, tf.float16.min, tf.float16.max), ori_dtype)
            variance = tf.cast(tf.clip_by_value(variance, tf.float16.min, tf.float16.max), ori_dtype)
        elif ori_dtype in _16BIT:
            # bfloat16 has float32's range: Keras's clip to float16's (a variance of 7.5e4 read as 65504,
            # a custom LayerNorm's output off by 0.37 in 2.6) would only cut statistics it can hold.
            mean, variance = tf.cast(mean, ori_dtype), tf.cast(variance, ori_dtype)
        return mean, variance

    moments.__name__ = moments.__qualname__ = original.__name__
    return moments


def _float32_batch_normalization(x, x16, mean, variance, offset, scale, epsilon):
    """`tf.nn.batch_normalization` in float32 (the same ops); the backward pass reads `x16`."""
    has_offset, has_scale = offset is not None, scale is not None

    @custom_gradient
    def batch_normalization(x, mean, variance, *params):
        offset = params[0] if has_offset else None
        scale = params[-1] if has_scale else None
        inv = tf.math.rsqrt(variance + epsilon)
        if scale is not None:
            inv = inv * scale
        shift = -mean * inv if offset is None else offset - mean * inv
        y = x * inv + shift
        per_channel = tf.TensorShape([])
        for t in (mean, variance, *params):
            per_channel = tf.broadcast_static_shape(per_channel, t.shape)

        def grad(dy):
            # y = (x - mean) * r * scale + offset, r = (variance + epsilon) ** -1/2.
            # Four full-size ops (the upcast, x - mean, its product with dy, dy * inv) and two
            # reductions to the parameters' broadcast shape; the per-channel factors, constant
            # over the reduced axes, multiply those sums, not full-size tensors.
            r = tf.math.rsqrt(variance + epsilon)
            d_inv = dy * (recompute_upcast(x16, dy) - mean)
            sum_d_inv, sum_dy = _sum_to(d_inv, per_channel), _sum_to(dy, per_channel)
            grads = {
                "x": dy * inv,
                "mean": _sum_to(-sum_dy * inv, mean.shape),
                # d r / d variance = -r**3 / 2
                "variance": _sum_to(sum_d_inv * (-0.5 * r**3 * (1.0 if scale is None else scale)), variance.shape),
            }
            if offset is not None:
                grads["offset"] = _sum_to(sum_dy, offset.shape)
            if scale is not None:
                grads["scale"] = _sum_to(sum_d_inv * r, scale.shape)
            order = ["x", "mean", "variance"] + ["offset"] * has_offset + ["scale"] * has_scale
            return [grads[k] for k in order]

        return y, grad

    return batch_normalization(x, mean, variance, *[t for t in (offset, scale) if t is not None])


def upcast_recompute_batch_normalization(original: Callable) -> Callable:
    """Wraps the float32 batch-normalisation rule (`float32_ops.float32_batch_normalization`)."""

    def batch_normalization(x, mean, variance, axis, offset=None, scale=None, epsilon=1e-3):
        x16 = source16(x)
        if x16 is None:
            return original(x, mean, variance, axis, offset, scale, epsilon)
        ori_dtype = x.dtype
        x = tf.cast(x, tf.float32)
        up = [None if t is None else tf.cast(tf.convert_to_tensor(t), tf.float32) for t in (mean, variance, offset, scale)]
        if axis != -1 and axis != x.shape.rank - 1:
            # Keras's backend reshapes per-channel parameters to broadcast along `axis`.
            shape = [1] * x.shape.rank
            shape[axis] = up[0].shape[0]
            up = [None if t is None else tf.reshape(t, shape) for t in up]
        y = _float32_batch_normalization(x, x16, up[0], up[1], up[2], up[3], epsilon)
        return tf.cast(y, ori_dtype)

    batch_normalization.__name__ = batch_normalization.__qualname__ = original.__name__
    return batch_normalization


def _float32_layer_normalization(x, x16, gamma, beta, axes, epsilon):
    """Keras's `_layer_normalization` arithmetic in float32 (its forward pass one fused kernel where
    `fused_layer_norm.fusable`); the backward pass reads `x16`."""
    has_gamma, has_beta = gamma is not None, beta is not None
    fused = fused_layer_norm.fusable(x, gamma, beta, axes)

    @custom_gradient
    def layer_normalization(x, *params):
        gamma = params[0] if has_gamma else None
        beta = params[-1] if has_beta else None
        if fused:  # the statistics are recomputed by the backward pass
            y, stats = fused_layer_norm.layer_norm(x, gamma, beta, epsilon), None
        else:
            stats = tf.nn.moments(x, axes, keepdims=True)
            inv = tf.math.rsqrt(stats[1] + epsilon)
            scaled = inv if gamma is None else inv * gamma
            shift = -stats[0] * scaled if beta is None else -stats[0] * scaled + beta
            y = x * scaled + shift

        def grad(dy):
            x_up = recompute_upcast(x16, dy)
            mean, variance = tf.nn.moments(x_up, axes, keepdims=True) if stats is None else stats
            r = tf.math.rsqrt(variance + epsilon)
            x_hat = (x_up - mean) * r
            g = dy if gamma is None else dy * gamma
            # d x = r * (g - mean(g) - x_hat * mean(g * x_hat)), means over the normalised axes.
            dx = r * (g - tf.reduce_mean(g, axes, keepdims=True) - x_hat * tf.reduce_mean(g * x_hat, axes, keepdims=True))
            grads = [dx]
            if gamma is not None:
                grads.append(_sum_to(dy * x_hat, gamma.shape))
            if beta is not None:
                grads.append(_sum_to(dy, beta.shape))
            return grads

        return y, grad

    return layer_normalization(x, *[t for t in (gamma, beta) if t is not None])


def upcast_recompute_layer_normalization(original: Callable) -> Callable:
    """Replaces `keras.src.ops.nn._layer_normalization` (what `ops.layer_normalization` and
    `LayerNormalization` run)."""

    def _layer_normalization(x, gamma=None, beta=None, axis=-1, epsilon=None, rms_scaling=False):
        x16 = None if rms_scaling else source16(x)
        if x16 is None:
            return original(x, gamma=gamma, beta=beta, axis=axis, epsilon=epsilon, rms_scaling=rms_scaling)
        if epsilon is None:
            epsilon = keras.backend.epsilon()
        ori_dtype = x.dtype
        x = tf.cast(x, tf.float32)
        rank = x.shape.rank
        axes = _axes(axis, rank)
        params = []
        for p in (gamma, beta):
            if p is not None:
                # A tensor, not a variable (a custom gradient's inputs are tensors).
                p = tf.convert_to_tensor(keras.ops.convert_to_tensor(p, dtype="float32"))
                if p.shape.rank != rank and axes != [rank - 1]:
                    # As Keras: parameters of the normalised axes broadcast over the others.
                    p = tf.reshape(p, [x.shape[d] if d in axes else 1 for d in range(rank)])
            params.append(p)
        y = _float32_layer_normalization(x, x16, params[0], params[1], axes, epsilon)
        return tf.cast(y, ori_dtype)

    _layer_normalization.__name__ = _layer_normalization.__qualname__ = original.__name__
    return _layer_normalization


def _float32_sparse_cross_entropy(labels: tf.Tensor, logits: tf.Tensor, logits16: tf.Tensor) -> tf.Tensor:
    """`tf.nn.sparse_softmax_cross_entropy_with_logits` on float32 `logits`; the backward pass
    recomputes its `softmax - onehot` from `logits16` (TensorFlow keeps it, in float32)."""
    classes = tf.shape(logits)[-1]

    def _kernel(features):
        flat = tf.reshape(features, [-1, classes])
        return tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=flat, labels=tf.reshape(labels, [-1]))

    @custom_gradient
    def cross_entropy(logits):
        loss, _ = _kernel(logits)

        def grad(d_loss):
            _, backprop = _kernel(recompute_upcast(logits16, d_loss))
            # TensorFlow's own gradient: d_loss[..., None] * backprop.
            return tf.reshape(tf.reshape(d_loss, [-1, 1]) * backprop, tf.shape(logits))

        return tf.reshape(loss, tf.shape(labels)), grad

    return cross_entropy(logits)


def upcast_recompute_sparse_categorical_crossentropy(original: Callable, *, xla_scores: bool = True) -> Callable:
    """Wraps the float32 loss rule (`float32_ops.float32_loss_rule`) for integer targets and logits.

    With `xla_scores` (keras_amp's XLA kernels on, `keras_amp.enable`) the loss and its gradient
    are two XLA computations that read the 16-bit logits (`numerics.cross_entropy`); without it,
    TensorFlow's kernel on the float32 upcast, run again in the backward pass.
    """
    kernel = cross_entropy.sparse_cross_entropy if xla_scores else _float32_sparse_cross_entropy

    def sparse_categorical_crossentropy(target, output, from_logits=False, axis=-1):
        logits16 = source16(output) if from_logits else None
        rank = getattr(getattr(output, "shape", None), "rank", None)
        if logits16 is None or not rank or (axis != -1 and axis != rank - 1):
            return original(target, output, from_logits=from_logits, axis=axis)
        labels = tf.cast(tf.convert_to_tensor(target), tf.int64)
        if labels.shape.rank == rank and labels.shape[-1] == 1:
            labels = tf.squeeze(labels, axis=-1)
        if labels.shape.rank != rank - 1 or not labels.shape.is_compatible_with(output.shape[:-1]):
            # Keras's own checks and error messages.
            return original(target, output, from_logits=from_logits, axis=axis)
        return kernel(labels, tf.cast(output, tf.float32), logits16)

    sparse_categorical_crossentropy.__name__ = sparse_categorical_crossentropy.__qualname__ = original.__name__
    return sparse_categorical_crossentropy


def upcast_recompute_gelu(original: Callable, *, xla_scores: bool = True) -> Callable:
    """Replaces the TF backend's `gelu`: float32 forward and backward, keeping only the 16-bit x.

    TensorFlow's gelu is composite (`0.5 * x * erfc(-x / sqrt(2))`, or the tanh form with
    `pow(x, 3)`), so its autodiff keeps three activation-sized tensors and, in float16, its
    gradient `3 x**2` overflows past |x| = 256. With `xla_scores` (keras_amp's XLA kernels on,
    `keras_amp.enable`) each direction is one XLA computation from the 16-bit x
    (`numerics.gelu.compiled`); otherwise float32 TensorFlow ops between an upcast and a downcast.
    """
    forward, backward = gelu_numerics.compiled(original) if xla_scores else (None, None)

    def gelu(x, approximate=True):
        x = tf.convert_to_tensor(x)  # as Keras does (a variable or array becomes a tensor)
        x16 = source16(x)
        if x16 is None:
            return original(x, approximate=approximate)
        out_dtype = x.dtype
        fused = fused_gelu.inference_gelu(x16, approximate, out_dtype)
        if fused is not None:  # inference, oneDNN: fused into the matmul, in float32 (fused_gelu.py)
            return fused

        @custom_gradient
        def f(x):
            if forward is not None:
                # Read from the 16-bit source only: a float32 `x` (an upcast) is then read by nothing
                # and TensorFlow drops it; the gradient below is the only path to `x`.
                y = forward(x16, approximate, out_dtype)
            else:
                y = tf.cast(original(tf.cast(x, tf.float32), approximate=approximate), out_dtype)

            def grad(dy):
                if backward is not None:
                    return backward(x16, tf.cast(dy, out_dtype), approximate)
                slope = gelu_numerics.derivative(recompute_upcast(x16, dy), approximate)
                return tf.cast(tf.cast(dy, tf.float32) * slope, out_dtype)

            return y, grad

        return f(x)

    gelu.__name__ = gelu.__qualname__ = original.__name__
    return gelu

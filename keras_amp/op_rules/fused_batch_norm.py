"""Batch normalisation of an activation as TensorFlow's fused kernels: of a 16-bit activation's float32
upcast, and of a float32 activation.

Keras's BatchNormalization, like any code that normalises an activation in float32:

    x = cast(x16, float32); mean, variance = ops.moments(x, every axis but the channel's)  # training
    y = ops.batch_normalization(x, mean, variance, axis=-1, offset, scale, epsilon); cast(y, 16-bit)

As TensorFlow ops that is a float32 upcast, the moments, the normalisation and a downcast: passes
over float32 copies of the activation forward, as many again backward. TensorFlow's
`FusedBatchNormV3` reads the 16-bit x itself, with float32 statistics and parameters, float32
arithmetic, one rounding of y; `FusedBatchNormGradV3` likewise. A float32 layer in a mixed model (the
"cnn" recipe's stem, a per-layer float32 rule) has no upcast and no rounding, but the same chain of
float32 ops, eight-odd passes each way: the kernels read its float32 x (the same arithmetic, float32
within its rounding; tested against float64). The tensor the kernels read, the 16-bit source
of an exact upcast or the float32 x itself, is the `source` below. The rules find that dataflow
(graph mode, channels last, on a CPU) and run the kernels:

    moments        of a float32 x over every axis but the last: a training-form `FusedBatchNormV3`
                   of its source, whose reserve outputs are the batch mean and biased variance
                   (Keras's); they carry a tag naming the source.
    normalisation  of a float32 x with per-channel statistics: an inference-form `FusedBatchNormV3`
                   with them gives y in the source's dtype, returned as float32 (an exact upcast of a
                   16-bit y: Keras's dtype contract). Its gradient is `FusedBatchNormGradV3`: in
                   training form when the statistics are the tagged moments of the same source (it
                   differentiates through them, so they get no gradient from it; other consumers give
                   them theirs); otherwise (moving statistics: inference, a frozen layer) with the
                   statistics fixed, and their gradients from its per-channel sums.
    cast           of an exact upcast back to its own 16-bit dtype (Keras's final `cast(y, bfloat16)`):
                   the 16-bit source itself, no op.

The moments' own gradient (for consumers other than the normalisation) is the closed form from the
source. Both rules are differentiable in the source, not in an upcast of it: the upcast is then read by
nothing and pruned, and neither gradient is cast up to float32 only for the upcast's gradient to cast it
back down (per layer, a full-size cast forward and two backward, and a float32 copy of dx). The moments'
gradient, where wanted, is rounded to a 16-bit source's dtype before it is added to the normalisation's
(one rounding more than a float32 sum: as at any 16-bit tensor read twice).
Anything else runs the upcast-recompute rules (and, for a float32 x, its float32 ops): eager execution,
channels first, ranks other than 2-5, parameters that are not per-channel vectors, synchronized moments,
16-bit x passed directly, and GPUs and TPUs (cuDNN's reserve outputs hold the inverse standard
deviation, not the variance, and no GPU was available to measure the kernels on).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf

from keras_amp import hardware
from keras_amp.custom_gradient import custom_gradient
from keras_amp.op_rules.upcast_recompute import recompute_upcast, source16

_TAG = "_keras_amp_batch_moments"


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the fused kernels are used on this machine: a CPU only (module doc)."""
    device = hardware.detect()
    return not (device.gpus or device.tpu_count)


class _Moments:
    """What the moments rule leaves for the normalisation rule: the source, its 4-D view and
    the variance tensor (the tag is on the mean)."""

    def __init__(self, source, x4, variance):
        self.source, self.x4, self.variance = source, x4, variance


def _as_4d(source: tf.Tensor) -> tf.Tensor | None:
    """source (or a tensor of its shape: a gradient) viewed as (N, H, W, C), the channel last and
    unchanged, or None for another rank; itself at rank 4."""
    rank, channels = source.shape.rank, source.shape[-1]
    if rank == 4:
        return source
    shape = tf.shape(source)
    if rank == 2:
        return tf.reshape(source, [-1, 1, 1, channels])
    if rank == 3:
        return tf.reshape(source, tf.stack([shape[0], shape[1], 1, channels]))
    if rank == 5:
        return tf.reshape(source, tf.stack([shape[0], shape[1] * shape[2], shape[3], channels]))
    return None


def _from_4d(t4: tf.Tensor, source: tf.Tensor) -> tf.Tensor:
    """`_as_4d`'s inverse: `t4` in `source`'s shape; `t4` itself at rank 4, where a Reshape, even of
    the same shape, would keep TensorFlow's remapper from fusing a Relu that reads the kernel's y
    into it (`_FusedBatchNormEx`)."""
    return t4 if source.shape.rank == 4 else tf.reshape(t4, tf.shape(source))


def _source(x: Any) -> tf.Tensor | None:
    """The tensor the kernels read for `x` (the module doc): the 16-bit source of an exact float32 upcast,
    or a float32 `x` itself; None for any other dtype (a 16-bit `x` passed directly among them)."""
    if not isinstance(x, tf.Tensor) or x.dtype != tf.float32:
        return None
    source = source16(x)
    return x if source is None else source


def _fusable(x: Any, axes: Any = None) -> tf.Tensor | None:
    """The source of `x` when `x` is a graph-mode float32 tensor of rank 2-5 with a static channel count
    and `axes` (unless None) are all of its axes but the last; else None."""
    if tf.executing_eagerly() or not available():
        return None
    source = _source(x)
    if source is None or x.shape.rank is None or x.shape[-1] is None:
        return None
    rank = x.shape.rank
    if axes is None:
        return source if 2 <= rank <= 5 else None
    try:
        reduced = sorted(a % rank for a in ([axes] if isinstance(axes, int) else axes))
    except TypeError:
        return None
    return source if 2 <= rank <= 5 and reduced == list(range(rank - 1)) else None


def fused_moments(rule: Callable) -> Callable:
    """Wraps the moments rule (`upcast_recompute.upcast_recompute_moments`): see the module doc."""

    def moments(x, axes, keepdims=False, synchronized=False):
        source = None if synchronized else _fusable(x, axes)
        x4 = None if source is None else _as_4d(source)
        if x4 is None:
            return rule(x, axes, keepdims=keepdims, synchronized=synchronized)
        channels, rank = x.shape[-1], x.shape.rank

        @custom_gradient
        def batch_moments(source):  # differentiable in the source, not its upcast (the module doc: why)
            # The reserve outputs are the batch mean and biased variance on a CPU (the module doc).
            mean, variance = tf.raw_ops.FusedBatchNormV3(
                x=x4, scale=tf.ones([channels]), offset=tf.zeros([channels]), mean=tf.zeros([0]),
                variance=tf.zeros([0]), epsilon=1e-3, is_training=True)[3:5]

            def grad(d_mean, d_variance):
                # d mean / dx = 1/n; d variance / dx = 2 (x - mean) / n.
                if d_mean is None and d_variance is None:
                    return None  # the normalisation's gradient covers them: no full-size zeros
                n = tf.cast(tf.size(source) // channels, tf.float32)
                dx = tf.zeros(tf.shape(source), tf.float32)
                if d_variance is not None:
                    dx = d_variance * (2.0 / n) * (recompute_upcast(source, d_mean, d_variance) - mean)
                return tf.cast(dx if d_mean is None else dx + d_mean / n, source.dtype)

            return (mean, variance), grad

        mean, variance = batch_moments(source)
        if keepdims:
            mean = tf.reshape(mean, [1] * (rank - 1) + [channels])
            variance = tf.reshape(variance, [1] * (rank - 1) + [channels])
        setattr(mean, _TAG, _Moments(source, x4, variance))
        return mean, variance

    moments.__name__ = moments.__qualname__ = "moments"
    moments.unfused = rule
    return moments


def _per_channel(t: Any, channels: int, fill: float | None) -> tf.Tensor | None:
    """A float32 (channels,) view of a per-channel tensor (`fill` where None; None without one), or
    None when `t` is not one vector along the channel axis."""
    if t is None:
        return None if fill is None else tf.fill([channels], fill)
    t = tf.convert_to_tensor(t)
    if t.shape.rank is None or t.shape.num_elements() != channels or any(d != 1 for d in t.shape[:-1]):
        return None
    return tf.cast(tf.reshape(t, [channels]), tf.float32)


def _normalize(source, x4, mean, variance, gamma, beta, epsilon, batch: bool) -> tf.Tensor:
    """y of `FusedBatchNormV3` (inference form; the source's dtype) with these (channels,) float32
    statistics and parameters; its gradient `FusedBatchNormGradV3`, in training form when they are x's batch moments
    (`batch`), else with the statistics held fixed (and their own gradients from its per-channel sums).
    Differentiable in the source, not its upcast (the module doc: why)."""

    @custom_gradient
    def normalize(source, mean, variance, gamma, beta):
        y4 = tf.raw_ops.FusedBatchNormV3(
            x=x4, scale=gamma, offset=beta, mean=mean, variance=variance, epsilon=epsilon, is_training=False)[0]

        def grad(dy):
            dx, d_gamma, d_beta, _, _ = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=_as_4d(tf.cast(dy, source.dtype)), x=x4, scale=gamma,
                # The CPU kernels read no third reserve (empty in their forward pass; tested).
                reserve_space_1=mean, reserve_space_2=variance, reserve_space_3=tf.zeros([0]),
                epsilon=epsilon, is_training=batch)
            dx = _from_4d(dx, source)
            if batch:  # the statistics' dependence on x is in dx already: no gradient for them here
                return dx, None, None, d_gamma, d_beta
            # y = (x - mean) r gamma + beta, r = (variance + epsilon)^-1/2: d_beta = sum(dy),
            # d_gamma = sum(dy (x - mean)) r, so d mean = -r gamma d_beta, d variance = -r^2 gamma d_gamma / 2.
            r = tf.math.rsqrt(variance + epsilon)
            return dx, -r * gamma * d_beta, -0.5 * r * r * gamma * d_gamma, d_gamma, d_beta

        return _from_4d(y4, source), grad

    return normalize(source, mean, variance, gamma, beta)


def fused_batch_normalization(rule: Callable) -> Callable:
    """Wraps the batch-normalisation rule (`upcast_recompute_batch_normalization`): see the module doc."""

    def batch_normalization(x, mean, variance, axis, offset=None, scale=None, epsilon=1e-3):
        stats = getattr(mean, _TAG, None)
        batch = stats is not None and stats.variance is variance and _source(x) is stats.source
        source = stats.source if batch else _fusable(x)
        x4 = stats.x4 if batch else (None if source is None else _as_4d(source))
        if x4 is None or axis not in (-1, x.shape.rank - 1):
            return rule(x, mean, variance, axis, offset, scale, epsilon)
        channels = x.shape[-1]
        params = [_per_channel(t, channels, fill) for t, fill in ((mean, None), (variance, None), (scale, 1.0),
                                                                 (offset, 0.0))]
        if any(t is None for t in params):
            return rule(x, mean, variance, axis, offset, scale, epsilon)
        return tf.cast(_normalize(source, x4, *params[:2], params[2], params[3], epsilon, batch), tf.float32)

    batch_normalization.__name__ = batch_normalization.__qualname__ = "batch_normalization"
    batch_normalization.unfused = rule
    return batch_normalization


def round_trip_cast(original: Callable) -> Callable:
    """Replaces the TF backend's `cast`: in graph mode, a cast of an exact float32 upcast back to its
    16-bit source's dtype is that source (bit for bit the same values; its gradient the same too)."""

    def cast(x, dtype):
        if isinstance(x, tf.Tensor) and not tf.executing_eagerly() and x.dtype == tf.float32:
            x16 = source16(x)
            if x16 is not None and x16 is not x and x16.dtype.name == str(getattr(dtype, "name", dtype)):
                return x16
        return original(x, dtype)

    cast.__name__ = cast.__qualname__ = original.__name__
    return cast

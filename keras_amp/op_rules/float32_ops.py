"""Float32 replacements of single Keras backend ops (softmax, normalisation, losses, float16 arange).

Each factory takes the original Keras function and returns its replacement, which computes in
float32 when given 16-bit inputs and calls the original unchanged otherwise. The table
(`keras_amp.op_rules.table.RULES`) says which op gets which and why; the installer swaps them in.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import keras
import tensorflow as tf

from keras_amp.op_rules import dataflow
from keras_amp.op_rules.table import LOW_PRECISION


def is_16bit(x: Any, dtypes: tuple[str, ...] = LOW_PRECISION) -> bool:
    """Whether `x` has a dtype, and it is one of `dtypes` (float16 or bfloat16)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and keras.backend.standardize_dtype(dtype) in dtypes


def _up(x: Any) -> Any:
    return tf.cast(x, tf.float32) if is_16bit(x) else x


def float32_input_dtype(original: Callable) -> Callable:
    """`original(x, ...)` computed on float32 `x`, the result cast back to `x`'s dtype."""

    def rule(x, *args, **kwargs):
        if not is_16bit(x):
            return original(x, *args, **kwargs)
        return tf.cast(original(tf.cast(x, tf.float32), *args, **kwargs), x.dtype)

    rule.__name__ = rule.__qualname__ = original.__name__
    return rule


def _logits(x: Any, xla_scores: bool) -> tf.Tensor | None:
    """`x` in float32, rebuilt from its score matmuls where the dataflow walk finds them (`x` may then
    be float32 itself, Keras having promoted it), else a 16-bit `x` cast up; None for any other `x`."""
    logits = dataflow.float32_logits(x, xla_scores=xla_scores)
    if logits is None and is_16bit(x):
        logits = tf.cast(x, tf.float32)
    return logits


def float32_probabilities(original: Callable, *, xla_scores: bool) -> Callable:
    """softmax / log_softmax in float32, on float32 logits rebuilt from their score matmuls.

    In graph mode `dataflow.float32_logits` finds the 16-bit score matmuls (QK^T, however
    written) whose results reach `x` and recomputes the chain in float32; otherwise a 16-bit
    `x` is cast up. The result has `x`'s dtype, as the caller's code expects.
    """

    def rule(x, axis=-1):
        logits = _logits(x, xla_scores)
        if logits is None:
            return original(x, axis=axis)
        output = tf.cast(original(logits, axis=axis), x.dtype)
        if original.__name__ == "softmax":
            # Keras's contract: a softmax output carries its logits, which the cross-entropies use.
            output._keras_logits = x
        return output

    rule.__name__ = rule.__qualname__ = original.__name__
    return rule


# Per graph: the name of each tensor the logsumexp rule returned with `keepdims=True` -> (the name of its
# input, its axis). `exp(x - logsumexp(x, axis, keepdims=True))` is a softmax over `axis` written out.
_LOGSUMEXPS: "weakref.WeakKeyDictionary[Any, dict[str, tuple[str, Any]]]" = weakref.WeakKeyDictionary()




def float32_logsumexp(original: Callable, *, xla_scores: bool) -> Callable:
    """logsumexp in float32, on float32 logits rebuilt from their score matmuls (as the softmax
    rule's); the result has `x`'s dtype. A graph result with `keepdims=True` is recorded, so that
    the exp rule knows `exp(x - it)` for the softmax it is."""

    def logsumexp(x, axis=None, keepdims=False):
        logits = _logits(x, xla_scores)
        if logits is None:
            return original(x, axis=axis, keepdims=keepdims)
        output = tf.cast(original(logits, axis=axis, keepdims=keepdims), x.dtype)
        if keepdims and is_16bit(x) and dataflow.graph_tensor(x):
            _LOGSUMEXPS.setdefault(output.graph, {})[output.name] = (x.name, axis)
        return output

    logsumexp.__name__ = logsumexp.__qualname__ = original.__name__
    return logsumexp


def _softmax_written_out(x: Any) -> tuple[tf.Tensor, Any] | None:
    """(s, axis) when graph tensor `x` is `s - logsumexp(s, axis, keepdims=True)`, else None."""
    if not (dataflow.graph_tensor(x) and is_16bit(x)) or x.op.type != "Sub":
        return None
    s, lse = x.op.inputs
    name, axis = _LOGSUMEXPS.get(x.graph, {}).get(lse.name, (None, None))
    return (s, axis) if name == s.name else None


def float32_softmax_exp(original: Callable, *, xla_scores: bool) -> Callable:
    """exp whose argument is `s - logsumexp(s, axis, keepdims=True)` (probabilities written without a
    softmax: `keras.layers.Softmax` over two or more axes) computed as a float32 softmax over `axis`
    of `s`, rebuilt from its score matmuls as the softmax rule's logits; one rounding to `x`'s dtype.
    Any other exp is the original: its result's range is the hazard, which no cast back can fix."""

    def exp(x):
        found = _softmax_written_out(x)
        if found is None:
            return original(x)
        s, axis = found
        logits = _logits(s, xla_scores)
        shifted = logits - tf.stop_gradient(tf.reduce_max(logits, axis=axis, keepdims=True))
        e = tf.exp(shifted)
        return tf.cast(e / tf.reduce_sum(e, axis=axis, keepdims=True), x.dtype)

    exp.__name__ = exp.__qualname__ = original.__name__
    return exp


def float32_root(original: Callable) -> Callable:
    """sqrt / rsqrt of a normalisation statistic computed in float32 (`dataflow.float32_statistic`).

    Any other argument (no mean or sum reduction behind it, no 16-bit op on the way, eager
    execution) goes to the original unchanged. The result has the original's dtype.
    """

    def rule(x):
        statistic = dataflow.float32_statistic(x)
        if statistic is None:
            return original(x)
        out = original(statistic)
        return tf.cast(out, x.dtype) if x.dtype.is_floating else out

    rule.__name__ = rule.__qualname__ = original.__name__
    return rule


def float32_batch_normalization(original: Callable) -> Callable:
    def batch_normalization(x, mean, variance, axis, offset=None, scale=None, epsilon=1e-3):
        x = tf.convert_to_tensor(x)
        if not any(is_16bit(t) for t in (x, mean, variance, offset, scale)):
            return original(x, mean, variance, axis, offset, scale, epsilon)
        # x * inv + (offset - mean * inv): two near-equal 16-bit terms when |mean| >> std.
        up = [None if t is None else tf.cast(t, tf.float32) for t in (x, mean, variance, offset, scale)]
        return tf.cast(original(up[0], up[1], up[2], axis, up[3], up[4], epsilon), x.dtype)

    return batch_normalization


def _up_keeping_logits(output: Any, op_type: str) -> Any:
    """`output` in float32, still carrying the logits Keras's cross-entropies look for."""
    if not is_16bit(output):
        return output
    logits = getattr(output, "_keras_logits", None)
    if logits is None and not tf.executing_eagerly() and getattr(output, "op", None) is not None:
        if output.op.type == op_type and len(output.op.inputs) == 1:
            logits = output.op.inputs[0]
    up = tf.cast(output, tf.float32)
    if logits is not None:
        up._keras_logits = tf.cast(logits, tf.float32)
    return up


def float32_loss_rule(op_type: str) -> Callable:
    def factory(original: Callable) -> Callable:
        def loss(target, output, *args, **kwargs):
            if not (is_16bit(output) or is_16bit(target)):
                return original(target, output, *args, **kwargs)
            return original(_up(target), _up_keeping_logits(output, op_type), *args, **kwargs)

        loss.__name__ = loss.__qualname__ = original.__name__
        return loss

    return factory


def float32_loss_spec(original: Callable) -> Callable:
    def compute_output_spec(self, target, output):
        spec = original(self, target, output)
        if is_16bit(output) or is_16bit(target):
            return keras.KerasTensor(spec.shape, dtype="float32")
        return spec

    return compute_output_spec



def float16_arange(original: Callable) -> Callable:
    """`ops.arange(..., dtype="float16")` computed in float32 and cast to float16.

    TensorFlow has no float16 `Range` kernel: inside a graph Keras's arange fails at graph
    construction ("Unsupported dtype19 for Range[Tidx=DT_HALF]"; Keras catches only the eager
    error), so any model that builds float16 position or timestep tables with it cannot be
    traced under mixed_float16 (keras-hub ESM, RoFormerV2, Flux, D-FINE, SAM3). The float32
    range holds the same integers exactly and rounds other values once, to float16.
    """

    def arange(start, stop=None, step=None, dtype=None):
        if dtype is not None and keras.backend.standardize_dtype(dtype) == "float16":
            return tf.cast(original(start, stop, step, dtype="float32"), tf.float16)
        return original(start, stop, step, dtype)

    arange.__name__ = arange.__qualname__ = original.__name__
    return arange

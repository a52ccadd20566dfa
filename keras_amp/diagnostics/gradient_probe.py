"""Per-layer gradient statistics in each layer's compute dtype: zeros, subnormals, non-finite, exponents.

A gradient element that is 0 or subnormal in float16 has lost its value (or all but a few bits of
it) before the optimizer sees it: the loss scale is too small for that layer. One that is
non-finite makes the step overflow: the scale is too large, or the layer overflows.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_amp import validation
from keras_amp.diagnostics import traced_step as diag_step


@dataclasses.dataclass(frozen=True)
class LayerGradientStats:
    """One layer's (scaled) weight-gradient elements, classified in its compute dtype.

    Args:
        path: String. Layer path in the model.
        compute_dtype: String. The layer's compute dtype, in which elements are classified.
        size: Int. Number of gradient elements.
        zero_fraction: Float. Fraction exactly zero (underflowed, or truly zero).
        underflow_zero_fraction: Float. Fraction zero at this scale but not at a 4096x larger
            one: values lost to underflow (a truly zero gradient is zero at both).
        subnormal_fraction: Float. Fraction non-zero but below the smallest normal number.
        nonfinite_fraction: Float. Fraction inf or NaN.
        min_exponent: Int or None. Smallest floor(log2|g|) over finite non-zero elements.
        max_exponent: Int or None. Largest floor(log2|g|) over finite non-zero elements.
        exponent_histogram: Tuple of (exponent, count) pairs, non-zero counts only.
    """

    path: str
    compute_dtype: str
    size: int
    zero_fraction: float
    underflow_zero_fraction: float
    subnormal_fraction: float
    nonfinite_fraction: float
    min_exponent: int | None
    max_exponent: int | None
    exponent_histogram: tuple = ()

    @property
    def underflow_fraction(self) -> float:
        """Underflowed-to-zero plus subnormal fraction: elements whose value is lost or nearly lost."""
        return self.underflow_zero_fraction + self.subnormal_fraction

    def as_dict(self) -> dict:
        """JSON-ready record."""
        record = dataclasses.asdict(self)
        record["exponent_histogram"] = {str(e): c for e, c in self.exponent_histogram}
        return record


def exponent_range(dtype: str) -> tuple[int, int]:
    """The floor(log2|x|) range of the finite non-zero values of `dtype`, subnormals included."""
    info = diag_step.float_info(dtype)
    return int(np.log2(float(info.smallest_subnormal))), int(info.maxexp) - 1


def _flat_abs(grads: list, dtype: str):
    flat = tf.concat([tf.reshape(tf.cast(g, dtype), [-1]) for g in grads], axis=0)
    return tf.abs(tf.cast(flat, tf.float32))


def stats_tensors(grads: list, dtype: str, reference: list | None = None) -> dict:
    """In-graph counts for one layer's gradients: size, zero, underflowed to zero, subnormal,
    non-finite, exponents. `reference`: the same gradients at a larger scale (None: no zero
    counts as underflowed)."""
    info = diag_step.float_info(dtype)
    absval = _flat_abs(grads, dtype)
    if reference is not None:
        ref = _flat_abs(reference, dtype)
        lost = tf.logical_and(tf.equal(absval, 0.0), tf.logical_and(tf.math.is_finite(ref), ref > 0))
    else:
        lost = tf.zeros_like(absval, tf.bool)
    finite = tf.math.is_finite(absval)
    nonzero = tf.logical_and(finite, absval > 0)
    tiny = float(info.smallest_normal)
    lo, hi = exponent_range(dtype)
    # float32 holds every float16/bfloat16 value exactly, so log2 there gives the exact exponent.
    safe = tf.where(nonzero, absval, tf.ones_like(absval))
    exps = tf.clip_by_value(tf.cast(tf.floor(tf.math.log(safe) / np.log(2.0)), tf.int32), lo, hi)
    hist = tf.math.unsorted_segment_sum(tf.cast(nonzero, tf.int32), exps - lo, hi - lo + 1)
    big, small = tf.constant(hi + 1), tf.constant(lo - 1)
    return {
        "size": tf.size(absval),
        "zero": tf.reduce_sum(tf.cast(tf.equal(absval, 0.0), tf.int32)),
        "lost": tf.reduce_sum(tf.cast(lost, tf.int32)),
        "subnormal": tf.reduce_sum(tf.cast(tf.logical_and(nonzero, absval < tiny), tf.int32)),
        "nonfinite": tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.int32)),
        "min_exp": tf.reduce_min(tf.where(nonzero, exps, big)),
        "max_exp": tf.reduce_max(tf.where(nonzero, exps, small)),
        "hist": hist,
    }


def from_counts(path: str, dtype: str, c: dict) -> LayerGradientStats:
    """A `LayerGradientStats` from the NumPy values of `stats_tensors`."""
    size = int(c["size"])
    lo, hi = exponent_range(dtype)
    any_nonzero = int(c["min_exp"]) <= hi
    return LayerGradientStats(
        path=path, compute_dtype=dtype, size=size,
        zero_fraction=int(c["zero"]) / max(size, 1),
        underflow_zero_fraction=int(c["lost"]) / max(size, 1),
        subnormal_fraction=int(c["subnormal"]) / max(size, 1),
        nonfinite_fraction=int(c["nonfinite"]) / max(size, 1),
        min_exponent=int(c["min_exp"]) if any_nonzero else None,
        max_exponent=int(c["max_exp"]) if any_nonzero else None,
        exponent_histogram=tuple((lo + i, int(n)) for i, n in enumerate(c["hist"]) if n),
    )


@dataclasses.dataclass(frozen=True)
class GradientReport:
    """Per-layer gradient statistics of one batch at one loss scale."""

    loss_scale: float
    loss: float
    layers: tuple[LayerGradientStats, ...]

    def flagged(self, threshold: float = 0.5) -> list[LayerGradientStats]:
        """Layers whose underflow (underflowed-to-zero + subnormal) fraction is >= `threshold`,
        or with any non-finite element."""
        return [s for s in self.layers if s.underflow_fraction >= threshold or s.nonfinite_fraction > 0]

    def as_dict(self) -> dict:
        """JSON-ready record."""
        return {"loss_scale": self.loss_scale, "loss": self.loss,
                "layers": [s.as_dict() for s in self.layers]}

    def to_json(self) -> str:
        """One-line JSON record (for logs)."""
        return json.dumps(self.as_dict(), sort_keys=True)


def _reduce(grads_by_layer, reference_by_layer, loss, dtypes):
    return {"loss": loss, "layers": [stats_tensors(g, d, r) for g, r, d
                                     in zip(grads_by_layer, reference_by_layer, dtypes)]}


class GradientProbe:
    """Per-layer gradient statistics of `model` on a fixed batch, traced once and rerun at any scale.

    Args:
        model: A built `keras.Model`.
        x: The probe batch's inputs.
        y: Its labels, or None (the mean of the outputs stands in for the loss).
        loss: None (the compiled loss), a Keras loss name or a callable `loss(y_true, y_pred)`.
        training: Bool, default True. The forward pass's `training` argument.
        jit_compile: Bool, default False. Compile the probe with XLA.
    """

    def __init__(self, model: keras.Model, x: Any, y: Any = None, loss: Any = None, *,
                 training: bool = True, jit_compile: bool = False):
        validation.check_type("model", model, keras.Model, "a keras.Model")
        if x is None:
            raise TypeError("`x` must be the model's input: an array, a tensor or the structure the model "
                            "takes. Received: x=None")
        self.model = model
        training = validation.check_bool("training", training)
        jit_compile = validation.check_bool("jit_compile", jit_compile)
        self._dtypes = None
        self._step = diag_step.DiagnosticStep(
            model, x, y, loss, self._reduce, training=training, jit_compile=jit_compile,
            attribute=False)

    def _reduce(self, trace, grads_by_layer, reference_by_layer, loss):
        self._dtypes = [layer.compute_dtype if keras.backend.is_float_dtype(layer.compute_dtype)
                        else "float32" for _, layer, _ in self._step.layers]
        return _reduce(grads_by_layer, reference_by_layer, loss, self._dtypes)

    def run(self, loss_scale: float | None = None) -> GradientReport:
        """Statistics at `loss_scale` (None: the model's optimizer's current scale)."""
        scale = diag_step.current_loss_scale(self.model) if loss_scale is None else \
            validation.check_float("loss_scale", loss_scale, min_value=0.0, min_inclusive=False,
                                   float32=True)
        out = self._step.run(scale)
        layers = tuple(from_counts(path, d, c) for (path, _, _), d, c
                       in zip(self._step.layers, self._dtypes, out["layers"]))
        return GradientReport(loss_scale=scale, loss=float(out["loss"]), layers=layers)


def gradient_statistics(model: keras.Model, x: Any, y: Any = None, loss: Any = None, *,
                        loss_scale: float | None = None, training: bool = True) -> GradientReport:
    """Per-layer weight-gradient statistics of one batch, in each layer's compute dtype.

    Args:
        model: A built `keras.Model`.
        x, y: One batch (y may be None: the mean of the outputs stands in for the loss).
        loss: None (the compiled loss), a Keras loss name or a callable.
        loss_scale: Float > 0 or None (the optimizer's current scale; 1.0 without loss scaling).
        training: Bool, default True.

    Example:
        >>> report = keras_amp.diagnostics.gradient_statistics(model, x, y)
        >>> [s.path for s in report.flagged()]      # layers losing most gradient elements
    """
    return GradientProbe(model, x, y, loss, training=training).run(loss_scale)

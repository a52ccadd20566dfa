"""`GradientStatistics`: every `update_freq` steps, per-layer gradient statistics in each layer's compute dtype."""

from __future__ import annotations

import os
import threading
from typing import Any

import keras
from absl import logging

from keras_amp import validation
from keras_amp.callbacks import renamed, summaries
from keras_amp.diagnostics import gradient_probe


class GradientStatistics(keras.callbacks.Callback):
    """Every `update_freq` steps, classifies each layer's gradient elements in its compute dtype.

    On a fixed probe batch, at the loss scale the optimizer uses at that moment, it records per
    layer the fraction of zero, underflowed-to-zero (zero here, not at a 4096x larger scale: a
    truly zero gradient such as an unused embedding row is not counted), subnormal and non-finite
    weight-gradient elements, and the smallest and largest exponent (floor(log2|g|)). A layer
    with at least `threshold` of its elements underflowed or subnormal, or any non-finite, is
    flagged: its gradients underflow (the scale is too small for it) or overflow. Between
    firings it costs one counter increment per step; each firing runs one forward and two
    backward passes of the probe batch (traced once). A `fit` that ends before its first firing
    (fewer than `update_freq` steps) fires once at its end, so a short run has its statistics too.

    Records go to `records` and to the absl log (one JSON line per firing: the structured
    record), flags to an absl warning, and with `log_dir` to TensorBoard: scalars
    `gradients/<layer>/{zero,underflow_zero,subnormal,nonfinite}_fraction`, `.../{min,max}_exponent`, and a
    histogram of exponents `gradients/<layer>/exponent` (`tensorboard --logdir <log_dir>`; writing
    them needs the `tensorboard` package, as Keras's `TensorBoard` callback does).

    Args:
        probe: Tuple `(x,)` or `(x, y)`: the batch the statistics are taken on.
        update_freq: Int >= 1. Training batches between firings (Keras's name, as in
            `keras.callbacks.TensorBoard`). Defaults to 100.
        loss: None (the compiled loss), a Keras loss name or a callable.
        threshold: Float in (0, 1]. Underflow fraction that flags a layer. Defaults to 0.5.
        log_dir: String or None. TensorBoard log directory.
        every_n_steps: Deprecated: the old name of `update_freq` (a `DeprecationWarning`).

    Example:

    ```python
    stats = keras_amp.callbacks.GradientStatistics((x[:64], y[:64]), update_freq=500, log_dir="logs/grads")
    model.fit(x, y, callbacks=[stats])
    stats.records[-1]["layers"][0]["zero_fraction"], stats.flagged
    ```
    """

    # Keras 3.15 converts the batch logs to Python numbers (a host sync) in the training loop's
    # thread unless every callback with batch hooks is async-safe; this one is (a lock guards
    # its counter), so between firings it adds no sync to the step.
    async_safe = True

    def __init__(self, probe: tuple, update_freq: int = 100, *, loss: Any = None,
                 threshold: float = 0.5, log_dir: str | None = None, every_n_steps: int | None = None):
        super().__init__()
        validation.check_type("probe", probe, tuple, "a tuple (x,) or (x, y)")
        if len(probe) not in (1, 2):
            raise ValueError(f"`probe` must be (x,) or (x, y). Received: probe of length {len(probe)}")
        self.probe = probe
        name, update_freq = renamed.resolve("GradientStatistics", "update_freq", update_freq, 100,
                                            every_n_steps=every_n_steps)
        self.update_freq = validation.check_int(name, update_freq, min_value=1)
        if loss is not None and not isinstance(loss, (str, dict)):
            validation.check_callable("loss", loss)
        self.loss = loss
        self.threshold = validation.check_float("threshold", threshold, min_value=0.0, max_value=1.0,
                                                min_inclusive=False)
        if log_dir is not None:
            validation.check_type("log_dir", log_dir, (str, os.PathLike), "a path or None")
        self.log_dir = None if log_dir is None else summaries.require_tensorboard(log_dir)
        self.records: list[dict] = []
        self.flagged: dict[str, int] = {}  # layer path -> step it was first flagged at
        self._steps = 0
        self._fit_start = (0, 0)  # (steps, records) when the current fit began
        self._lock = threading.Lock()
        self._probe = None
        self._writer = None

    every_n_steps = renamed.alias("every_n_steps", "update_freq", "GradientStatistics")

    def on_train_begin(self, logs=None):
        self._probe = gradient_probe.GradientProbe(self.model, *self.probe, loss=self.loss)
        self._fit_start = (self._steps, len(self.records))
        if self.log_dir:
            self._writer = summaries.Writer(self.log_dir)

    def on_train_batch_end(self, batch, logs=None):
        with self._lock:  # batch ends may be dispatched to several threads
            self._steps += 1
            if self._steps % self.update_freq == 0:
                self.fire()

    def fire(self) -> gradient_probe.GradientReport:
        """Takes the statistics now (also usable outside `fit`); returns the report."""
        if self._probe is None:
            self._probe = gradient_probe.GradientProbe(self.model, *self.probe, loss=self.loss)
        report = self._probe.run()
        record = {"step": self._steps, **report.as_dict()}
        self.records.append(record)
        logging.info("GradientStatistics: %s", report.to_json())
        flagged = report.flagged(self.threshold)
        new = [s for s in flagged if s.path not in self.flagged]
        for s in new:
            self.flagged[s.path] = self._steps
        if new:
            logging.warning(
                "GradientStatistics step %d (loss scale %g): %s. Underflow: raise the loss scale or "
                "compute the layer in float32; non-finite: see keras_amp.find_overflow.", self._steps,
                report.loss_scale, "; ".join(
                    f"{s.path!r} {s.compute_dtype}: {_percent(s.underflow_fraction)} underflowed/subnormal, "
                    f"{_percent(s.nonfinite_fraction)} non-finite" for s in new))
        if self._writer is not None:
            self._write(report)
        return report

    def _write(self, report: gradient_probe.GradientReport) -> None:
        for s in report.layers:
            values = {"zero_fraction": s.zero_fraction, "underflow_zero_fraction": s.underflow_zero_fraction,
                      "subnormal_fraction": s.subnormal_fraction,
                      "nonfinite_fraction": s.nonfinite_fraction}
            if s.min_exponent is not None:
                values.update(min_exponent=s.min_exponent, max_exponent=s.max_exponent)
            self._writer.scalars(values, self._steps, prefix=f"gradients/{s.path}/")
            self._writer.histogram(f"gradients/{s.path}/exponent",
                                   [(e, e + 1, n) for e, n in s.exponent_histogram], self._steps)
        self._writer.flush()

    def on_train_end(self, logs=None):
        steps, records = self._fit_start
        if self._steps > steps and len(self.records) == records:
            self.fire()  # the fit ended before its first firing
        if self._writer is not None:
            self._writer.close()


def _percent(fraction: float) -> str:
    """A fraction as a percentage that never reads 0% when it is not 0 (any non-finite element flags a layer)."""
    return "<0.1%" if 0 < fraction < 0.001 else f"{fraction:.1%}"

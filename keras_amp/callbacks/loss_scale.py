"""`LossScaleMonitor`: loss-scaling metrics in the `fit` logs, the symptom library, and diagnoses.

The monitor reads the optimizer's state only at log points (every `update_freq` batches and at
each epoch end): one `host_check()` per log point, nothing inside the step, and between log
points the logs carry the last values read as Python numbers. Symptoms are checked at the same
points; each one found is diagnosed by walking `keras_amp.diagnostics.symptoms`' decision tree.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Callable

import keras
from absl import logging

from keras_amp import policy as amp_policy
from keras_amp import validation
from keras_amp.callbacks import renamed, summaries
from keras_amp.callbacks.data_watch import DataWatch
from keras_amp.callbacks.trend_checks import TrendChecks, memory_in_use
from keras_amp.callbacks.update_loss import UpdateLossChecks
from keras_amp.diagnostics import symptoms, user_site
from keras_amp.diagnostics.traced_step import REFERENCE_FACTOR
from keras_amp.optimizers.loss_scale_optimizer import LossScaleOptimizer

ON_NAN = ("warn", "stop")
METRICS = ("loss_scale", "overflow_count", "overflows_since_log", "skipped_steps", "consecutive_overflows")
# In `fit`'s logs by default: Keras's progress bar prints every key as "%.4e" near zero ("0.0000e+00").
IN_LOGS = ("loss_scale",)


class LossScaleMonitor(TrendChecks, UpdateLossChecks, keras.callbacks.Callback):
    """Loss-scale metrics in `fit` logs; detects mixed-precision symptoms and says what to do.

    Metrics: `loss_scale`, `overflow_count` (total), `overflows_since_log`, `skipped_steps` and
    `consecutive_overflows`, read at log points only (every `update_freq` batches, and each
    epoch end): nothing runs inside the training step. `loss_scale` goes into `fit`'s logs (the
    progress bar, and the callbacks placed after the monitor, such as `keras.callbacks.TensorBoard`
    or `CSVLogger`); the four integer counters stay out of the logs, and so out of the progress
    bar, unless `counters_in_logs=True`. All five are in `History` (one value per epoch, like
    the logs), in `last` (the values at the latest log point) and, with `log_dir`, in TensorBoard.

    Symptoms, checked at log points:
    - a non-finite loss;
    - the probe batch's gradients all zero (globally, or in one layer) for `zero_grad_steps` steps;
    - the loss scale at its floor, still overflowing, at two log points in a row;
    - a `val_*` metric changing by more than `val_swing` (relative) from one epoch to the next;
    - memory (GPU memory in use, else process RSS) rising at `memory_epochs` epoch ends in a row
      and by 5% in all;
    - the step time between log points above `step_time_factor` x its running median, at two
      log points in a row (the first interval of each epoch, with iterator start and tracing,
      is left out).

    Each symptom is diagnosed once per `fit` by walking the decision tree of
    `keras_amp.diagnostics.symptoms`, issued as an `AmpWarning` (at the user's `fit` call) and
    kept in `diagnoses`. Every training step also counts the batches whose inputs or labels hold
    NaN/inf (a `DataWatch` wraps `train_step`; read at log points): such data is diagnosed first.
    Given a `probe` batch, the diagnosis of a non-finite loss also names the probe's non-finite
    entries and the layers `find_overflow` blames. The diagnostics never end training: a probe
    that cannot run (empty, or the wrong shape) is a warning, and its checks are off for that `fit`.

    Args:
        update_freq: Int >= 1. Batches between log points (Keras's name, as in
            `keras.callbacks.TensorBoard`). Defaults to 100.
        on_nan: "warn" or "stop". "stop" also ends training with `keras.callbacks.TerminateOnNaN`'s
            check, run at the log point that sees a non-finite loss (when Keras dispatches batch
            ends asynchronously, a step or two later) rather than at every batch, where
            `TerminateOnNaN` alone makes Keras dispatch batch ends synchronously: a host sync per
            step. Defaults to "warn".
        probe: None or a tuple `(x,)` / `(x, y)`: a batch for the gradient symptoms and the
            overflow locator (one extra forward and backward pass per log point).
        zero_grad_steps: Int >= 1. Steps of all-zero probe gradients before the symptom.
            Defaults to 200.
        val_swing: Float > 0. Relative epoch-to-epoch change of a `val_*` metric that counts as
            a swing. Defaults to 0.5.
        memory_epochs: Int >= 1. Consecutive epoch ends with rising memory. Defaults to 3.
        step_time_factor: Float > 1. Step-time jump over the running median. Defaults to 3.0.
        log_dir: String or None. Also write all five metrics as TensorBoard scalars there ("batch_*"
            at log points, "epoch_*" at epoch ends; needs `tensorboard`). Without loss scaling
            (bfloat16, float32) there are none: a warning at the start of `fit` says so.
        counters_in_logs: Bool. Also put the four counters into `fit`'s logs (the progress bar
            then prints them as floats). Defaults to False.
        log_every, check_every: Deprecated: old names of `update_freq` (a `DeprecationWarning`).
        update_loss_every: Int >= 1 or None (default): measure updates lost to rounding in one
            step of every N (`keras_amp.callbacks.update_loss`; `update_loss`, `update_loss_max`).

    Example:

    ```python
    monitor = keras_amp.callbacks.LossScaleMonitor(update_freq=50, probe=(x[:32], y[:32]), log_dir="logs/amp")
    history = model.fit(x, y, callbacks=[monitor])
    history.history["loss_scale"], history.history["overflow_count"], monitor.diagnoses
    ```
    """

    # Keras 3.15 syncs the batch logs to Python numbers every step unless every callback with batch
    # hooks is async-safe; this one is (a lock orders its batch ends), so it adds no sync itself.
    async_safe = True

    def __init__(self, update_freq: int = 100, *, on_nan: str = "warn", probe: Any = None,
                 zero_grad_steps: int = 200, val_swing: float = 0.5, memory_epochs: int = 3,
                 step_time_factor: float = 3.0, log_dir: str | None = None, counters_in_logs: bool = False,
                 log_every: int | None = None, check_every: int | None = None,
                 update_loss_every: int | None = None):
        super().__init__()
        name, update_freq = renamed.resolve("LossScaleMonitor", "update_freq", update_freq, 100,
                                            log_every=log_every, check_every=check_every)
        self.update_freq = validation.check_int(name, update_freq, min_value=1)
        self.on_nan = validation.check_choice("on_nan", on_nan, ON_NAN)
        # Keras's own non-finite-loss stop, called at the log points (see `on_nan`).
        self._terminate = keras.callbacks.TerminateOnNaN() if self.on_nan == "stop" else None
        self.counters_in_logs = validation.check_bool("counters_in_logs", counters_in_logs)
        if probe is not None:
            validation.check_type("probe", probe, tuple, "a tuple (x,) or (x, y)")
            if len(probe) not in (1, 2):
                raise ValueError(f"`probe` must be (x,) or (x, y). Received: probe of length {len(probe)}")
        self.probe = probe
        self.zero_grad_steps = validation.check_int("zero_grad_steps", zero_grad_steps, min_value=1)
        self.val_swing = validation.check_float("val_swing", val_swing, min_value=0.0, min_inclusive=False)
        self.memory_epochs = validation.check_int("memory_epochs", memory_epochs, min_value=1)
        self.step_time_factor = validation.check_float("step_time_factor", step_time_factor,
                                                       min_value=1.0, min_inclusive=False)
        if log_dir is not None:
            validation.check_type("log_dir", log_dir, (str, os.PathLike), "a path or None")
        self.log_dir = None if log_dir is None else summaries.require_tensorboard(log_dir)
        self._writer = summaries.Writer(self.log_dir) if self.log_dir else None
        self.diagnoses: list[symptoms.Diagnosis] = []
        self._memory_reader: Callable[[], tuple[str, int]] = memory_in_use
        self._lock = threading.Lock()
        self._init_update_loss(update_loss_every)
        self._reset()

    log_every = renamed.alias("log_every", "update_freq", "LossScaleMonitor")

    @property
    def last(self) -> dict[str, float]:
        """The five metrics as read at the latest log point (empty before the first)."""
        return dict(self._last)

    def set_model(self, model):
        super().set_model(model)
        if self._terminate is not None:
            self._terminate.set_model(model)

    # ------------------------------------------------------------------ state
    def _reset(self):
        self._batches = 0
        self._batch = 0  # the index of the latest batch in its epoch
        self._last: dict[str, float] = {}
        self._at_log = None  # overflow_count at the previous log point
        self._at_epoch = 0
        self._floor_streak = 0
        self._zero_since: dict[str, int] = {}
        self._val_prev: dict[str, tuple] = {}  # val_* key -> (its value, its training twin's or None)
        self._memory: list[int] = []
        self._intervals: list[float] = []
        self._tick = None
        self._slow_before = False
        self._fired: set[str] = set()
        self._gradient_probe = None
        self._located = None
        self._probe_off = False
        self._site = None

    def _optimizer(self):
        opt = getattr(self.model, "optimizer", None)
        if isinstance(opt, keras.optimizers.LossScaleOptimizer) and opt.built:
            return opt
        return None

    def _read(self) -> dict[str, float]:
        """The one host read of a log point."""
        opt = self._optimizer()
        if opt is None:
            return {}
        if isinstance(opt, LossScaleOptimizer):
            state = opt.host_check()  # also logs unlogged scale changes, applies on_min_scale
        else:
            state = {"loss_scale": float(keras.ops.convert_to_numpy(opt.dynamic_scale))}
        count = state.get("overflow_count")
        values = {"loss_scale": state["loss_scale"]}
        if count is not None:
            values.update(overflow_count=count, skipped_steps=count,  # total_steps = iterations + skipped
                          consecutive_overflows=state["consecutive_overflows"],
                          overflows_since_log=count - (self._at_log if self._at_log is not None else 0))
            self._at_log = count
        return values

    # ------------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None):
        self._reset()
        self.diagnoses = []
        self._site = user_site.find()  # the user's fit call: where the warnings point
        self._watch_data()
        self._attach_update_probe()
        if self.probe is not None and _rows(self.probe) == 0:
            self._probe_failed("it is empty (0 rows)")
        if self._optimizer() is not None:  # a later fit: count overflows from here on
            self._read()
            self._at_epoch = self._at_log if self._at_log is not None else 0
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and not isinstance(opt, keras.optimizers.LossScaleOptimizer):
            unscaled = (f"optimizer {type(opt).__name__!r} does not scale the loss (policy "
                        f"{self.model.dtype_policy.name}); only the symptoms are monitored")
            if self.log_dir is None:
                logging.info("LossScaleMonitor: %s.", unscaled)
            else:  # TensorBoard files asked for, and this fit writes none
                self._warn(f"LossScaleMonitor(log_dir={self.log_dir!r}) writes nothing in this fit: {unscaled}. "
                           "GradientStatistics(probe, log_dir=...) logs the gradients' range under any policy.")

    def on_epoch_begin(self, epoch, logs=None):
        self._tick = (time.perf_counter(), self._batches, True)

    def on_train_batch_end(self, batch, logs=None):
        with self._lock:  # batch ends may be dispatched to several threads
            self._on_batch(batch, logs)

    def _on_batch(self, batch, logs) -> None:
        self._batches += 1
        self._batch = batch
        self._check_update_loss(logs)
        if self._batches % self.update_freq == 0:
            arrived = time.perf_counter()  # the monitor's own work below is not step time
            self._last = self._read()
            if self._writer is not None and self._last:
                self._writer.scalars(self._last, self._batches, prefix="batch_")
            self._check_loss(logs)
            self._check_scale_floor()
            self._check_gradients()
            self._check_step_time(arrived)
        if logs is not None:
            logs.update(self._in_logs(self._last))

    def _in_logs(self, values: dict) -> dict:
        return dict(values) if self.counters_in_logs else {k: v for k, v in values.items() if k in IN_LOGS}

    def on_epoch_end(self, epoch, logs=None):
        values = self._read()
        if "overflow_count" in values:
            values["overflows_since_log"] = values["overflow_count"] - self._at_epoch
            self._at_epoch = values["overflow_count"]
        self._last = values
        if logs is not None:
            logs.update(self._in_logs(values))
        history = getattr(self.model, "history", None)  # this fit's History (Keras sets it)
        if isinstance(history, keras.callbacks.History):
            # The counters kept out of the logs: History records the logs after this hook runs.
            for key, value in values.items():
                if logs is None or key not in logs:
                    history.history.setdefault(key, []).append(value)
        if self._writer is not None and values:
            self._writer.scalars(values, epoch, prefix="epoch_")
        self._check_loss(logs)
        self._check_validation(logs or {})
        self._check_memory()

    def on_train_end(self, logs=None):
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.remove()
        opt = self._optimizer()
        if isinstance(opt, LossScaleOptimizer):
            opt.host_check()
        if self._writer is not None:
            self._writer.flush()

    # ------------------------------------------------------------------ data and probe
    def _watch_data(self) -> None:
        watch = getattr(self, "_watch", None)
        if watch is None or watch.model is not self.model:
            try:
                watch = DataWatch(self.model)
            except Exception as e:  # a diagnosis must not end training on its own
                self._warn(f"LossScaleMonitor: the batches cannot be watched for NaN/inf ({_one_line(e)}); "
                           "the diagnosis asks about the data instead of answering it.")
                watch = None
        self._watch = watch
        if watch is not None:
            watch.install()
            watch.reset()

    def _data_facts(self) -> tuple[bool | None, str]:
        """(do the training batches or the probe hold NaN/inf, where), from the watch's counts and the probe."""
        found = []
        known = False
        if self._watch is not None:
            known = True
            where = self._watch.describe((self.params or {}).get("steps"))
            if where:
                found.append(where)
        if self.probe is not None and not self._probe_off:
            from keras_amp.diagnostics.overflow import non_finite_data
            known = True
            found += [f"the probe batch's {w}" for w in non_finite_data(*self.probe)]
        if found:
            return True, "; ".join(found)
        return (False if known else None), ""

    def _probe_failed(self, why: str) -> None:
        if not self._probe_off:
            self._probe_off = True
            self._warn(f"LossScaleMonitor: the probe batch cannot be used: {why}. The gradient symptoms "
                       "and the overflow locator are off for this fit; training goes on. Pass "
                       "probe=(x[:32], y[:32]) with rows the model takes.")

    def _warn(self, message: str) -> None:
        user_site.warn(message, amp_policy.AmpWarning, self._site)

    # ------------------------------------------------------------------ symptoms
    def _report(self, name: str, facts: dict, detail: str, **context) -> None:
        if name in self._fired:
            return
        self._fired.add(name)
        diagnosis = symptoms.diagnose(name, facts, detail, **context)
        self.diagnoses.append(diagnosis)
        self._warn(str(diagnosis))

    def _scale_context(self) -> dict:
        opt = self._optimizer()
        scale = self._last.get("loss_scale")
        context = {} if scale is None else {"half_scale": f"{scale / 2:g}",
                                            "probe_scale": f"{scale * REFERENCE_FACTOR:g}"}
        if getattr(opt, "min_scale", None) is not None:
            context["half_min_scale"] = f"{opt.min_scale / 2:g}"
        return context

    def _check_loss(self, logs) -> None:
        loss = (logs or {}).get("loss")
        if loss is None or math.isfinite(float(loss)):
            return
        if "non_finite_loss" not in self._fired:
            facts, context = self._overflow_facts()
            self._report("non_finite_loss", facts, f"loss={float(loss)} after {self._batches} steps", **context)
        if self._terminate is not None and not self.model.stop_training:
            self._terminate.on_batch_end(self._batch, logs)  # prints Keras's line, stops training

    def _overflow_facts(self) -> tuple[dict, dict]:
        """The facts and template values of the overflow questions (data first, then the scale)."""
        opt = getattr(self.model, "optimizer", None)
        facts: dict[str, Any] = {"loss_scaled": isinstance(opt, keras.optimizers.LossScaleOptimizer)}
        facts["data_non_finite"], data = self._data_facts()
        context = self._scale_context()
        if data:
            context["data"] = data
        opt = self._optimizer()
        if opt is not None:
            min_scale = getattr(opt, "min_scale", None)
            facts["scale_at_floor_or_overflowing"] = (
                (min_scale is not None and self._last.get("loss_scale", math.inf) <= min_scale)
                or self._last.get("overflows_since_log", 0) > 0 or self._last.get("overflow_count", 0) > 0)
        report = self._locate()
        if report is not None:
            layers = report.offending_layers()
            facts["forward_overflow"] = report.forward is not None and report.forward.layer in layers
            if layers:
                context["layers"] = layers
        return facts, context

    def _locate(self):
        """find_overflow on the probe batch, once per log point."""
        if self.probe is None or self._probe_off:
            return None
        if self._located is not None and self._located[0] == self._batches:
            return self._located[1]
        from keras_amp.diagnostics.overflow import find_overflow
        try:
            report = find_overflow(self.model, *self.probe)
        except Exception as e:  # a diagnosis must not end training on its own
            self._probe_failed(f"find_overflow on it failed ({_one_line(e)})")
            report = None
        self._located = (self._batches, report)
        return report

    def _check_scale_floor(self) -> None:
        opt = self._optimizer()
        if not isinstance(opt, LossScaleOptimizer) or not opt.dynamic:
            return
        # Pinned: at the floor and still overflowing (a scale started at its floor is not a symptom).
        at_floor = (self._last.get("loss_scale", math.inf) <= opt.min_scale
                    and self._last.get("overflows_since_log", 0) > 0)
        self._floor_streak = self._floor_streak + 1 if at_floor else 0
        if self._floor_streak >= 2 and "scale_at_floor" not in self._fired:
            facts, context = self._overflow_facts()
            self._report("scale_at_floor", facts,
                         f"loss_scale={self._last['loss_scale']:g} = min_scale, overflowing, at 2 log points",
                         **context)


def _rows(probe: tuple) -> int | None:
    """The number of rows of a probe batch (None: not known)."""
    leaves = [t for t in keras.tree.flatten(probe[0]) if hasattr(t, "shape") and len(t.shape)]
    return None if not leaves or leaves[0].shape[0] is None else int(leaves[0].shape[0])


def _one_line(e: Exception) -> str:
    return user_site.one_line(e)

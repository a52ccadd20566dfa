"""`TrendChecks`: the `LossScaleMonitor` symptoms read from trends across log points and epochs
(gradients zero for many steps, step time, validation swings, memory growth), split from
`loss_scale.py` as they are.

A mixin: it uses the monitor's state (`_tick`, `_intervals`, `_slow_before`, `_val_prev`,
`_memory`, `_zero_since`, `_gradient_probe`, `_last`, `_batches`, the thresholds) and its
`_report` / `_scale_context` / `_optimizer` / `_probe_failed`.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings

import tensorflow as tf

from keras_amp.diagnostics import user_site


def memory_in_use() -> tuple[str, int]:
    """("gpu", bytes in use on GPU:0) where there is a GPU, else ("rss", the process's resident bytes)."""
    if tf.config.list_logical_devices("GPU"):
        return "gpu", int(tf.config.experimental.get_memory_info("GPU:0")["current"])
    try:
        with open("/proc/self/statm") as f:
            return "rss", int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: peak RSS, which still grows when memory grows
        import resource
        return "rss", int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class TrendChecks:
    def _check_gradients(self) -> None:
        if self.probe is None or self._probe_off:
            return
        try:
            if self._gradient_probe is None:
                from keras_amp.diagnostics.gradient_probe import GradientProbe
                self._gradient_probe = GradientProbe(self.model, *self.probe)
            report = self._gradient_probe.run()
        except Exception as e:  # a diagnosis must not end training on its own
            self._probe_failed(f"its gradient statistics failed ({user_site.one_line(e)})")
            return
        zero_layers = [s.path for s in report.layers if s.size and s.zero_fraction == 1.0]
        worst = {"(global)"} if report.layers and len(zero_layers) == len(report.layers) else set()
        worst |= set(zero_layers)
        self._zero_since = {k: self._zero_since.get(k, self._batches) for k in worst}
        lasting = [k for k, since in self._zero_since.items() if self._batches - since >= self.zero_grad_steps]
        if not lasting:
            return
        opt = self._optimizer()
        layers = [k for k in lasting if k != "(global)"]
        # Underflow, not dead gradients: the zeros are values at a 4096x larger scale.
        chosen = [s for s in report.layers if s.path in layers] or list(report.layers)
        facts = {"loss_scaled": opt is not None,
                 "gradient_underflow": any(s.underflow_zero_fraction > 0 for s in chosen)}
        what = "all gradients" if "(global)" in lasting else f"the gradients of {', '.join(map(repr, layers))}"
        self._report("zero_gradients", facts, f"{what} zero for {self.zero_grad_steps}+ steps",
                     layers=layers, **self._scale_context())

    def _check_step_time(self, now: float) -> None:
        if self._tick is not None:
            start, batches, first = self._tick
            # The first interval of an epoch includes starting the data iterator (and tracing).
            per_step = (now - start) / max(self._batches - batches, 1)
            if not first and len(self._intervals) >= 5:
                median = statistics.median(self._intervals)
                # Two slow intervals in a row: one alone is a hiccup (GC, a neighbour's burst).
                slow = per_step > self.step_time_factor * median
                if slow and self._slow_before:
                    self._report("step_time_jump", {}, f"{per_step * 1e3:.1f} ms/step after {self._batches} "
                                 f"steps vs a running median of {median * 1e3:.1f} ms")
                self._slow_before = slow
            if not first:
                self._intervals.append(per_step)
        self._tick = (time.perf_counter(), self._batches, False)

    def _check_validation(self, logs: dict) -> None:
        swings = []
        for key, value in logs.items():
            if not key.startswith("val_") or not isinstance(value, (int, float)):
                continue
            train = logs.get(key[4:])
            train = train if isinstance(train, (int, float)) else None
            prev, train_prev = self._val_prev.get(key, (None, None))
            self._val_prev[key] = (value, train)
            if prev is None:
                continue
            # Learning moves a validation metric the way it moves its training twin (both losses fall,
            # both accuracies rise): a large change that way is progress, not a swing.
            learning = None not in (train, train_prev) and (value - prev) * (train - train_prev) > 0
            if not math.isfinite(value) or (abs(value - prev) > self.val_swing * max(abs(prev), 1e-12)
                                            and not learning):
                swings.append(f"{key} {prev:.4g} -> {value:.4g}")
        if swings:
            facts = {"recent_overflows": self._recent_overflows(logs), "outputs_float32": self._outputs_float32()}
            self._report("validation_swing", facts, "; ".join(swings), **self._scale_context())

    def _recent_overflows(self, logs: dict) -> bool | None:
        """Whether steps overflowed since the last log point: the loss scaler's count; without loss
        scaling nothing is skipped, so a finite training loss says no step put inf/NaN into the weights."""
        if self._optimizer() is not None:
            return self._last["overflows_since_log"] > 0 if "overflows_since_log" in self._last else None
        loss = logs.get("loss")
        return False if isinstance(loss, (int, float)) and math.isfinite(loss) else None

    def _outputs_float32(self) -> bool | None:
        try:
            from keras_amp.diagnostics.check import check_model
        except ImportError:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kinds = check_model(self.model).kinds()
        return not ({"output_not_float32", "low_precision_loss"} & kinds)

    def _check_memory(self) -> None:
        kind, used = self._memory_reader()
        self._memory.append(used)
        recent = self._memory[-(self.memory_epochs + 1):]
        rising = all(b > a for a, b in zip(recent, recent[1:])) and recent[-1] >= 1.05 * recent[0]
        if len(recent) == self.memory_epochs + 1 and rising:
            self._report("memory_growth", {}, f"{kind} {recent[0] / 2**20:.1f} MiB -> {recent[-1] / 2**20:.1f} MiB "
                         f"over {self.memory_epochs} epochs")

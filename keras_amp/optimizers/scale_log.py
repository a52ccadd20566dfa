"""Host-side record of a `LossScaleOptimizer`'s scale changes: rate-limited absl lines and
`on_min_scale`. Runs outside the compiled step (from a rare-branch `tf.py_function`, after an
eager step, or from `host_check()`), so it never stalls the device every step."""

from __future__ import annotations

import threading
import time

from absl import logging


class MinScaleError(RuntimeError):
    """Training overflows persistently even at `min_scale` and `on_min_scale="raise"`."""


class RateLimiter:
    """At most `per_minute` log lines per rolling minute; counts what it suppressed."""

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self.stamps: list[float] = []
        self.suppressed = 0

    def allow(self) -> bool:
        now = time.monotonic()
        self.stamps = [t for t in self.stamps if now - t < 60.0]
        if len(self.stamps) < self.per_minute:
            self.stamps.append(now)
            return True
        self.suppressed += 1
        return False


class ScaleLog:
    """What the host last knew of one optimizer's scale, and whether it already warned.

    `known_scale` is the scale last logged or read, so `check()` logs only changes that no
    in-graph event reported (under XLA, and in replica context, all of them).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.known_scale: float | None = None
        self._warned = False
        self._limiter: RateLimiter | None = None

    def event(self, opt, kind: int, step: int, old: float, new: float, consecutive: int, at_min: int) -> None:
        """A change reported from inside the step: kind 0 = overflow, 1 = growth."""
        with self._lock:
            self.known_scale = new
        if new != old:
            why = (f"{consecutive} consecutive overflow(s), hysteresis={opt.hysteresis}" if kind == 0
                   else f"{opt.dynamic_growth_steps} finite steps")
            self._log_change(opt, step, old, new, why)
        self._enforce_min_scale(opt, at_min, new, step)

    def check(self, opt, state: dict) -> None:
        """Logs a change the host has not seen yet and applies `on_min_scale`, from `state`
        (the values `LossScaleOptimizer.host_check()` read)."""
        scale = state["loss_scale"]
        with self._lock:
            old, self.known_scale = self.known_scale, scale
        if old is not None and old != scale:
            why = "backed off after overflows" if scale < old else "grew after finite steps"
            self._log_change(opt, state["total_steps"], old, scale, why + " (host check)")
        self._enforce_min_scale(opt, state["overflows_at_min_scale"], scale, state["total_steps"])

    def _log_change(self, opt, step: int, old: float, new: float, why: str) -> None:
        with self._lock:
            if self._limiter is None:
                self._limiter = RateLimiter(opt.log_lines_per_minute)
            if not self._limiter.allow():
                return
            suppressed, self._limiter.suppressed = self._limiter.suppressed, 0
        logging.info("LossScaleOptimizer %r step %d: loss scale %g -> %g (%s)%s", opt.name, step,
                     old, new, why,
                     f"; {suppressed} earlier change(s) not logged (rate limit)" if suppressed else "")

    def _enforce_min_scale(self, opt, at_min: int, scale: float, step: int) -> None:
        if at_min < opt.min_scale_patience or opt.on_min_scale == "ignore":
            return
        where = f"at min_scale={opt.min_scale:g}" if opt.dynamic else f"at the static scale {scale:g}"
        msg = (f"LossScaleOptimizer {opt.name!r}: {at_min} consecutive steps overflowed {where} "
               f"(step {step}); they are skipped. Try a lower `initial_scale`/`min_scale`, move "
               "the offending layers to float32 (dtype='float32'), or check the data for NaN/inf.")
        if opt.on_min_scale == "raise":
            raise MinScaleError(msg)
        with self._lock:
            warned, self._warned = self._warned, True
        if not warned:
            logging.warning(msg)

"""The dynamic loss-scale rule as a pure function: `adjust(rule, state, finite) -> state`.

`LossScaleOptimizer` keeps a `ScaleState` in optimizer variables and assigns what `adjust`
returns; tests call `adjust` directly. The rule, per step:

```
total_steps += 1
if finite:
    consecutive_overflows = 0; overflows_at_min_scale = 0
    step_counter += 1
    if dynamic and step_counter >= dynamic_growth_steps:
        scale = min(scale * growth_factor, max_scale)          # never past the ceiling
        step_counter = 0
else:                                                          # the step is skipped
    overflow_count += 1; consecutive_overflows += 1; step_counter = 0
    at_floor = scale <= min_scale if dynamic else True         # static: every overflow counts
    overflows_at_min_scale = overflows_at_min_scale + 1 if at_floor else 0
    if dynamic and consecutive_overflows >= hysteresis:
        scale = max(scale * backoff_factor, min_scale)         # never below the floor
min_scale_reached = overflows_at_min_scale >= min_scale_patience
```

Values may be Python numbers, NumPy scalars or tensors; `finite` may be a Python bool (the
rule then emits only the ops of that branch) or a boolean scalar tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from keras import ops

from keras_amp import validation


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """The constants of the rule (see the module docstring), validated at construction.

    Args:
        dynamic: Bool. False keeps the scale fixed and only counts.
        dynamic_growth_steps: Int >= 1. Finite steps between increases.
        growth_factor: Float > 1.
        backoff_factor: Float in (0, 1).
        min_scale: Float > 0 within float32's normal range. Floor of the scale.
        max_scale: Float >= min_scale within float32's range. Ceiling of the scale.
        hysteresis: Int >= 1. Consecutive overflows before the scale backs off.
        min_scale_patience: Int >= 1. Overflows at the floor before `min_scale_reached`.
    """

    dynamic: bool = True
    dynamic_growth_steps: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    hysteresis: int = 1
    min_scale_patience: int = 10

    def __post_init__(self):
        # Counters are int64 variables (Keras's "int"); scales are float32 variables.
        checked = {
            "dynamic": validation.check_bool("dynamic", self.dynamic),
            "dynamic_growth_steps": validation.check_int("dynamic_growth_steps", self.dynamic_growth_steps, min_value=1),
            "growth_factor": check_growth_factor(self.growth_factor),
            "backoff_factor": check_backoff_factor(self.backoff_factor),
            "min_scale": check_scale("min_scale", self.min_scale),
            "max_scale": check_scale("max_scale", self.max_scale),
            "hysteresis": validation.check_int("hysteresis", self.hysteresis, min_value=1),
            "min_scale_patience": validation.check_int("min_scale_patience", self.min_scale_patience, min_value=1),
        }
        if checked["max_scale"] < checked["min_scale"]:
            raise ValueError(
                "`max_scale` must be >= `min_scale`. "
                f"Received: min_scale={self.min_scale}, max_scale={self.max_scale}"
            )
        for key, value in checked.items():
            object.__setattr__(self, key, value)


class ScaleState(NamedTuple):
    """The loss scale and its counters; `LossScaleOptimizer` holds each in a variable."""

    scale: Any
    step_counter: Any
    total_steps: Any
    overflow_count: Any
    consecutive_overflows: Any
    overflows_at_min_scale: Any


def check_scale(name: str, value: Any) -> float:
    """A loss scale or bound: > 0 and a normal float32 (smaller ones become 0.0 there)."""
    return validation.check_float(name, value, min_value=0.0, min_inclusive=False, float32=True)


def check_growth_factor(value: Any) -> float:
    return validation.check_float("growth_factor", value, min_value=1.0, min_inclusive=False, float32=True)


def check_backoff_factor(value: Any) -> float:
    return validation.check_float(
        "backoff_factor", value, min_value=0.0, max_value=1.0, min_inclusive=False, max_inclusive=False, float32=True
    )


def initial_state(initial_scale: float) -> ScaleState:
    """The state before the first step."""
    return ScaleState(check_scale("initial_scale", initial_scale), 0, 0, 0, 0, 0)


def adjust(rule: ScaleRule, state: ScaleState, finite) -> ScaleState:
    """The state after one step whose (all-replica) gradients were `finite` or not."""
    if isinstance(finite, bool):
        return _after_finite(rule, state) if finite else _after_overflow(rule, state)
    if_finite, if_not = _after_finite(rule, state), _after_overflow(rule, state)
    return ScaleState(*(a if a is b else ops.where(finite, a, b) for a, b in zip(if_finite, if_not)))


def min_scale_reached(rule: ScaleRule, state: ScaleState):
    """True once `min_scale_patience` steps in a row overflowed at the floor (or, static, at all)."""
    return state.overflows_at_min_scale >= rule.min_scale_patience


def _zero_like(x):
    return 0 if isinstance(x, int) else ops.zeros_like(x)


def _after_finite(rule, state):
    scale, counter = state.scale, state.step_counter + 1
    if rule.dynamic:
        grows = counter >= rule.dynamic_growth_steps
        scale = ops.where(grows, ops.minimum(scale * rule.growth_factor, rule.max_scale), scale)
        counter = ops.where(grows, _zero_like(state.step_counter), counter)
    return state._replace(scale=scale, step_counter=counter, total_steps=state.total_steps + 1,
                          consecutive_overflows=_zero_like(state.consecutive_overflows),
                          overflows_at_min_scale=_zero_like(state.overflows_at_min_scale))


def _after_overflow(rule, state):
    scale, consecutive = state.scale, state.consecutive_overflows + 1
    at_min = state.overflows_at_min_scale + 1
    if rule.dynamic:  # static: every overflow is "at the floor", the scale cannot go lower
        at_min = ops.where(scale <= rule.min_scale, at_min, _zero_like(state.overflows_at_min_scale))
        backed_off = ops.maximum(scale * rule.backoff_factor, rule.min_scale)
        scale = ops.where(consecutive >= rule.hysteresis, backed_off, scale)
    return state._replace(scale=scale, step_counter=_zero_like(state.step_counter),
                          total_steps=state.total_steps + 1, overflow_count=state.overflow_count + 1,
                          consecutive_overflows=consecutive, overflows_at_min_scale=at_min)

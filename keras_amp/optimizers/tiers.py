"""Loss-scaling tiers: the tuning table by model size, and the "auto" choice."""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

from keras_amp import validation

AUTO = "auto"
# Trainable-parameter thresholds separating the tiers (the design's tuning matrix).
SMALL_MAX_PARAMS = 100_000_000  # "small": fewer than 100M
LARGE_MIN_PARAMS = 1_000_000_000  # "large": more than 1B


@dataclasses.dataclass(frozen=True)
class TierValues:
    """The loss-scaling defaults of one tier."""

    name: str | None
    initial_scale: float
    dynamic_growth_steps: int
    min_scale: float
    max_scale: float


# tier=None keeps stock Keras's initial scale and growth interval, with bounds added.
KERAS_DEFAULT = TierValues(None, 2.0**15, 2000, 1.0, 2.0**24)

TIERS = {
    "small": TierValues("small", 2.0**10, 100, 1.0, 65536.0),
    "medium": TierValues("medium", 2.0**12, 50, 256.0, 131072.0),
    "large": TierValues("large", 2.0**16, 20, 1024.0, 262144.0),
}
TIER_NAMES = (None, AUTO) + tuple(TIERS)


def validate_tier(tier) -> None:
    """Raises unless `tier` is None, "auto" or a name in `TIERS`."""
    if tier is None:
        return
    allowed = "None (Keras's defaults), " + ", ".join(repr(t) for t in TIER_NAMES[1:])
    if not isinstance(tier, str):
        raise TypeError(f"`tier` must be a string or None. Received: tier={tier!r} of type "
                        f"{type(tier).__name__}. Allowed: {allowed}")
    if tier not in TIER_NAMES[1:]:
        raise ValueError(f"Unknown `tier`. Received: tier={tier!r}. Allowed: {allowed}")


def count_params(var_list: Iterable) -> int:
    """Number of scalar parameters in `var_list` (the variables an optimizer is built with)."""
    return sum(math.prod(int(d) for d in v.shape) for v in var_list)


def choose_tier(num_params: int) -> str:
    """The tier for a model with `num_params` trainable parameters."""
    num_params = validation.check_int("num_params", num_params, min_value=0)
    if num_params < SMALL_MAX_PARAMS:
        return "small"
    if num_params <= LARGE_MIN_PARAMS:
        return "medium"
    return "large"


def tier_values(tier: str | None, var_list: Iterable | None = None) -> TierValues:
    """The table row for `tier`; "auto" needs `var_list` to count parameters."""
    validate_tier(tier)
    if tier is None:
        return KERAS_DEFAULT
    if tier == AUTO:
        if var_list is None:
            raise ValueError(
                'tier="auto" is resolved from the variables the optimizer is built '
                "with; build it first (`optimizer.build(model.trainable_variables)`). "
                "Received: var_list=None"
            )
        return TIERS[choose_tier(count_params(var_list))]
    return TIERS[tier]

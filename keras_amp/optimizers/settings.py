"""Checks of `LossScaleOptimizer`'s constructor arguments, shared with `wrap()`.

`wrap()` validates the same arguments under every policy, also where it then returns the
optimizer unwrapped, so a typo fails on the machine where it was written, not on the first
float16 one.
"""

from __future__ import annotations

import warnings
from typing import Any

from keras_amp import validation
from keras_amp.optimizers import scale_rule, tiers
from keras_amp.policy import AmpWarning

ON_MIN_SCALE = ("warn", "raise", "ignore")
# Base-optimizer arguments stock LossScaleOptimizer accepts (at their defaults) from old configs.
LEGACY_KWARGS = ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema", "ema_momentum",
                 "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps")
# The values a tier supplies when the caller passes None.
TIER_KEYS = ("initial_scale", "dynamic_growth_steps", "min_scale", "max_scale")


def check_known_kwargs(kwargs: dict[str, Any]) -> None:
    """ValueError naming the keyword arguments `LossScaleOptimizer` does not take.

    ValueError, not TypeError, and the names in the order given: the stock constructor raises
    "LossScaleOptimizer does not support arguments: `foo`, `bar`.", and a drop-in subclass keeps
    its parent's exception types.
    """
    unknown = [k for k in kwargs if k not in LEGACY_KWARGS]
    if unknown:
        raise ValueError(
            f"LossScaleOptimizer does not support arguments: `{'`, `'.join(unknown)}`. Received: "
            f"{', '.join(f'{k}={kwargs[k]!r}' for k in unknown)}. Allowed: inner_optimizer, initial_scale, "
            "dynamic_growth_steps, name, tier, min_scale, max_scale, growth_factor, backoff_factor, "
            "hysteresis, dynamic, on_min_scale (and, at their defaults, the legacy "
            f"{', '.join(LEGACY_KWARGS)})")


def check_name(name: Any) -> None:
    """None or a string without "/": ValueError otherwise, the stock constructor's type and wording (a drop-in
    subclass keeps its parent's exception types)."""
    if name is not None and (not isinstance(name, str) or "/" in name):
        raise ValueError(f"Argument `name` must be a string and cannot contain character `/`. Received: name={name!r}")


def _check_steps(name: str, value: Any) -> int:
    # The counters compared with it are int64 variables (Keras's "int"): int64's range bounds it.
    return validation.check_int(name, value, min_value=1)


def _optional(check, name: str, value: Any):
    return None if value is None else check(name, value)


def check_arguments(*, initial_scale=None, dynamic_growth_steps=None, name=None, tier=None, min_scale=None,
                    max_scale=None, growth_factor=2.0, backoff_factor=0.5, hysteresis=1, dynamic=True,
                    on_min_scale="warn", **kwargs) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validates everything but `inner_optimizer`; returns (settings, the explicit tier keys).

    Unknown keyword arguments raise TypeError; the stock legacy ones pass through to Keras,
    which accepts only their defaults.
    """
    validation.check_no_extra_kwargs("LossScaleOptimizer()", kwargs, LEGACY_KWARGS)
    check_name(name)
    tiers.validate_tier(tier)
    settings = {
        "on_min_scale": validation.check_choice("on_min_scale", on_min_scale, ON_MIN_SCALE),
        "dynamic": validation.check_bool("dynamic", dynamic),
        "growth_factor": scale_rule.check_growth_factor(growth_factor),
        "backoff_factor": scale_rule.check_backoff_factor(backoff_factor),
        "hysteresis": _check_steps("hysteresis", hysteresis),
    }
    explicit = {
        "initial_scale": _optional(scale_rule.check_scale, "initial_scale", initial_scale),
        "dynamic_growth_steps": _optional(_check_steps, "dynamic_growth_steps", dynamic_growth_steps),
        "min_scale": _optional(scale_rule.check_scale, "min_scale", min_scale),
        "max_scale": _optional(scale_rule.check_scale, "max_scale", max_scale),
    }
    if tier == tiers.AUTO:  # the tier is known at build time: the values must suit whichever it is
        check_bounds(settings["dynamic"], explicit)
        check_auto_bounds(settings["dynamic"], explicit)
    else:
        check_bounds(settings["dynamic"], resolve(explicit, tiers.tier_values(tier)), tier)
    return settings, explicit


def resolve(explicit: dict[str, Any], values: tiers.TierValues) -> dict[str, Any]:
    """The explicit values, the tier's where None."""
    return {key: getattr(values, key) if explicit[key] is None else explicit[key] for key in TIER_KEYS}


def check_bounds(dynamic: bool, values: dict[str, Any], tier: Any = tiers.AUTO) -> None:
    """`min_scale <= initial_scale <= max_scale` among the values known (None: not yet)."""
    lo, hi, init = values["min_scale"], values["max_scale"], values["initial_scale"]
    if lo is not None and hi is not None and hi < lo:
        raise ValueError(f"`max_scale` must be >= `min_scale`. Received: min_scale={lo}, max_scale={hi}")
    # A static scale never moves, so the bounds (which limit growth and back-off) do not apply.
    in_bounds = init is None or ((lo is None or init >= lo) and (hi is None or init <= hi))
    if dynamic and not in_bounds:
        raise ValueError(
            "`initial_scale` must lie within [min_scale, max_scale] (it is not clipped). "
            f"Received: initial_scale={init}, min_scale={lo}, max_scale={hi}"
            + ("" if tier == tiers.AUTO else f" (tier={tier!r})")
        )


def check_auto_bounds(dynamic: bool, explicit: dict[str, Any]) -> None:
    """tier="auto": the explicit values must lie within the bounds of every tier it may pick.

    The tier is chosen at build (inside the first `fit` step), so a value that suits only some tiers
    would fail there, or not, by model size. It fails here instead, naming the tiers it breaks and the
    fix: a named `tier`, or explicit `min_scale` / `max_scale`, which then hold for every tier.
    """
    broken = []
    for name, values in tiers.TIERS.items():
        try:
            check_bounds(dynamic, resolve(explicit, values), name)
        except ValueError:
            broken.append(f"{name} [{values.min_scale:g}, {values.max_scale:g}]")
    if broken:
        given = ", ".join(f"{k}={explicit[k]}" for k in ("initial_scale", "min_scale", "max_scale") if explicit[k])
        raise ValueError(
            "With tier='auto', `initial_scale`, `min_scale` and `max_scale` must suit the bounds [min_scale, "
            "max_scale] of every tier it may pick (the tier is chosen at build, by parameter count): "
            f"{'they fit no tier' if len(broken) == len(tiers.TIERS) else 'they do not fit'}: {'; '.join(broken)}. "
            f"Received: {given}. Allowed: a named `tier`, or explicit `min_scale`/`max_scale` around "
            "`initial_scale`")


def warn_raise_under_xla(name: str) -> bool:
    """Warns (`AmpWarning`) that on_min_scale="raise" cannot stop an XLA-compiled step; returns True.

    "warn" needs no notice: its warning comes when `fit` ends, or at a `LossScaleMonitor` log point.
    """
    warnings.warn(
        f"LossScaleOptimizer {name!r}: the step is compiled with XLA (jit_compile=True, Keras's 'auto' on a "
        "GPU), which cannot call the host, so on_min_scale='raise' cannot stop training inside the step: `fit` "
        "raises MinScaleError when it ends. To stop earlier, attach keras_amp.callbacks.LossScaleMonitor (checks "
        "every `update_freq` batches), call `optimizer.host_check()` in a custom loop, or compile with "
        "jit_compile=False.", AmpWarning, stacklevel=3)
    return True

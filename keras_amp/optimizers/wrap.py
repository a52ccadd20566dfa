"""`wrap()`: put an optimizer under keras_amp's loss scaling when the policy computes in float16."""

from __future__ import annotations

import inspect
import warnings

import keras

from keras_amp import _compat, validation
from keras_amp.optimizers import settings as lso_settings
from keras_amp.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras_amp.policy import AmpWarning

# Stock Keras LossScaleOptimizer defaults: values equal to these are not carried over on
# conversion, so the tier's values apply instead.
_STOCK_DEFAULTS = {"initial_scale": 2.0**15, "dynamic_growth_steps": 2000}
# What **kwargs may hold: LossScaleOptimizer's own arguments.
_WRAP_KWARGS = tuple(p for p in inspect.signature(LossScaleOptimizer.__init__).parameters
                     if p not in ("self", "inner_optimizer", "tier", "kwargs"))


def wrap(optimizer, tier: str | None = "auto", *, force: bool = False,
         **kwargs) -> keras.optimizers.Optimizer:
    """Returns `optimizer` wrapped in `keras_amp.LossScaleOptimizer` under a float16 policy.

    Idempotent: a keras_amp `LossScaleOptimizer` is returned as it is. A stock Keras
    `LossScaleOptimizer` is converted (its inner optimizer is rewrapped, non-default
    `initial_scale` / `dynamic_growth_steps` carried over) if it is not built yet; a built one
    is refused, since its state would be lost. On a Keras whose private surface keras_amp's
    optimizer does not match (`keras_amp._compat`, feature `LSO`), it warns once and wraps in
    stock Keras's `LossScaleOptimizer` instead. Under a policy that does not compute in float16
    (mixed_bfloat16, float32) the optimizer is returned unchanged: loss scaling only guards
    float16's narrow exponent range. `force=True` wraps anyway and warns with `AmpWarning`.
    Every argument is validated under every policy.

    Args:
        optimizer: A `keras.optimizers.Optimizer`, or a name/config `keras.optimizers.get`
            accepts.
        tier: None, "small", "medium", "large" or "auto". Defaults to "auto".
        force: Bool. Wrap even when the global policy does not compute in float16.
        **kwargs: Further `LossScaleOptimizer` arguments (`min_scale`, `hysteresis`, ...).

    Example:

    ```python
    keras_amp.enable()
    model.compile(optimizer=keras_amp.wrap(keras.optimizers.Adam()), loss="mse")
    ```
    """
    validation.check_type("optimizer", optimizer, (keras.optimizers.Optimizer, str, dict),
                          "a keras.optimizers.Optimizer, an optimizer name or a config dict")
    force = validation.check_bool("force", force)
    validation.check_no_extra_kwargs("wrap()", kwargs, _WRAP_KWARGS)
    lso_settings.check_arguments(tier=tier, **kwargs)
    if isinstance(optimizer, LossScaleOptimizer):
        explicit_tier = tier not in (None, "auto") and tier not in (optimizer.tier, optimizer.resolved_tier)
        if kwargs or explicit_tier:
            ignored = sorted(kwargs) + (["tier"] if explicit_tier else [])
            warnings.warn(
                f"keras_amp.wrap: {optimizer.name!r} is already a keras_amp LossScaleOptimizer and is "
                f"returned unchanged; ignored: {', '.join(ignored)}. Build a new LossScaleOptimizer "
                "to change its settings.", AmpWarning, stacklevel=2)
        return optimizer
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except (ValueError, KeyError, TypeError) as error:  # Keras: KeyError for a dict without class_name
            raise ValueError(f"`optimizer` is not a known optimizer. Received: optimizer={optimizer!r}") from error
    policy = keras.config.dtype_policy()
    if policy.compute_dtype != "float16":
        if not force:
            return optimizer
        warnings.warn(
            f"keras_amp.wrap(force=True) under the {policy.name!r} policy: loss scaling adds "
            "work and only helps float16 compute; bfloat16 and float32 do not need it.",
            AmpWarning, stacklevel=2)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if optimizer.built:
            raise ValueError(
                "Cannot convert a built stock keras.optimizers.LossScaleOptimizer: its loss "
                "scale and inner optimizer state would be lost. Wrap the inner optimizer before "
                "training instead. Received: optimizer="
                f"{optimizer.name!r} (built=True), allowed: an unbuilt optimizer")
        for key, default in _STOCK_DEFAULTS.items():
            value = getattr(optimizer, key)
            if value != default:
                kwargs.setdefault(key, value)
        kwargs.setdefault("name", optimizer.name)
        try:  # the carried-over values against `tier`: here, not inside the first `fit` step
            lso_settings.check_arguments(tier=tier, **kwargs)
        except ValueError as error:
            raise ValueError(
                f"{error}. The values come from the stock LossScaleOptimizer {optimizer.name!r} (stock has no "
                "bounds); wrap it with tier=None (bounds [1, 2**24]) or pass `min_scale`/`max_scale`") from error
        optimizer = optimizer.inner_optimizer
    if not _compat.warn_off(_compat.LSO):  # stock loss scaling, without the floor or the counters
        stock = {k: kwargs[k] for k in ("initial_scale", "dynamic_growth_steps", "name") if k in kwargs}
        return keras.optimizers.LossScaleOptimizer(optimizer, **stock)
    return LossScaleOptimizer(optimizer, tier=tier, **kwargs)

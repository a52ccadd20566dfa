"""`keras_amp.enable()` / `keras_amp.disable()`: the process's precision state, in plain calls.

`policy.enable` owns the dtype policy, TF32 and the config; this module adds the state that
follows the config, passed to it explicitly, so that nothing is installed by importing a module:

- the op rules (`op_rules.installer.sync`): installed under a 16-bit compute dtype, removed by
  `disable()` and under float32;
- the memory hooks (`memory.hooks.sync`): `fit`/`evaluate`/`predict` store frozen weights in
  16 bits (`keras_amp.memory.prepare`); removed by `disable()`;
- the multi-worker fit fix (`keras_amp.distribute.multi_worker()` installs it): removed by
  `disable()`.

All of it is applied or rolled back together (`policy.enable`). Call both from the main thread
(`policy`'s thread rule).
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from keras_amp import hardware
from keras_amp import policy as amp_policy
from keras_amp.distribute import trainer_fix
from keras_amp.memory import hooks as memory_hooks
from keras_amp.op_rules import installer


def _fit_fix(config: amp_policy.AmpConfig | None) -> None:
    if config is None:
        trainer_fix.uninstall_fit_fix()


FOLLOWERS = (installer.sync, memory_hooks.sync, _fit_fix)


def enable(policy: str = amp_policy.AUTO, *, tf32: bool | None = None,
           device: hardware.DeviceInfo | None = None, xla_scores: bool = True,
           frozen_weights: str = "compute") -> amp_policy.AmpConfig:
    with warnings.catch_warnings(record=True) as caught:  # said again below, at the caller's line
        warnings.simplefilter("always")
        config = amp_policy.enable(policy, tf32=tf32, device=device, xla_scores=xla_scores,
                                   frozen_weights=frozen_weights, followers=FOLLOWERS)
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=2)
    return config


def config() -> amp_policy.AmpConfig:
    """The `AmpConfig` in force; when keras_amp is not enabled (before `enable()`, after
    `disable()`), one with `enabled=False` describing Keras's global dtype policy, so
    `config().compute_dtype` is what layers built now compute in, either way."""
    current = amp_policy.config()
    return current if current is not None else off_config()


def disable() -> None:
    amp_policy.disable(FOLLOWERS)


enable.__doc__ = amp_policy.enable.__doc__.replace(
    """        followers: Tuple of callables, each called with the new `AmpConfig` inside the same
            all-or-nothing step (`keras_amp.enable()` passes the op rules' installer).
""", "") + """
    Also installs keras_amp's op rules under a 16-bit compute dtype (removed under float32).
    Call from the main thread: another thread gets RuntimeError (Keras's policy is per thread).
    """
disable.__doc__ = """Restores exactly what `enable()` changed (dtype policy, TF32), removes the op rules and the
    multi-worker fit fix; a no-op when not enabled. Call from the main thread."""


def off_config() -> amp_policy.AmpConfig:
    """An `AmpConfig` with `enabled=False` describing Keras's global dtype policy as it is now."""
    current = keras.config.dtype_policy()
    return amp_policy.AmpConfig(
        policy=current.name, compute_dtype=current.compute_dtype, variable_dtype=current.variable_dtype,
        loss_scaling=current.compute_dtype == "float16",
        tf32=tf.config.experimental.tensor_float_32_execution_enabled(),
        device="not detected (keras_amp is not enabled)", requested="off",
        reason="keras_amp is not enabled: Keras's global dtype policy", enabled=False)

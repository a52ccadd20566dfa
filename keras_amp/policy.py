"""`enable()` / `config()` / `disable()`: the one owner of keras_amp's global precision state.

Nothing else in keras_amp writes Keras's global dtype policy or TensorFlow's TF32 flag. State
of its own that follows the config (the op rules) is put in line by the `followers` the caller
passes: `keras_amp.enable()` / `disable()` (`keras_amp/state.py`) pass the op rules' installer
in a plain call, and nothing registers itself at import. `enable()` and `disable()` apply the
policy, TF32 and every follower all or nothing, so `config()` always describes what is in force.

Threads: Keras keeps its dtype policy per thread, keras_amp's config and op rules per process,
so both are set from the main thread only; `enable()` / `disable()` from another thread raise
`RuntimeError`. Build models in the main thread after `enable()` (a model built in another
thread gets that thread's policy, float32 unless it set one). `AmpConfig` records it; its
`fingerprint()` is the single definition of "precision settings that must match on every
worker" (compared by `keras_amp.distribute`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import warnings
from typing import Any, Callable, Optional

import keras
import tensorflow as tf
from absl import logging

from keras_amp import hardware, validation

AUTO = "auto"
POLICY_NAMES = ("mixed_float16", "mixed_bfloat16", "float32")
FROZEN_WEIGHTS = ("compute", "float32")
_ALLOWED = (AUTO,) + POLICY_NAMES


class AmpWarning(UserWarning):
    """A keras_amp setting will work but is slower or riskier than an alternative."""


@dataclasses.dataclass(frozen=True)
class AmpConfig:
    """The precision settings in force, as set by `keras_amp.enable()`.

    Args:
        policy: String. Keras dtype policy name ("mixed_float16", "mixed_bfloat16", "float32").
        compute_dtype: String. dtype layers compute in.
        variable_dtype: String. dtype of layer variables (always "float32" here).
        loss_scaling: Bool. Whether training needs loss scaling (float16 compute).
        tf32: Bool. Whether TensorFloat-32 execution is enabled in TensorFlow.
        device: String. One-line summary of the hardware the choice was made for.
        requested: String. What the caller asked for ("auto" or a policy name).
        reason: String. Why this policy was chosen.
        xla_scores: Bool, default True. Whether keras_amp's float32 kernels are XLA computations:
            the attention scores' QK^T forward as a 16-bit matmul with float32 accumulation (the
            16-bit matmul's speed) rather than a float32 matmul, and the sparse cross-entropy as
            one computation each way from the 16-bit logits. The numbers are the same to float32
            rounding; XLA's compiler costs about 70 MiB of fixed process memory on a CPU.
        frozen_weights: String, "compute" (default) or "float32" (see `keras_amp.memory`).
        enabled: Bool, default True; False in `keras_amp.config()` while keras_amp is off.
    """

    policy: str
    compute_dtype: str
    variable_dtype: str
    loss_scaling: bool
    tf32: bool
    device: str
    requested: str
    reason: str
    xla_scores: bool = True
    frozen_weights: str = "compute"
    enabled: bool = True

    def __post_init__(self):
        for name in ("policy", "compute_dtype", "variable_dtype", "device", "requested", "reason"):
            validation.check_type(name, getattr(self, name), str, "a string")
        for name in ("loss_scaling", "tf32", "xla_scores", "enabled"):
            object.__setattr__(self, name, validation.check_bool(name, getattr(self, name)))
        validation.check_choice("frozen_weights", self.frozen_weights, FROZEN_WEIGHTS)
        try:
            expected = keras.DTypePolicy(self.policy)
        except ValueError as error:
            raise ValueError(
                "`policy` must be a Keras dtype policy name, e.g. one of "
                f"{', '.join(POLICY_NAMES)}. Received: policy={self.policy!r}"
            ) from error
        derived = {
            "compute_dtype": expected.compute_dtype,
            "variable_dtype": expected.variable_dtype,
            "loss_scaling": expected.compute_dtype == "float16",
        }
        for name, value in derived.items():
            if getattr(self, name) != value:
                raise ValueError(
                    f"`{name}` must match policy {self.policy!r}: {value!r}. "
                    f"Received: {name}={getattr(self, name)!r}"
                )

    def fingerprint_fields(self, *, layers: Any = None, optimizer: Any = None) -> dict[str, str]:
        """Settings that must be identical on every replica and worker, by name.

        The device summary and the reason are left out: workers may legitimately run on
        different hardware as long as they run the same settings. `layers`: the model's
        `(path, layer)` pairs as `keras_amp.model_graph.walk(model)` yields them (the one layer
        list the recipes and the plan use too); their dtype policies become a field.
        """
        if optimizer is not None:
            validation.check_type("optimizer", optimizer, keras.optimizers.Optimizer,
                                  "a keras.optimizers.Optimizer or None")
        if layers is not None:
            layers = validation.check_pairs("layers", layers, (str, keras.layers.Layer),
                                            "(path, layer) pairs, e.g. keras_amp.model_graph.walk(model)")
        fields = {
            "policy": self.policy,
            "compute_dtype": self.compute_dtype,
            "variable_dtype": self.variable_dtype,
            "loss_scaling": str(self.loss_scaling),
            "tf32": str(self.tf32),
            "xla_scores": str(self.xla_scores),
            "frozen_weights": self.frozen_weights,
            "tensorflow": ".".join(tf.__version__.split(".")[:2]),
            "keras": ".".join(keras.__version__.split(".")[:2]),
        }
        if optimizer is not None:
            fields["loss_scale"] = _loss_scale_description(optimizer)
        if layers is not None:
            fields["layer_policies"] = json.dumps([(path, layer.dtype_policy.name) for path, layer in layers])
        return fields

    def fingerprint(self, *, layers: Any = None, optimizer: Any = None) -> str:
        """A stable hex digest of `fingerprint_fields()`."""
        return digest(self.fingerprint_fields(layers=layers, optimizer=optimizer))


def digest(fields: dict[str, str]) -> str:
    """sha256 of a canonical JSON encoding (key order does not matter)."""
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def _loss_scale_description(optimizer: Any) -> str:
    """Class and scaling settings of a loss-scale optimizer; 'none' for any other optimizer."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return "none"
    config = {k: v for k, v in optimizer.get_config().items() if k not in ("name", "inner_optimizer")}
    cls = type(optimizer)
    return json.dumps({"class": f"{cls.__module__}.{cls.__qualname__}", **config}, sort_keys=True, default=str)


@dataclasses.dataclass(frozen=True)
class _Saved:
    """What enable() changed, to restore on disable()."""

    policy: keras.DTypePolicy
    tf32: bool | None  # None: enable() never set TF32, so disable() leaves it alone.


Follower = Callable[[Optional[AmpConfig]], None]

_lock = threading.RLock()
_config: AmpConfig | None = None
_saved: _Saved | None = None


def _check_followers(followers: Any) -> tuple[Follower, ...]:
    validation.check_type("followers", followers, (tuple, list), "a tuple of callables")
    for i, fn in enumerate(followers):
        validation.check_callable(f"followers[{i}]", fn)
    return tuple(followers)


def _check_main_thread(call: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"keras_amp.{call}() must be called from the main thread: Keras keeps the dtype policy "
            "per thread while keras_amp's config and op rules are per process, so a call from "
            f"another thread would leave the two disagreeing. Received: a call from thread "
            f"{threading.current_thread().name!r}. Call it from the main thread, before building "
            "the model there.")


def _current_tf32() -> bool:
    return bool(tf.config.experimental.tensor_float_32_execution_enabled())


def _apply(new: AmpConfig | None, policy: keras.DTypePolicy | str, tf32: bool | None, saved: _Saved | None,
           followers: tuple[Follower, ...]) -> None:
    """Puts `new` in force (policy, TF32, followers), or nothing at all. Call with `_lock` held.

    A follower that raises makes the call fail as a whole: the previous policy, TF32 setting and
    config are restored, every follower already called is called again with the previous config
    (a failure there is noted on the first error), and the error propagates."""
    global _config, _saved
    old_policy, old_tf32, old_config = keras.config.dtype_policy(), _current_tf32(), _config
    called: list[Follower] = []
    try:
        if tf32 is not None:
            tf.config.experimental.enable_tensor_float_32_execution(tf32)
        keras.config.set_dtype_policy(policy)
        for fn in followers:
            called.append(fn)  # before the call: a follower that raises may have half-applied.
            fn(new)
    except BaseException as error:
        keras.config.set_dtype_policy(old_policy)
        tf.config.experimental.enable_tensor_float_32_execution(old_tf32)
        for fn in called:
            try:
                fn(old_config)
            except Exception as rollback_error:  # noqa: BLE001 - the first error is the one to raise
                logging.error("keras_amp: follower %r failed while rolling back: %s", fn, rollback_error)
                error.add_note(f"keras_amp: rolling back follower {fn!r} also failed: {rollback_error!r}")
        raise
    _config, _saved = new, saved


def choose_policy(device: hardware.DeviceInfo) -> tuple[str, str]:
    """The fastest safe policy for `device`, and why. The "auto" rule:

        GPU, weakest compute capability >= 8.0, or TPU  -> mixed_bfloat16
        GPU, weakest compute capability 7.x             -> mixed_float16 (needs loss scaling)
        CPU with AVX512-BF16 or AMX and oneDNN on       -> mixed_bfloat16
        the same CPU, oneDNN off or unknown             -> float32 (the reason says which)
        anything else                                   -> float32 (mixed would be slower)
    """
    cap = device.min_compute_capability
    if device.tpu_count:
        return "mixed_bfloat16", "TPUs compute bfloat16 natively"
    if device.gpus:
        if cap is None:
            return "float32", (
                "the GPU's compute capability is unknown, so there is no evidence of tensor cores; "
                "mixed precision could be slower than float32"
            )
        cc = f"{cap[0]}.{cap[1]}"
        if cap >= (8, 0):
            return "mixed_bfloat16", f"GPU compute capability {cc} >= 8.0 has bfloat16 tensor cores"
        if cap >= (7, 0):
            return "mixed_float16", (
                f"GPU compute capability {cc} has float16 tensor cores but no fast bfloat16"
            )
        return "float32", (
            f"GPU compute capability {cc} < 7.0 has no tensor cores: float16 matmuls would not be "
            "faster than float32 and add overflow risk"
        )
    if device.cpu_fast_bfloat16:
        flags = ", ".join(f for f in hardware.BF16_CPU_FLAGS if f in device.cpu_flags)
        return "mixed_bfloat16", f"the CPU has {flags} and oneDNN is on: bfloat16 matmuls/convs run natively"
    if device.cpu_has_bfloat16 and device.onednn_isa_below_bfloat16:
        return "float32", (f"the CPU has bfloat16 instructions, but oneDNN is capped at {device.onednn_max_isa} "
                           "(ONEDNN_MAX_CPU_ISA), below its bfloat16 kernels")
    if device.cpu_has_bfloat16 and device.onednn_enabled is None:
        return "float32", (
            f"the CPU has bfloat16 instructions, but this TensorFlow build lacks {hardware.ONEDNN_QUERY}, "
            "so whether oneDNN runs bfloat16 natively is unknown; enable('mixed_bfloat16') explicitly if "
            "it does"
        )
    if device.cpu_has_bfloat16:
        return "float32", (
            "the CPU has bfloat16 instructions but oneDNN is off (TF_ENABLE_ONEDNN_OPTS=0), so "
            "bfloat16 ops are emulated and slower than float32"
        )
    return "float32", (
        "no GPU/TPU and the CPU lacks AVX512-BF16/AMX: float16 and bfloat16 ops are emulated there "
        "and run slower than float32"
    )


def _resolve_policy_arg(policy: Any) -> str:
    if isinstance(policy, keras.DTypePolicy):
        name = policy.name
        if type(policy) is not keras.DTypePolicy or name not in POLICY_NAMES:
            raise ValueError(
                "`policy` must be one of the float policies "
                f"{', '.join(POLICY_NAMES)} (a string or a keras.DTypePolicy). "
                f"Received: policy={policy!r}"
            )
        return name
    if not isinstance(policy, str):
        raise TypeError(
            "`policy` must be a string or a keras.DTypePolicy. "
            f"Received: policy={policy!r} of type {type(policy).__name__}. "
            f"Allowed strings: {', '.join(_ALLOWED)}"
        )
    if policy not in _ALLOWED:
        raise ValueError(
            f"Unknown `policy`. Received: policy={policy!r}. Allowed: {', '.join(_ALLOWED)}"
        )
    return policy


def _speed_warning(name: str, device: hardware.DeviceInfo) -> str | None:
    """A reason the explicitly requested policy is slower than an alternative, or None."""
    best, _ = choose_policy(device)
    if name == "mixed_float16" and not device.fast_float16:
        return (f"mixed_float16 requested on {device.summary()}, which has no fast float16 path "
                f"(float16 is emulated and typically slower than float32). Faster here: {best!r}.")
    if name == "mixed_bfloat16" and not device.fast_bfloat16:
        dies = " (under this cap TensorFlow's first bfloat16 matmul kills the process)"
        head = f"mixed_bfloat16 requested on {device.summary()}, which has no fast bfloat16 path"
        if best != "float32" or device.onednn_aborts_bfloat16:
            return f"{head}{dies if device.onednn_aborts_bfloat16 else ''}. Faster here: {best!r}."
        # Emulated: keras_amp's float32 kernels bring a step near float32's, by model (BUILD_NOTES).
        return (f"{head}: its bfloat16 kernels are emulated, so expect a step time near float32's (slower for "
                "RNNs, faster for some Transformers) and a smaller memory footprint; 'auto' picks 'float32' here.")
    return None


def enable(
    policy: str | keras.DTypePolicy = AUTO,
    *,
    tf32: bool | None = None,
    device: hardware.DeviceInfo | None = None,
    xla_scores: bool = True,
    frozen_weights: str = "compute",
    followers: tuple = (),
) -> AmpConfig:
    """Sets the global precision policy (and optionally TF32) before a model is built.

    Args:
        policy: String or `keras.DTypePolicy`. "auto" (default) picks by hardware, see
            `choose_policy`; or one of "mixed_float16", "mixed_bfloat16", "float32".
        tf32: Bool or None. None (default) leaves TensorFlow's TF32 setting alone;
            True/False enables/disables TensorFloat-32 execution.
        device: `hardware.DeviceInfo` or None. The hardware to decide for; None detects this
            machine's (tests and planning for another machine pass one).
        xla_scores: Bool, default True. Float32 attention scores (MultiHeadAttention and the
            QK^T rule, see `keras_amp.op_rules`) compute the QK^T forward as an XLA-compiled
            16-bit matmul with float32 accumulation and result: exact float32 logits at the
            16-bit matmul's speed (about 70 MiB of fixed XLA memory on a CPU); False computes it
            as a float32 matmul (same logits, slower).
        frozen_weights: String, "compute" (default): frozen weights (`enable_lora`) are stored in
            the dtype their layer reads them in; "float32" keeps them (see `keras_amp.memory`).
        followers: Tuple of callables, each called with the new `AmpConfig` inside the same
            all-or-nothing step (`keras_amp.enable()` passes the op rules' installer).

    Returns:
        The `AmpConfig` now in force. Calling `enable()` again replaces it; `disable()`
        restores the state from before the first call.

    Example:
        >>> config = keras_amp.enable()          # mixed_bfloat16 on a bf16-capable CPU/GPU
        >>> model = build_model()                # layers compute in config.compute_dtype
    """
    _check_main_thread("enable")
    followers = _check_followers(followers)
    requested = _resolve_policy_arg(policy)
    if tf32 is not None:
        tf32 = validation.check_bool("tf32", tf32)
    xla_scores = validation.check_bool("xla_scores", xla_scores)
    validation.check_type("device", device, (hardware.DeviceInfo, type(None)), "a keras_amp.hardware.DeviceInfo or None")
    # Everything that can fail runs before any global is written.
    device = device if device is not None else hardware.detect()
    if requested == AUTO:
        name, reason = choose_policy(device)
        warning = f"keras_amp 'auto' chose float32: {reason}." if name == "float32" else None
    else:
        name, reason = requested, "requested explicitly"
        warning = _speed_warning(name, device)
    dtype_policy = keras.DTypePolicy(name)
    summary = device.summary()

    with _lock:
        saved = _saved or _Saved(policy=keras.config.dtype_policy(), tf32=None)
        if tf32 is not None and saved.tf32 is None:
            saved = _Saved(policy=saved.policy, tf32=_current_tf32())
        new = AmpConfig(
            policy=name,
            compute_dtype=dtype_policy.compute_dtype,
            variable_dtype=dtype_policy.variable_dtype,
            loss_scaling=dtype_policy.compute_dtype == "float16",
            tf32=_current_tf32() if tf32 is None else tf32,
            device=summary,
            requested=requested,
            reason=reason,
            xla_scores=xla_scores,
            frozen_weights=frozen_weights,
        )
        _apply(new, name, tf32, saved, followers)
    if warning:
        warnings.warn(warning, AmpWarning, stacklevel=2)
    logging.info("keras_amp: policy %s (%s); tf32=%s; %s", name, reason, new.tf32, new.device)
    return new


def config() -> AmpConfig | None:
    """The `AmpConfig` in force, or None when off (the public `keras_amp.config()` says "off")."""
    return _config


def disable(followers: tuple = ()) -> None:
    """Restores exactly what `enable()` changed (dtype policy, TF32), calling each of `followers`
    with None in the same all-or-nothing step; a no-op when not enabled."""
    _check_main_thread("disable")
    followers = _check_followers(followers)
    with _lock:
        if _saved is None:
            return
        _apply(None, _saved.policy, _saved.tf32, None, followers)

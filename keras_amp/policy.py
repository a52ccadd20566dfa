"""`enable()` / `config()` / `disable()`: the one owner of keras_amp's global precision state.

Nothing else in keras_amp writes Keras's global dtype policy or TensorFlow's TF32 flag.
`AmpConfig` records what is in force; its `fingerprint()` is the single definition of
"precision settings that must match on every worker" (compared by `keras_amp.distribute`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import warnings
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from keras_amp import hardware

AUTO = "auto"
POLICY_NAMES = ("mixed_float16", "mixed_bfloat16", "float32")
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
    """

    policy: str
    compute_dtype: str
    variable_dtype: str
    loss_scaling: bool
    tf32: bool
    device: str
    requested: str
    reason: str

    def fingerprint_fields(self, *, model: Any = None, optimizer: Any = None) -> dict[str, str]:
        """Settings that must be identical on every replica and worker, by name.

        The device summary and the reason are left out: workers may legitimately run on
        different hardware as long as they run the same settings.
        """
        fields = {
            "policy": self.policy,
            "compute_dtype": self.compute_dtype,
            "variable_dtype": self.variable_dtype,
            "loss_scaling": str(self.loss_scaling),
            "tf32": str(self.tf32),
            "tensorflow": ".".join(tf.__version__.split(".")[:2]),
            "keras": ".".join(keras.__version__.split(".")[:2]),
        }
        if optimizer is not None:
            fields["loss_scale"] = _loss_scale_description(optimizer)
        if model is not None:
            fields["layer_policies"] = _layer_policies_description(model)
        return fields

    def fingerprint(self, *, model: Any = None, optimizer: Any = None) -> str:
        """A stable hex digest of `fingerprint_fields()`."""
        return digest(self.fingerprint_fields(model=model, optimizer=optimizer))


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


def _layer_policies_description(model: Any) -> str:
    """Every layer's path and dtype policy name, in model order."""
    layers = model._flatten_layers(include_self=False, recursive=True)  # Keras 3.15 API, also used by summary()
    return json.dumps([(layer.path, layer.dtype_policy.name) for layer in layers])


@dataclasses.dataclass
class _Saved:
    """What enable() changed, to restore on disable()."""

    policy: keras.DTypePolicy
    tf32: bool | None  # None: enable() never set TF32, so disable() leaves it alone.


_lock = threading.Lock()
_config: AmpConfig | None = None
_saved: _Saved | None = None


def choose_policy(device: hardware.DeviceInfo) -> tuple[str, str]:
    """The fastest safe policy for `device`, and why. The "auto" rule:

        GPU, weakest compute capability >= 8.0, or TPU  -> mixed_bfloat16
        GPU, weakest compute capability 7.x             -> mixed_float16 (needs loss scaling)
        CPU with AVX512-BF16 or AMX and oneDNN on       -> mixed_bfloat16
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
    if any(f in device.cpu_flags for f in hardware.BF16_CPU_FLAGS):
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
        return (
            f"mixed_float16 requested on {device.summary()}, which has no fast float16 path "
            f"(float16 is emulated and typically slower than float32). Faster here: {best!r}."
        )
    if name == "mixed_bfloat16" and not device.fast_bfloat16:
        return (
            f"mixed_bfloat16 requested on {device.summary()}, which has no fast bfloat16 path. "
            f"Faster here: {best!r}."
        )
    return None


def enable(
    policy: str | keras.DTypePolicy = AUTO,
    *,
    tf32: bool | None = None,
    device: hardware.DeviceInfo | None = None,
) -> AmpConfig:
    """Sets the global precision policy (and optionally TF32) before a model is built.

    Args:
        policy: String or `keras.DTypePolicy`. "auto" (default) picks by hardware, see
            `choose_policy`; or one of "mixed_float16", "mixed_bfloat16", "float32".
        tf32: Bool or None. None (default) leaves TensorFlow's TF32 setting alone;
            True/False enables/disables TensorFloat-32 execution.
        device: `hardware.DeviceInfo` or None. The hardware to decide for; None detects this
            machine's (tests and planning for another machine pass one).

    Returns:
        The `AmpConfig` now in force. Calling `enable()` again replaces it; `disable()`
        restores the state from before the first call.

    Example:
        >>> config = keras_amp.enable()          # mixed_bfloat16 on a bf16-capable CPU/GPU
        >>> model = build_model()                # layers compute in config.compute_dtype
    """
    global _config, _saved
    requested = _resolve_policy_arg(policy)
    if tf32 is not None and not isinstance(tf32, bool):
        raise TypeError(f"`tf32` must be None, True or False. Received: tf32={tf32!r}")
    if device is not None and not isinstance(device, hardware.DeviceInfo):
        raise TypeError(
            "`device` must be a keras_amp.hardware.DeviceInfo or None. "
            f"Received: device={device!r} of type {type(device).__name__}"
        )
    device = device if device is not None else hardware.detect()

    if requested == AUTO:
        name, reason = choose_policy(device)
        if name == "float32":
            warnings.warn(f"keras_amp 'auto' chose float32: {reason}.", AmpWarning, stacklevel=2)
    else:
        name, reason = requested, "requested explicitly"
        slower = _speed_warning(name, device)
        if slower:
            warnings.warn(slower, AmpWarning, stacklevel=2)

    with _lock:
        if _saved is None:
            _saved = _Saved(policy=keras.config.dtype_policy(), tf32=None)
        if tf32 is not None:
            if _saved.tf32 is None:
                _saved.tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
            tf.config.experimental.enable_tensor_float_32_execution(tf32)
        keras.config.set_dtype_policy(name)
        dtype_policy = keras.config.dtype_policy()
        _config = AmpConfig(
            policy=name,
            compute_dtype=dtype_policy.compute_dtype,
            variable_dtype=dtype_policy.variable_dtype,
            loss_scaling=dtype_policy.compute_dtype == "float16",
            tf32=bool(tf.config.experimental.tensor_float_32_execution_enabled()),
            device=device.summary(),
            requested=requested,
            reason=reason,
        )
    logging.info("keras_amp: policy %s (%s); tf32=%s; %s", name, reason, _config.tf32, _config.device)
    return _config


def config() -> AmpConfig | None:
    """The `AmpConfig` in force, or None when keras_amp is not enabled."""
    return _config


def disable() -> None:
    """Restores exactly what `enable()` changed (dtype policy, TF32); a no-op when not enabled."""
    global _config, _saved
    with _lock:
        if _saved is None:
            return
        keras.config.set_dtype_policy(_saved.policy)
        if _saved.tf32 is not None:
            tf.config.experimental.enable_tensor_float_32_execution(_saved.tf32)
        _config, _saved = None, None


# Every Keras convolution class: the heavy layers below, and the recipes' "convs in the compute
# dtype" role (recipes.py and check.py import this one list).
CONV_LAYERS = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)
# Layer types whose compute dtype decides mixed-precision speed; a model whose every such
# layer disagrees with the policy in force was almost certainly built before enable().
_HEAVY_LAYERS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Embedding,
    keras.layers.MultiHeadAttention,
) + CONV_LAYERS


def warn_if_built_before_enable(model: Any, *, caller: str = "keras_amp") -> bool:
    """Warns (and returns True) when `model`'s heavy layers all use another policy than the one in force."""
    if _config is None or not hasattr(model, "_flatten_layers"):
        return False
    # Deliberate float32 is not staleness: apply_recipe's output (`_keras_amp_recipe`) and
    # keras_amp's float32 islands (OutputHead, Float32 and the layers it wraps) are skipped.
    if getattr(model, "_keras_amp_recipe", None) is not None:
        return False
    heavy = [
        l for l in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(l, _HEAVY_LAYERS) and not getattr(l, "_keras_amp_float32_island", False)
    ]
    stale = [l for l in heavy if l.dtype_policy.name != _config.policy]
    if heavy and len(stale) == len(heavy):
        found = sorted({l.dtype_policy.name for l in stale})
        warnings.warn(
            f"{caller}: every Dense/Conv/Embedding/attention layer of model "
            f"{getattr(model, 'name', model)!r} computes in {', '.join(found)}, none in "
            f"keras_amp.enable()'s {_config.policy!r}: it was probably built before enable() (or every "
            "heavy layer was pinned to another dtype), so mixed precision does nothing for it. "
            "Build the model after keras_amp.enable(), or convert it with keras_amp.apply_recipe().",
            AmpWarning,
            stacklevel=3,
        )
        return True
    return False

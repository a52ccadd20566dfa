"""Device capability: what the machine can do fast. Observes only; decides nothing.

`detect()` reads the devices TensorFlow sees, the CPU flags and whether oneDNN is on.
It lists *physical* devices only, so it never initialises the TensorFlow runtime:
logical-device configuration (used for multi-replica CPU tests) can still follow.
Tests build a `DeviceInfo` by hand to exercise every branch of policy selection.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform

from keras_amp import validation

# CPU flags that matter for low-precision speed on x86 (Linux /proc/cpuinfo names).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")
RELEVANT_CPU_FLAGS = BF16_CPU_FLAGS + FP16_CPU_FLAGS + ("avx512f", "amx_tile", "avx2", "fma", "f16c")


# The module TensorFlow 2.21 answers "built with oneDNN?" from; no public query exists.
ONEDNN_QUERY = "tensorflow.python.util._pywrap_util_port"


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One physical GPU: its name and CUDA compute capability (None if unknown).

    Args:
        name: String. The device name, e.g. "NVIDIA A100-SXM4-40GB".
        compute_capability: Tuple `(major, minor)` of ints >= 0, or None when unknown.
    """

    name: str
    compute_capability: tuple[int, int] | None = None

    def __post_init__(self):
        validation.check_type("name", self.name, str, "a string")
        cap = self.compute_capability
        if cap is None:
            return
        validation.check_type("compute_capability", cap, (tuple, list), "a (major, minor) tuple of ints or None")
        if len(cap) != 2:
            raise ValueError(
                "`compute_capability` must have 2 entries, (major, minor). "
                f"Received: compute_capability={cap!r}"
            )
        major = validation.check_int("compute_capability[0]", cap[0], min_value=0)
        minor = validation.check_int("compute_capability[1]", cap[1], min_value=0)
        object.__setattr__(self, "compute_capability", (major, minor))


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the machine offers for mixed precision.

    Args:
        gpus: Tuple (or list) of `GpuInfo`. Defaults to none.
        tpu_count: Int >= 0. TPU cores. Defaults to 0.
        cpu_model: String. Defaults to "".
        cpu_flags: Set of strings (any iterable of strings but a single string), e.g.
            {"avx512_bf16"}. Defaults to none.
        onednn_enabled: Bool, or None when this TensorFlow build cannot tell. Defaults to False.
    """

    gpus: tuple[GpuInfo, ...] = ()
    tpu_count: int = 0
    cpu_model: str = ""
    cpu_flags: frozenset[str] = frozenset()
    onednn_enabled: bool | None = False

    def __post_init__(self):
        validation.check_type("gpus", self.gpus, (tuple, list), "a tuple of keras_amp.hardware.GpuInfo")
        for i, gpu in enumerate(self.gpus):
            validation.check_type(f"gpus[{i}]", gpu, GpuInfo, "a keras_amp.hardware.GpuInfo")
        tpu_count = validation.check_int("tpu_count", self.tpu_count, min_value=0)
        validation.check_type("cpu_model", self.cpu_model, str, "a string")
        validation.check_type("cpu_flags", self.cpu_flags, (set, frozenset, tuple, list), "a set of strings")
        for flag in self.cpu_flags:
            validation.check_type("cpu_flags", flag, str, "a set of strings")
        onednn = None if self.onednn_enabled is None else validation.check_bool("onednn_enabled", self.onednn_enabled)
        object.__setattr__(self, "gpus", tuple(self.gpus))
        object.__setattr__(self, "tpu_count", tpu_count)
        object.__setattr__(self, "cpu_flags", frozenset(self.cpu_flags))
        object.__setattr__(self, "onednn_enabled", onednn)

    @property
    def min_compute_capability(self) -> tuple[int, int] | None:
        """The weakest GPU decides: every replica must run the same policy."""
        caps = [g.compute_capability for g in self.gpus if g.compute_capability]
        return min(caps) if caps else None

    @property
    def cpu_fast_bfloat16(self) -> bool:
        """oneDNN runs bfloat16 matmuls/convs natively on AVX512-BF16 or AMX."""
        return self.onednn_enabled is True and any(f in self.cpu_flags for f in BF16_CPU_FLAGS)

    @property
    def fast_float16(self) -> bool:
        """Tensor cores (compute capability >= 7.0) are the only fast float16 path."""
        cap = self.min_compute_capability
        return cap is not None and cap >= (7, 0)

    @property
    def fast_bfloat16(self) -> bool:
        cap = self.min_compute_capability
        if self.tpu_count:
            return True
        if self.gpus:
            return cap is not None and cap >= (8, 0)
        return self.cpu_fast_bfloat16

    def summary(self) -> str:
        """One line, e.g. 'CPU (AMD ...; avx512_bf16; oneDNN on)'."""
        if self.tpu_count:
            return f"{self.tpu_count} TPU core(s)"
        if self.gpus:
            parts = []
            for gpu in self.gpus:
                cap = gpu.compute_capability
                cc = f"{cap[0]}.{cap[1]}" if cap else "unknown"
                parts.append(f"{gpu.name} (compute capability {cc})")
            return f"{len(self.gpus)} GPU(s): " + ", ".join(parts)
        flags = ",".join(sorted(f for f in self.cpu_flags if f in BF16_CPU_FLAGS + FP16_CPU_FLAGS))
        onednn = {True: "oneDNN on", False: "oneDNN off", None: "oneDNN unknown"}[self.onednn_enabled]
        return f"CPU ({self.cpu_model or 'unknown model'}; {flags or 'no bf16/fp16 flags'}; {onednn})"


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """Model name and the relevant flags from a Linux cpuinfo file; empty elsewhere."""
    model, flags = "", frozenset()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split()) & frozenset(RELEVANT_CPU_FLAGS)
    return model or platform.processor(), flags


def onednn_enabled() -> bool | None:
    """True when TensorFlow was built with oneDNN and TF_ENABLE_ONEDNN_OPTS does not turn it off.

    None when this TensorFlow build lacks the query module (`ONEDNN_QUERY`): unknown, not off.
    """
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").strip().lower() in ("0", "false", "off"):
        return False
    try:
        query = importlib.import_module(ONEDNN_QUERY)
    except ImportError:
        return None
    return bool(query.IsMklEnabled())


def _gpu_infos() -> tuple[GpuInfo, ...]:
    import tensorflow as tf

    infos = []
    for device in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(device) or {}
        cap = details.get("compute_capability")
        infos.append(
            GpuInfo(name=str(details.get("device_name", device.name)), compute_capability=tuple(cap) if cap else None)
        )
    return tuple(infos)


def detect() -> DeviceInfo:
    """Observes this machine's devices without initialising the TensorFlow runtime."""
    import tensorflow as tf

    model, flags = read_cpuinfo()
    return DeviceInfo(
        gpus=_gpu_infos(),
        tpu_count=len(tf.config.list_physical_devices("TPU")),
        cpu_model=model,
        cpu_flags=flags,
        onednn_enabled=onednn_enabled(),
    )

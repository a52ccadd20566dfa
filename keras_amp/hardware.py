"""Device capability: what the machine can do fast. Observes only; decides nothing.

`detect()` reads the devices TensorFlow sees, the CPU flags and whether oneDNN is on.
It lists *physical* devices only, so it never initialises the TensorFlow runtime:
logical-device configuration (used for multi-replica CPU tests) can still follow.
Tests build a `DeviceInfo` by hand to exercise every branch of policy selection.
"""

from __future__ import annotations

import dataclasses
import os
import platform

# CPU flags that matter for low-precision speed on x86 (Linux /proc/cpuinfo names).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")
RELEVANT_CPU_FLAGS = BF16_CPU_FLAGS + FP16_CPU_FLAGS + ("avx512f", "amx_tile", "avx2", "fma", "f16c")


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One physical GPU: its name and CUDA compute capability (None if unknown)."""

    name: str
    compute_capability: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the machine offers for mixed precision."""

    gpus: tuple[GpuInfo, ...] = ()
    tpu_count: int = 0
    cpu_model: str = ""
    cpu_flags: frozenset[str] = frozenset()
    onednn_enabled: bool = False

    @property
    def min_compute_capability(self) -> tuple[int, int] | None:
        """The weakest GPU decides: every replica must run the same policy."""
        caps = [g.compute_capability for g in self.gpus if g.compute_capability]
        return min(caps) if caps else None

    @property
    def cpu_fast_bfloat16(self) -> bool:
        """oneDNN runs bfloat16 matmuls/convs natively on AVX512-BF16 or AMX."""
        return self.onednn_enabled and any(f in self.cpu_flags for f in BF16_CPU_FLAGS)

    @property
    def fast_float16(self) -> bool:
        """Tensor cores (compute capability >= 7.0) are the only measured fast float16 path."""
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
        onednn = "oneDNN on" if self.onednn_enabled else "oneDNN off"
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


def onednn_enabled() -> bool:
    """True when TensorFlow was built with oneDNN and TF_ENABLE_ONEDNN_OPTS does not turn it off."""
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").strip().lower() in ("0", "false", "off"):
        return False
    try:
        from tensorflow.python.util import _pywrap_util_port  # TF 2.21: no public query.
    except ImportError:  # pragma: no cover - depends on the TF build
        return False
    return bool(_pywrap_util_port.IsMklEnabled())


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

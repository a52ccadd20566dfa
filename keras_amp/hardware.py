"""Device capability: what the machine can do fast. Observes only; decides nothing.

`detect()` reads the devices TensorFlow sees, the CPU's name and flags and whether oneDNN is on.
It lists *physical* devices only, so it never initialises the TensorFlow runtime:
logical-device configuration (used for multi-replica CPU tests) can still follow.
Tests build a `DeviceInfo` by hand to exercise every branch of policy selection.

Where each fact comes from, asked in this order (`detect_cpu`):
- GPUs, TPUs and oneDNN: TensorFlow (`tf.config`, and its build's oneDNN query).
- CPU flags: TensorFlow 2.21 has no query for them (its CPU feature guard only logs the
  features its build does not use), so numpy's run-time dispatch is asked: numpy, which
  TensorFlow depends on, reads them from the CPU itself (cpuid) on Linux, macOS and Windows.
- CPU name: the operating system (sysctl on macOS, the registry on Windows).
- Last, Linux's /proc/cpuinfo: the CPU name there, and the flags numpy does not name (AMX).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import platform
import subprocess

from keras_amp import validation

# CPU flags that matter for low-precision speed on x86 (Linux /proc/cpuinfo names).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")
RELEVANT_CPU_FLAGS = BF16_CPU_FLAGS + FP16_CPU_FLAGS + ("avx512f", "amx_tile", "avx2", "fma", "f16c")


# numpy's names for them (`__cpu_features__`, detected at run time) -> the /proc/cpuinfo names used here.
NUMPY_FLAGS = {"AVX512BF16": "avx512_bf16", "AVX512FP16": "avx512_fp16", "AVX512F": "avx512f",
               "AVX2": "avx2", "FMA3": "fma", "F16C": "f16c"}
# Where numpy 2 (first) and numpy 1 keep that table.
NUMPY_CPU_QUERY = ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath")
# Linux's CPU description: read last.
CPUINFO = "/proc/cpuinfo"
# Windows keeps the CPU's name here (HKEY_LOCAL_MACHINE).
WINDOWS_CPU_KEY = r"HARDWARE\DESCRIPTION\System\CentralProcessor\0"

# The module TensorFlow 2.21 answers "built with oneDNN?" from; no public query exists.
ONEDNN_QUERY = "tensorflow.python.util._pywrap_util_port"
# oneDNN's instruction-set cap (its documented environment variables; the first set wins), and the
# caps below AVX512_CORE_BF16, where it has no native bfloat16 kernels: AVX512_CORE emulates them, and
# at AVX2_VNNI_2 and below TensorFlow 2.21 still sends bfloat16 matmuls to oneDNN, and the process dies
# (an abort, oneDNN cannot create the primitive, or a segmentation fault; tested).
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_ISAS_ABORTING_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")
ONEDNN_ISAS_BELOW_BF16 = ONEDNN_ISAS_ABORTING_BF16 + ("AVX512_CORE", "AVX512_CORE_VNNI")


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
        onednn_max_isa: String or None. oneDNN's instruction-set cap (`ONEDNN_MAX_CPU_ISA`), e.g.
            "AVX2"; None (the default) where none is set. Only the caps below AVX512_CORE_BF16
            (`ONEDNN_ISAS_BELOW_BF16`, any case) change what is fast.
    """

    gpus: tuple[GpuInfo, ...] = ()
    tpu_count: int = 0
    cpu_model: str = ""
    cpu_flags: frozenset[str] = frozenset()
    onednn_enabled: bool | None = False
    onednn_max_isa: str | None = None

    def __post_init__(self):
        validation.check_type("gpus", self.gpus, (tuple, list), "a tuple of keras_amp.hardware.GpuInfo")
        for i, gpu in enumerate(self.gpus):
            validation.check_type(f"gpus[{i}]", gpu, GpuInfo, "a keras_amp.hardware.GpuInfo")
        tpu_count = validation.check_int("tpu_count", self.tpu_count, min_value=0)
        validation.check_type("cpu_model", self.cpu_model, str, "a string")
        validation.check_type("onednn_max_isa", self.onednn_max_isa, (str, type(None)), "a string or None")
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
        return self.onednn_enabled is True and self.cpu_has_bfloat16 and not self.onednn_isa_below_bfloat16

    @property
    def cpu_has_bfloat16(self) -> bool:
        """The CPU has bfloat16 instructions (`BF16_CPU_FLAGS`), whatever oneDNN makes of them."""
        return any(f in self.cpu_flags for f in BF16_CPU_FLAGS)

    @property
    def onednn_isa_below_bfloat16(self) -> bool:
        """Whether `onednn_max_isa` keeps oneDNN below its bfloat16 kernels (`ONEDNN_ISAS_BELOW_BF16`)."""
        return self._isa_cap in ONEDNN_ISAS_BELOW_BF16

    @property
    def onednn_aborts_bfloat16(self) -> bool:
        """Whether a bfloat16 matmul would kill the process: a CPU with bfloat16 instructions (so TF sends
        bfloat16 to oneDNN), oneDNN on, and capped at AVX2_VNNI_2 or below (`ONEDNN_ISAS_ABORTING_BF16`)."""
        return self.onednn_enabled is True and self.cpu_has_bfloat16 and self._isa_cap in ONEDNN_ISAS_ABORTING_BF16

    @property
    def _isa_cap(self) -> str:
        return (self.onednn_max_isa or "").strip().upper()

    @property
    def fast_float16(self) -> bool:
        """Tensor cores (compute capability >= 7.0) are the only fast float16 path."""
        cap = self.min_compute_capability
        return cap is not None and cap >= (7, 0)

    def tensor_cores(self, dtype: str) -> bool:
        """Whether every GPU has tensor cores for `dtype` matmuls (float16: compute capability
        >= 7.0, bfloat16: >= 8.0), where dimensions that are multiples of 8 decide their use.
        False on a CPU or TPU, and for float32."""
        cap = self.min_compute_capability
        needed = {"float16": (7, 0), "bfloat16": (8, 0)}.get(str(dtype))
        return needed is not None and cap is not None and cap >= needed

    @property
    def xla_skips_fast_bfloat16(self) -> bool:
        """A CPU alone whose oneDNN runs bfloat16 natively: XLA's CPU code (`jit_compile=True`) does not
        use those kernels, so a compiled bfloat16 step loses them."""
        return not self.gpus and not self.tpu_count and self.cpu_fast_bfloat16

    def emulates(self, dtype: str) -> bool:
        """Whether this device runs `dtype` ("bfloat16" or "float16") matmuls and convolutions with Eigen's
        kernels: a CPU alone, without oneDNN's native bfloat16 for bfloat16, without float16
        instructions for float16. Eigen's 16-bit kernels are slower than its float32 ones."""
        validation.check_choice("dtype", dtype, ("bfloat16", "float16"))
        if self.gpus or self.tpu_count:
            return False
        if dtype == "float16":
            return not any(flag in self.cpu_flags for flag in FP16_CPU_FLAGS)
        return not self.cpu_fast_bfloat16

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
        if self.onednn_max_isa:
            onednn += f", capped at {self.onednn_max_isa}"
        return f"CPU ({self.cpu_model or 'unknown model'}; {flags or 'no bf16/fp16 flags'}; {onednn})"


def read_cpuinfo(path: str = CPUINFO) -> tuple[str, frozenset[str]]:
    """Model name (else `platform.processor()`) and the relevant flags from a Linux cpuinfo file;
    no flags where there is none."""
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


def numpy_cpu_flags() -> frozenset[str] | None:
    """The relevant CPU flags numpy detected at run time (on every OS); None where numpy has no table."""
    for name in NUMPY_CPU_QUERY:
        try:
            features = importlib.import_module(name).__cpu_features__
        except (ImportError, AttributeError):
            continue
        return frozenset(ours for theirs, ours in NUMPY_FLAGS.items() if features.get(theirs))
    return None


def platform_cpu_model() -> str:
    """The CPU's name from the operating system: sysctl on macOS, the registry on Windows; "" elsewhere."""
    system = platform.system()
    if system == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                 text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""
    if system == "Windows":
        try:
            import winreg

            with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, WINDOWS_CPU_KEY) as key:
                return str(winreg.QueryValueEx(key, "ProcessorNameString")[0]).strip()
        except (ImportError, OSError):
            return ""
    return ""


def detect_cpu(cpuinfo: str | None = None) -> tuple[str, frozenset[str]]:
    """(CPU name, relevant flags), asked in the module docstring's order; the cpuinfo file
    (`cpuinfo`, default `CPUINFO`) last.

    The flags are numpy's and the file's together (the file adds AMX); the name is the operating
    system's, else the file's, else `platform.processor()`.
    """
    file_model, file_flags = read_cpuinfo(CPUINFO if cpuinfo is None else cpuinfo)
    return platform_cpu_model() or file_model, (numpy_cpu_flags() or frozenset()) | file_flags


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


@functools.lru_cache(maxsize=None)
def emulated(dtype: str) -> bool:
    """`DeviceInfo.emulates(dtype)` for this machine's devices, observed once per dtype."""
    return detect().emulates(dtype)


def detect() -> DeviceInfo:
    """Observes this machine's devices without initialising the TensorFlow runtime."""
    import tensorflow as tf

    model, flags = detect_cpu()
    return DeviceInfo(
        gpus=_gpu_infos(),
        tpu_count=len(tf.config.list_physical_devices("TPU")),
        cpu_model=model,
        cpu_flags=flags,
        onednn_enabled=onednn_enabled(),
        onednn_max_isa=next((os.environ[name] for name in ONEDNN_ISA_ENV if os.environ.get(name)), None),
    )

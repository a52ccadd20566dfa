"""keras_amp.hardware: observation only, injectable."""

import os
import platform
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

from keras_amp import hardware, policy
from keras_amp.hardware import DeviceInfo, GpuInfo

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse avx2 fma avx512f avx512_bf16 f16c vaes

processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse avx2
"""


def test_read_cpuinfo_parses_model_and_relevant_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    model, flags = hardware.read_cpuinfo(str(path))
    assert model == "AMD EPYC 9R14 96-Core Processor"
    # Only flags that matter for low precision are kept, from the first processor.
    assert flags == frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "f16c"})


def test_read_cpuinfo_missing_file_falls_back_to_platform(tmp_path):
    model, flags = hardware.read_cpuinfo(str(tmp_path / "absent"))
    assert flags == frozenset()
    assert model == platform.processor()


def test_read_cpuinfo_arm_features_line(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nFeatures\t: fp asimd avx512_bf16\n")
    model, flags = hardware.read_cpuinfo(str(path))
    assert flags == frozenset({"avx512_bf16"}) and model == platform.processor()


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_onednn_env_var_turns_it_off(monkeypatch, value):
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", value)
    assert hardware.onednn_enabled() is False


def test_detect_agrees_with_its_sources():
    device = hardware.detect()
    model, flags = hardware.detect_cpu()
    assert device.cpu_flags == flags and device.cpu_model == model
    assert device.cpu_flags >= (hardware.numpy_cpu_flags() or frozenset()) | hardware.read_cpuinfo()[1]
    assert device.onednn_enabled is hardware.onednn_enabled()
    assert device.tpu_count == len(tf.config.list_physical_devices("TPU"))
    assert len(device.gpus) == len(tf.config.list_physical_devices("GPU"))
    assert all(g.compute_capability is None or len(g.compute_capability) == 2 for g in device.gpus)


def test_onednn_on_unless_turned_off(monkeypatch):
    # TF 2.21's Linux x86 wheel is built with oneDNN; the query must say so.
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    from tensorflow.python.util import _pywrap_util_port

    assert hardware.onednn_enabled() is bool(_pywrap_util_port.IsMklEnabled())


def test_missing_onednn_query_is_unknown_and_auto_says_why(monkeypatch):
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    monkeypatch.setitem(sys.modules, hardware.ONEDNN_QUERY, None)  # import now raises ImportError
    assert hardware.onednn_enabled() is None
    device = DeviceInfo(cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=hardware.onednn_enabled())
    assert not device.fast_bfloat16 and "oneDNN unknown" in device.summary()
    name, reason = policy.choose_policy(device)
    assert name == "float32" and hardware.ONEDNN_QUERY in reason
    # Not the same reason as a build where oneDNN is known to be off.
    assert policy.choose_policy(DeviceInfo(cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=False))[1] != reason


def test_fast_paths():
    zen4 = DeviceInfo(cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=True)
    assert zen4.fast_bfloat16 and zen4.cpu_fast_bfloat16 and not zen4.fast_float16
    assert not DeviceInfo(cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=False).fast_bfloat16
    t4 = DeviceInfo(gpus=(GpuInfo("T4", (7, 5)),))
    assert t4.fast_float16 and not t4.fast_bfloat16
    # A GPU machine is judged by its GPUs, even when its CPU has bf16.
    t4_on_zen4 = DeviceInfo(gpus=(GpuInfo("T4", (7, 5)),), cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=True)
    assert not t4_on_zen4.fast_bfloat16
    mixed = DeviceInfo(gpus=(GpuInfo("A100", (8, 0)), GpuInfo("V100", (7, 0))))
    assert mixed.min_compute_capability == (7, 0)
    assert DeviceInfo(gpus=(GpuInfo("?", None),)).min_compute_capability is None


def test_summary():
    assert DeviceInfo(tpu_count=8).summary() == "8 TPU core(s)"
    assert DeviceInfo(gpus=(GpuInfo("A100", (8, 0)),)).summary() == "1 GPU(s): A100 (compute capability 8.0)"
    cpu = DeviceInfo(cpu_model="EPYC", cpu_flags=frozenset({"avx512_bf16", "avx2"}), onednn_enabled=True)
    assert cpu.summary() == "CPU (EPYC; avx512_bf16; oneDNN on)"
    assert DeviceInfo().summary() == "CPU (unknown model; no bf16/fp16 flags; oneDNN off)"


def test_a_onednn_isa_cap_below_bfloat16_is_no_fast_path_and_auto_says_why(monkeypatch):
    zen4 = dict(cpu_model="EPYC", cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=True)
    for cap in ("AVX512_CORE_BF16", "avx512_core_amx", "AVX10_1_512", None):
        assert DeviceInfo(**zen4, onednn_max_isa=cap).fast_bfloat16, cap
    for cap, aborts in (("AVX512_CORE", False), ("avx512_core_vnni", False), ("AVX2", True), ("SSE41", True)):
        device = DeviceInfo(**zen4, onednn_max_isa=cap)
        assert not device.fast_bfloat16 and device.onednn_aborts_bfloat16 is aborts, cap
        name, reason = policy.choose_policy(device)
        assert name == "float32" and f"capped at {cap}" in reason and "ONEDNN_MAX_CPU_ISA" in reason, reason
        warning = policy._speed_warning("mixed_bfloat16", device)
        assert f"oneDNN on, capped at {cap}" in warning and ("kills the process" in warning) is aborts, warning
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert hardware.detect().onednn_max_isa == "avx2"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE")  # oneDNN's older name
    assert hardware.detect().onednn_max_isa == "AVX512_CORE"


_CAPPED_BF16_MATMUL = """
import sys, tensorflow as tf, keras_amp
print(keras_amp.policy.choose_policy(keras_amp.hardware.detect())[0], flush=True)
x = tf.ones([64, 64], tf.bfloat16)
print(float(tf.reduce_sum(tf.cast(tf.matmul(x, x), tf.float32))), flush=True)
"""


@pytest.mark.skipif(not hardware.detect().cpu_fast_bfloat16, reason="needs a CPU with native bfloat16 and oneDNN on")
def test_tensorflow_under_the_caps_emulates_or_aborts_and_auto_picks_float32():
    """What ONEDNN_ISAS_BELOW_BF16 / _ABORTING_BF16 rest on, on this TensorFlow."""
    runs = {}
    for cap in ("AVX512_CORE", "AVX2"):
        env = {k: v for k, v in os.environ.items() if k != "DNNL_MAX_CPU_ISA"}
        runs[cap] = subprocess.run([sys.executable, "-c", _CAPPED_BF16_MATMUL], capture_output=True, text=True,
                                   timeout=300, env={**env, "ONEDNN_MAX_CPU_ISA": cap, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert runs["AVX512_CORE"].returncode == 0 and runs["AVX512_CORE"].stdout.split() == ["float32", "262144.0"]
    # The process dies at the matmul: SIGABRT (oneDNN cannot create the primitive) or SIGSEGV, by shape and path.
    assert runs["AVX2"].returncode in (-6, -11) and runs["AVX2"].stdout.split() == ["float32"], runs["AVX2"]


def test_tpu_is_fast_bfloat16():
    assert DeviceInfo(tpu_count=8).fast_bfloat16 and not DeviceInfo(tpu_count=8).fast_float16


BAD_DEVICE_FIELDS = {
    "gpu_names_not_gpuinfo": (dict(gpus=("A100",)), TypeError, r"`gpus\[0\]` must be a keras_amp.hardware.GpuInfo"),
    "gpus_not_a_sequence": (dict(gpus=GpuInfo("A100", (8, 0))), TypeError, r"`gpus` must be"),
    "tpu_count_negative": (dict(tpu_count=-1), ValueError, r"`tpu_count` must be an integer >= 0. Received: tpu_count=-1"),
    "tpu_count_float": (dict(tpu_count=1.0), TypeError, r"tpu_count=1.0"),
    "cpu_model_none": (dict(cpu_model=None), TypeError, r"`cpu_model` must be a string"),
    "cpu_flags_string": (dict(cpu_flags="avx512_bf16"), TypeError, r"`cpu_flags` must be a set of strings"),
    "cpu_flags_ints": (dict(cpu_flags={1}), TypeError, r"`cpu_flags` must be a set of strings"),
    "onednn_string": (dict(onednn_enabled="yes"), TypeError, r"onednn_enabled='yes'"),
    "onednn_max_isa_int": (dict(onednn_max_isa=2), TypeError, r"`onednn_max_isa` must be a string or None"),
}


@pytest.mark.parametrize("case", sorted(BAD_DEVICE_FIELDS))
def test_device_info_validates_fields(case):
    kwargs, error, match = BAD_DEVICE_FIELDS[case]
    with pytest.raises(error, match=match):
        DeviceInfo(**kwargs)


@pytest.mark.parametrize(
    "cap, error, match",
    [
        pytest.param((8,), ValueError, r"must have 2 entries", id="one_tuple"),
        pytest.param((8, 0, 1), ValueError, r"must have 2 entries", id="three_tuple"),
        pytest.param("8.0", TypeError, r"compute_capability='8.0'", id="string"),
        pytest.param((8.0, 0), TypeError, r"`compute_capability\[0\]` must be an integer", id="float_major"),
        pytest.param((-1, 0), ValueError, r"`compute_capability\[0\]` must be an integer >= 0", id="negative"),
    ],
)
def test_gpu_info_validates_capability(cap, error, match):
    with pytest.raises(error, match=match):
        GpuInfo("gpu", cap)
    with pytest.raises(TypeError, match=r"`name` must be a string"):
        GpuInfo(None, (8, 0))


def test_numpy_and_list_inputs_are_canonicalised():
    gpu = GpuInfo("A100", [np.int64(8), np.int32(0)])
    assert gpu.compute_capability == (8, 0) and type(gpu.compute_capability[0]) is int
    device = DeviceInfo(gpus=[gpu], tpu_count=np.int64(0), cpu_flags=["avx2"], onednn_enabled=np.bool_(True))
    assert device.gpus == (gpu,) and device.cpu_flags == frozenset({"avx2"}) and device.onednn_enabled is True
    hash(device)  # still usable as a dict key: frozen fields are hashable


LINUX = platform.system() == "Linux" and hardware.read_cpuinfo()[1]


@pytest.mark.skipif(not LINUX, reason="compares numpy's CPU detection with Linux's /proc/cpuinfo")
def test_numpy_detection_agrees_with_proc_cpuinfo():
    # Two independent readers of the same CPU: numpy (cpuid) and the kernel's flags line.
    _, proc = hardware.read_cpuinfo()
    assert hardware.numpy_cpu_flags() == proc & frozenset(hardware.NUMPY_FLAGS.values())
    assert "avx2" in proc or "avx2" not in hardware.numpy_cpu_flags()  # guard: a real flag was compared


def _no_proc_cpuinfo(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "CPUINFO", str(tmp_path / "absent"))  # as on macOS and Windows


def test_without_proc_cpuinfo_the_flags_come_from_the_cpu_itself(monkeypatch, tmp_path):
    _, proc = hardware.read_cpuinfo()
    _no_proc_cpuinfo(monkeypatch, tmp_path)
    device = hardware.detect()
    assert device.cpu_flags == hardware.numpy_cpu_flags()
    if LINUX:  # what Linux says, minus the flags only the file names (AMX); the decision stays
        assert device.cpu_flags == proc & frozenset(hardware.NUMPY_FLAGS.values())
        with_file = DeviceInfo(cpu_flags=proc, onednn_enabled=device.onednn_enabled)
        assert device.fast_bfloat16 == with_file.fast_bfloat16


def test_windows_names_the_cpu_from_the_registry(monkeypatch, tmp_path):
    _no_proc_cpuinfo(monkeypatch, tmp_path)
    opened = []

    class Key:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def open_key(root, path):
        opened.append((root, path))
        return Key()

    winreg = types.SimpleNamespace(HKEY_LOCAL_MACHINE="HKLM", OpenKey=open_key,
                                   QueryValueEx=lambda key, name: ({"ProcessorNameString": "Intel(R) Xeon(R) w5-3425 "}[name], 1))
    monkeypatch.setitem(sys.modules, "winreg", winreg)
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    model, flags = hardware.detect_cpu()
    assert model == "Intel(R) Xeon(R) w5-3425" and opened == [("HKLM", hardware.WINDOWS_CPU_KEY)]
    assert flags == hardware.numpy_cpu_flags()


def test_macos_names_the_cpu_from_sysctl(monkeypatch, tmp_path):
    _no_proc_cpuinfo(monkeypatch, tmp_path)
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="Apple M2 Pro\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert hardware.detect_cpu()[0] == "Apple M2 Pro"
    assert calls == [["sysctl", "-n", "machdep.cpu.brand_string"]]
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no"))
    assert hardware.detect_cpu()[0] == platform.processor()  # sysctl failed: the last fallback


def test_without_numpy_table_proc_cpuinfo_alone_answers(monkeypatch, tmp_path):
    for name in hardware.NUMPY_CPU_QUERY:
        monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError
    assert hardware.numpy_cpu_flags() is None
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert hardware.detect_cpu(str(path)) == ("AMD EPYC 9R14 96-Core Processor",
                                               frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "f16c"}))


def test_tensor_cores_only_on_gpus_that_have_them_for_the_dtype():
    cpu = DeviceInfo(cpu_flags=frozenset({"avx512_bf16", "amx_bf16"}), onednn_enabled=True)
    assert not cpu.tensor_cores("bfloat16") and not cpu.tensor_cores("float16")
    assert not DeviceInfo(tpu_count=8).tensor_cores("bfloat16")
    t4, a100 = GpuInfo("T4", (7, 5)), GpuInfo("A100", (8, 0))
    assert DeviceInfo(gpus=(t4,)).tensor_cores("float16") and not DeviceInfo(gpus=(t4,)).tensor_cores("bfloat16")
    assert DeviceInfo(gpus=(a100,)).tensor_cores("bfloat16") and not DeviceInfo(gpus=(a100,)).tensor_cores("float32")
    assert not DeviceInfo(gpus=(a100, t4)).tensor_cores("bfloat16")  # the weakest GPU decides
    assert not DeviceInfo(gpus=(GpuInfo("P100", (6, 0)),)).tensor_cores("float16")
    assert not DeviceInfo(gpus=(GpuInfo("?", None),)).tensor_cores("float16")

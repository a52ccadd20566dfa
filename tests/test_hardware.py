"""keras_amp.hardware: observation only, injectable."""

import pytest

from keras_amp import hardware
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


def test_read_cpuinfo_missing_file(tmp_path):
    model, flags = hardware.read_cpuinfo(str(tmp_path / "absent"))
    assert flags == frozenset()
    assert isinstance(model, str)


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_onednn_env_var_turns_it_off(monkeypatch, value):
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", value)
    assert hardware.onednn_enabled() is False


def test_detect_agrees_with_proc_cpuinfo():
    device = hardware.detect()
    model, flags = hardware.read_cpuinfo()
    assert device.cpu_flags == flags and device.cpu_model == model
    assert device.tpu_count == 0 or device.fast_bfloat16


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

"""`keras-amp doctor`."""

import json
import os
import subprocess
import sys

import pytest

from keras_amp import doctor
from keras_amp.hardware import DeviceInfo, GpuInfo


def _run_cli(*args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, "-m", "keras_amp.cli", *args], capture_output=True, text=True, timeout=180, env=env
    )


def test_doctor_command_prints_every_section_and_exits_0():
    out = _run_cli("doctor")
    assert out.returncode == 0, out.stderr
    for needle in ("Versions", "tensorflow", "keras", "python", "Devices", "oneDNN", "cpu flags", "Precision",
                   "tf32", "'auto' would choose", "why"):
        assert needle in out.stdout


def test_doctor_json_matches_choose_policy():
    out = _run_cli("doctor", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    from keras_amp import hardware, policy

    assert report["Precision"]["'auto' would choose"] == policy.choose_policy(hardware.detect())[0]
    assert report["Versions"]["keras"].startswith("3.15")


def test_doctor_reports_an_injected_gpu():
    device = DeviceInfo(gpus=(GpuInfo("Tesla T4", (7, 5)),))
    report = doctor.as_dict(doctor.collect(device))
    assert report["Devices"]["gpu:0"] == "Tesla T4, compute capability 7.5"
    assert report["Devices"]["fast float16"] == "yes"
    assert report["Precision"]["'auto' would choose"] == "mixed_float16"
    assert "jit_compile=True" not in report["Precision"]  # XLA loses no kernel on a GPU


def test_doctor_advises_against_xla_on_a_cpu_with_fast_bfloat16():
    zen4 = DeviceInfo(cpu_model="AMD EPYC", cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=True)
    report = doctor.as_dict(doctor.collect(zen4))
    assert report["Precision"]["'auto' would choose"] == "mixed_bfloat16"
    assert "oneDNN's bfloat16 kernels" in report["Precision"]["jit_compile=True"]
    off = doctor.as_dict(doctor.collect(DeviceInfo(cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=False)))
    assert "jit_compile=True" not in off["Precision"]  # bfloat16 is emulated either way


def test_register_section_extends_the_report():
    def extra(device):
        return doctor.Section("Extra", (("answer", "42"),))

    doctor.register_section(extra)
    try:
        text = doctor.format_report(doctor.collect(DeviceInfo()))
        assert "Extra\n  answer  42" in text
        doctor.register_section(extra)  # registering twice keeps one copy
        assert doctor._sections.count(extra) == 1
    finally:
        doctor._sections.remove(extra)


def test_register_section_rejects_non_callables():
    with pytest.raises(TypeError, match=r"`fn` must be callable. Received: fn=3"):
        doctor.register_section(3)


def test_unknown_subcommand_is_an_error():
    out = _run_cli("nonsense")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_versions_section_reads_the_version_module():
    from keras_amp import version

    report = doctor.as_dict(doctor.collect(DeviceInfo()))
    assert report["Versions"]["keras_amp"] == version.__version__ == "0.1.0"


def test_unknown_onednn_is_reported_as_unknown():
    report = doctor.as_dict(doctor.collect(DeviceInfo(cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=None)))
    assert report["Devices"]["oneDNN"].startswith("unknown")
    assert report["Precision"]["'auto' would choose"] == "float32"
    assert "_pywrap_util_port" in report["Precision"]["why"]

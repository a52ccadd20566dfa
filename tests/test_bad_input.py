"""Bad input to every public argument: the right error class, and a message naming the argument.

Two tables:
- `API`: a name -> (the public callable whose parameters must all be covered, a function calling
  it with valid defaults overridden by keyword). Register a new public callable here once.
- `BAD`: one row per bad value, `(api, argument, value, error class)`. TypeError for a wrong
  type, ValueError for a wrong value. A new public argument joins `BAD`;
  `test_every_parameter_has_a_row` fails until it does.
`GOOD` lists values that must be accepted (NumPy numbers wherever a Python number is).
"""

import re

import keras
import numpy as np
import pytest

import keras_amp
from keras_amp import doctor, policy
from keras_amp.hardware import DeviceInfo, GpuInfo
from keras_amp.losses import float32_loss
from keras_amp.optimizers import LossScaleOptimizer, scale_rule, wrap

PLAIN_CPU = DeviceInfo(cpu_model="test", cpu_flags=frozenset({"avx2"}), onednn_enabled=True)
CONFIG = dict(policy="mixed_float16", compute_dtype="float16", variable_dtype="float32", loss_scaling=True,
              tf32=False, device="", requested="mixed_float16", reason="test")


def _sgd():
    return keras.optimizers.SGD()


def _wrap(**kw):
    keras.config.set_dtype_policy("float32")  # where wrap() used to return without any check
    return wrap(**{"optimizer": _sgd(), **kw})


API = {
    "enable": (keras_amp.enable, lambda **kw: keras_amp.enable(**{"policy": "float32", "device": PLAIN_CPU, **kw})),
    "AmpConfig": (policy.AmpConfig, lambda **kw: policy.AmpConfig(**{**CONFIG, **kw})),
    "fingerprint_fields": (policy.AmpConfig.fingerprint_fields,
                           lambda **kw: policy.AmpConfig(**CONFIG).fingerprint_fields(**kw)),
    "add_config_listener": (policy.add_config_listener, lambda **kw: policy.add_config_listener(**kw)),
    "DeviceInfo": (DeviceInfo, lambda **kw: DeviceInfo(**kw)),
    "GpuInfo": (GpuInfo, lambda **kw: GpuInfo(**{"name": "gpu", **kw})),
    "LossScaleOptimizer": (LossScaleOptimizer, lambda **kw: LossScaleOptimizer(**{"inner_optimizer": _sgd(), **kw})),
    "ScaleRule": (scale_rule.ScaleRule, lambda **kw: scale_rule.ScaleRule(**kw)),
    "wrap": (wrap, _wrap),
    "float32_loss": (float32_loss, lambda **kw: float32_loss(**kw)),
    "doctor.collect": (doctor.collect, lambda **kw: doctor.collect(**kw)),
    "doctor.register_section": (doctor.register_section, lambda **kw: doctor.register_section(**kw)),
    "doctor.format_report": (doctor.format_report, lambda **kw: doctor.format_report(**kw)),
    "doctor.as_dict": (doctor.as_dict, lambda **kw: doctor.as_dict(**kw)),
    "doctor.Section": (doctor.Section, lambda **kw: doctor.Section(**{"title": "t", "rows": (), **kw})),
}

NAN, INF = float("nan"), float("inf")
BAD = [
    # enable()
    ("enable", "policy", "bogus", ValueError),
    ("enable", "policy", 16, TypeError),
    ("enable", "policy", keras.DTypePolicy("float16"), ValueError),
    ("enable", "tf32", "yes", TypeError),
    ("enable", "tf32", 1, TypeError),
    ("enable", "device", "cpu", TypeError),
    # AmpConfig
    ("AmpConfig", "policy", "bogus", ValueError),
    ("AmpConfig", "policy", None, TypeError),
    ("AmpConfig", "compute_dtype", "bfloat16", ValueError),
    ("AmpConfig", "variable_dtype", "float16", ValueError),
    ("AmpConfig", "loss_scaling", "yes", TypeError),
    ("AmpConfig", "loss_scaling", False, ValueError),
    ("AmpConfig", "tf32", 0, TypeError),
    ("AmpConfig", "device", None, TypeError),
    ("AmpConfig", "requested", 3, TypeError),
    ("AmpConfig", "reason", b"x", TypeError),
    ("fingerprint_fields", "model", "x", TypeError),
    ("fingerprint_fields", "optimizer", "x", TypeError),
    ("add_config_listener", "fn", 3, TypeError),
    # DeviceInfo / GpuInfo
    ("DeviceInfo", "gpus", ("A100",), TypeError),
    ("DeviceInfo", "gpus", "A100", TypeError),
    ("DeviceInfo", "tpu_count", -1, ValueError),
    ("DeviceInfo", "tpu_count", 1.5, TypeError),
    ("DeviceInfo", "tpu_count", True, TypeError),
    ("DeviceInfo", "cpu_model", None, TypeError),
    ("DeviceInfo", "cpu_flags", "avx2", TypeError),
    ("DeviceInfo", "cpu_flags", {1, 2}, TypeError),
    ("DeviceInfo", "onednn_enabled", "on", TypeError),
    ("GpuInfo", "name", None, TypeError),
    ("GpuInfo", "compute_capability", (8,), ValueError),
    ("GpuInfo", "compute_capability", "8.0", TypeError),
    ("GpuInfo", "compute_capability", (8.0, 0), TypeError),
    ("GpuInfo", "compute_capability", (-1, 0), ValueError),
    # LossScaleOptimizer
    ("LossScaleOptimizer", "inner_optimizer", "sgd", TypeError),
    ("LossScaleOptimizer", "initial_scale", 0.0, ValueError),
    ("LossScaleOptimizer", "initial_scale", 1e39, ValueError),
    ("LossScaleOptimizer", "initial_scale", NAN, ValueError),
    ("LossScaleOptimizer", "initial_scale", "1", TypeError),
    ("LossScaleOptimizer", "dynamic_growth_steps", 0, ValueError),
    ("LossScaleOptimizer", "dynamic_growth_steps", 10**20, ValueError),
    ("LossScaleOptimizer", "dynamic_growth_steps", 2.0, TypeError),
    ("LossScaleOptimizer", "name", 3, TypeError),
    ("LossScaleOptimizer", "tier", "bogus", ValueError),
    ("LossScaleOptimizer", "tier", ["small"], TypeError),
    ("LossScaleOptimizer", "min_scale", -1, ValueError),
    ("LossScaleOptimizer", "min_scale", 1e-39, ValueError),
    ("LossScaleOptimizer", "min_scale", INF, ValueError),
    ("LossScaleOptimizer", "max_scale", 1e39, ValueError),
    ("LossScaleOptimizer", "max_scale", 0.5, ValueError),  # below the default floor, 1
    ("LossScaleOptimizer", "growth_factor", 1.0, ValueError),
    ("LossScaleOptimizer", "growth_factor", None, TypeError),
    ("LossScaleOptimizer", "backoff_factor", 1.0, ValueError),
    ("LossScaleOptimizer", "backoff_factor", 1e-40, ValueError),
    ("LossScaleOptimizer", "hysteresis", 0, ValueError),
    ("LossScaleOptimizer", "hysteresis", 10**20, ValueError),
    ("LossScaleOptimizer", "hysteresis", 1.5, TypeError),
    ("LossScaleOptimizer", "dynamic", "no", TypeError),
    ("LossScaleOptimizer", "on_min_scale", "panic", ValueError),
    ("LossScaleOptimizer", "on_min_scale", None, TypeError),
    ("LossScaleOptimizer", "foo", 1, TypeError),  # **kwargs: unknown names
    # ScaleRule (the pure rule's constants)
    ("ScaleRule", "dynamic", 1, TypeError),
    ("ScaleRule", "dynamic_growth_steps", -3, ValueError),
    ("ScaleRule", "growth_factor", 0.5, ValueError),
    ("ScaleRule", "backoff_factor", 2.0, ValueError),
    ("ScaleRule", "min_scale", 0.0, ValueError),
    ("ScaleRule", "max_scale", INF, ValueError),
    ("ScaleRule", "hysteresis", "2", TypeError),
    ("ScaleRule", "min_scale_patience", 0, ValueError),
    # wrap(), under float32
    ("wrap", "optimizer", 3, TypeError),
    ("wrap", "optimizer", "not_an_optimizer", ValueError),
    ("wrap", "tier", "bogus", ValueError),
    ("wrap", "force", "no", TypeError),
    ("wrap", "min_scale", -1, ValueError),
    ("wrap", "hysteresis", 10**20, ValueError),
    ("wrap", "foo", 1, TypeError),  # **kwargs: unknown names
    # losses, doctor
    ("float32_loss", "fn", "mse", TypeError),
    ("doctor.collect", "device", "cpu", TypeError),
    ("doctor.register_section", "fn", 3, TypeError),
    ("doctor.format_report", "sections", "Versions", TypeError),
    ("doctor.format_report", "sections", ["Versions"], TypeError),
    ("doctor.as_dict", "sections", None, TypeError),
    ("doctor.Section", "title", None, TypeError),
    ("doctor.Section", "rows", (("key", 1),), TypeError),
]

GOOD = [
    ("DeviceInfo", "tpu_count", np.int64(2)),
    ("GpuInfo", "compute_capability", (np.int32(8), np.int64(0))),
    ("LossScaleOptimizer", "dynamic_growth_steps", np.int64(10)),
    ("LossScaleOptimizer", "hysteresis", np.uint8(2)),
    ("LossScaleOptimizer", "initial_scale", np.float32(1024.0)),
    ("LossScaleOptimizer", "dynamic", np.bool_(True)),
    ("ScaleRule", "min_scale_patience", np.int16(3)),
    ("wrap", "dynamic_growth_steps", np.int32(5)),
    ("enable", "tf32", np.bool_(False)),
]


def _names(message: str, argument: str) -> bool:
    """The message names `argument`: `argument`, argument=..., argument[i] or in a list of unknown names."""
    a = re.escape(argument)
    return re.search(rf"`{a}[`\[]|\b{a}(=|\[)|argument\(s\): (\w+, )*{a}\b", message) is not None


def _id(row):
    return f"{row[0]}-{row[1]}-{row[2]!r}"[:80]


@pytest.mark.parametrize("row", BAD, ids=[_id(r) for r in BAD])
def test_bad_value_raises_naming_the_argument(row):
    api, argument, value, error = row
    with pytest.raises(Exception) as info:
        API[api][1](**{argument: value})
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert _names(str(info.value), argument), str(info.value)


@pytest.mark.parametrize("row", GOOD, ids=[_id(r) for r in GOOD])
def test_numpy_numbers_are_accepted(row):
    api, argument, value = row
    API[api][1](**{argument: value})


def _parameters(target):
    import inspect

    fn = target.__init__ if isinstance(target, type) else target
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD}


@pytest.mark.parametrize("api", sorted(API))
def test_every_parameter_has_a_row(api):
    covered = {argument for name, argument, _, _ in BAD if name == api}
    missing = _parameters(API[api][0]) - covered
    assert not missing, f"{api}: add BAD rows for {sorted(missing)}"


def test_a_failed_enable_leaves_nothing_behind():
    before = keras.config.dtype_policy().name
    for name, argument, value, _ in BAD:
        if name == "enable":
            with pytest.raises((TypeError, ValueError)):
                API["enable"][1](**{argument: value})
    assert keras_amp.config() is None and keras.config.dtype_policy().name == before

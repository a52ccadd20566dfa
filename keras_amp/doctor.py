"""Environment doctor: what this machine and install mean for mixed precision.

The report is a list of sections, each a list of (key, value) rows. Other modules add
sections with `register_section`, so later diagnostics extend `keras-amp doctor` without
touching this file.
"""

from __future__ import annotations

import dataclasses
import platform
from typing import Callable

from keras_amp import hardware, policy, validation
from keras_amp.version import __version__


@dataclasses.dataclass(frozen=True)
class Section:
    """A titled block of (key, value) rows in the doctor report."""

    title: str
    rows: tuple[tuple[str, str], ...]

    def __post_init__(self):
        validation.check_type("title", self.title, str, "a string")
        validation.check_type("rows", self.rows, (tuple, list), "a tuple of (key, value) string pairs")
        for i, row in enumerate(self.rows):
            ok = isinstance(row, (tuple, list)) and len(row) == 2 and all(isinstance(x, str) for x in row)
            if not ok:
                raise TypeError(f"`rows[{i}]` must be a (key, value) pair of strings. Received: rows[{i}]={row!r}")
        object.__setattr__(self, "rows", tuple(tuple(row) for row in self.rows))


SectionFn = Callable[[hardware.DeviceInfo], Section]
_sections: list[SectionFn] = []


def register_section(fn: SectionFn) -> SectionFn:
    """Adds a section to every doctor report (usable as a decorator); order of registration is kept."""
    validation.check_callable("fn", fn)
    if fn not in _sections:
        _sections.append(fn)
    return fn


@register_section
def _versions(device: hardware.DeviceInfo) -> Section:
    import keras
    import tensorflow as tf

    return Section(
        "Versions",
        (
            ("python", platform.python_version()),
            ("tensorflow", tf.__version__),
            ("keras", keras.__version__),
            ("keras_amp", __version__),
        ),
    )


@register_section
def _devices(device: hardware.DeviceInfo) -> Section:
    rows = [("summary", device.summary())]
    for i, gpu in enumerate(device.gpus):
        cap = gpu.compute_capability
        rows.append((f"gpu:{i}", f"{gpu.name}, compute capability {f'{cap[0]}.{cap[1]}' if cap else 'unknown'}"))
    rows.append(("tpu cores", str(device.tpu_count)))
    rows.append(("cpu model", device.cpu_model or "unknown"))
    relevant = [f for f in hardware.RELEVANT_CPU_FLAGS if f in device.cpu_flags]
    rows.append(("cpu flags (bf16/fp16-relevant)", " ".join(relevant) or "none"))
    onednn = {True: "on", False: "off", None: f"unknown ({hardware.ONEDNN_QUERY} missing)"}[device.onednn_enabled]
    rows.append(("oneDNN", onednn))
    rows.append(("fast bfloat16", "yes" if device.fast_bfloat16 else "no"))
    rows.append(("fast float16", "yes" if device.fast_float16 else "no"))
    return Section("Devices", tuple(rows))


@register_section
def _precision(device: hardware.DeviceInfo) -> Section:
    import keras
    import tensorflow as tf

    name, reason = policy.choose_policy(device)
    current = policy.config()
    rows = [
        ("tf32", "enabled" if tf.config.experimental.tensor_float_32_execution_enabled() else "disabled"),
        ("global dtype policy", keras.config.dtype_policy().name),
        ("keras_amp enabled", f"yes ({current.policy})" if current else "no"),
        ("'auto' would choose", name),
        ("why", reason),
    ]
    if device.xla_skips_fast_bfloat16:  # check_model's xla_on_cpu finding, said before a model exists
        rows.append(("jit_compile=True", "slower under bfloat16 here: XLA's matmuls and convolutions do not use "
                                         "oneDNN's bfloat16 kernels ('auto', Keras's default, leaves XLA off)"))
    return Section("Precision", tuple(rows))


def collect(device: hardware.DeviceInfo | None = None) -> list[Section]:
    """Every registered section for `device` (this machine when None)."""
    validation.check_type("device", device, (hardware.DeviceInfo, type(None)), "a keras_amp.hardware.DeviceInfo or None")
    device = device if device is not None else hardware.detect()
    sections = [fn(device) for fn in _sections]
    for fn, section in zip(_sections, sections):
        if not isinstance(section, Section):
            raise TypeError(f"Doctor section {fn!r} must return a doctor.Section. Received: {section!r}")
    return sections


def _check_sections(sections: list[Section]) -> None:
    validation.check_type("sections", sections, (list, tuple), "a list of doctor.Section")
    for i, section in enumerate(sections):
        validation.check_type(f"sections[{i}]", section, Section, "a doctor.Section")


def format_report(sections: list[Section]) -> str:
    """Plain-text rendering: a heading per section, aligned keys."""
    _check_sections(sections)
    lines = []
    for section in sections:
        lines.append(section.title)
        width = max((len(k) for k, _ in section.rows), default=0)
        lines.extend(f"  {k.ljust(width)}  {v}" for k, v in section.rows)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def as_dict(sections: list[Section]) -> dict[str, dict[str, str]]:
    """JSON-ready form: {section title: {key: value}}."""
    _check_sections(sections)
    return {s.title: dict(s.rows) for s in sections}

"""Environment doctor: what this machine and install mean for mixed precision.

The report is a list of sections, each a list of (key, value) rows. Other modules add
sections with `register_section`, so later diagnostics extend `keras-amp doctor` without
touching this file.
"""

from __future__ import annotations

import dataclasses
import platform
from typing import Callable

from keras_amp import hardware, policy


@dataclasses.dataclass(frozen=True)
class Section:
    """A titled block of (key, value) rows in the doctor report."""

    title: str
    rows: tuple[tuple[str, str], ...]


SectionFn = Callable[[hardware.DeviceInfo], Section]
_sections: list[SectionFn] = []


def register_section(fn: SectionFn) -> SectionFn:
    """Adds a section to every doctor report (usable as a decorator); order of registration is kept."""
    if not callable(fn):
        raise TypeError(f"`fn` must be callable. Received: fn={fn!r}")
    if fn not in _sections:
        _sections.append(fn)
    return fn


@register_section
def _versions(device: hardware.DeviceInfo) -> Section:
    import keras
    import tensorflow as tf

    import keras_amp

    return Section(
        "Versions",
        (
            ("python", platform.python_version()),
            ("tensorflow", tf.__version__),
            ("keras", keras.__version__),
            ("keras_amp", keras_amp.__version__),
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
    rows.append(("oneDNN", "on" if device.onednn_enabled else "off"))
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
    return Section("Precision", tuple(rows))


def collect(device: hardware.DeviceInfo | None = None) -> list[Section]:
    """Every registered section for `device` (this machine when None)."""
    device = device if device is not None else hardware.detect()
    return [fn(device) for fn in _sections]


def format_report(sections: list[Section]) -> str:
    """Plain-text rendering: a heading per section, aligned keys."""
    lines = []
    for section in sections:
        lines.append(section.title)
        width = max((len(k) for k, _ in section.rows), default=0)
        lines.extend(f"  {k.ljust(width)}  {v}" for k, v in section.rows)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def as_dict(sections: list[Section]) -> dict[str, dict[str, str]]:
    """JSON-ready form: {section title: {key: value}}."""
    return {s.title: dict(s.rows) for s in sections}

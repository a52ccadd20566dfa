"""check_model's findings from the dynamic audit: a probe batch, and the audit's 16-bit ops as findings."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_amp.diagnostics import audit
from keras_amp.diagnostics.finding import Finding

# A probe batch: batch size 2, other unknown dimensions (sequence length, image size) 8.
_PROBE_BATCH, _PROBE_DIM = 2, 8


def probe_batch(model) -> tuple[Any, str]:
    """Ones shaped like `model.input` (batch 2, unknown dimensions 8) and a note, or (None, why)."""
    try:
        # A functional (or graph-called) model's symbolic input structure; a Sequential's one input.
        specs = model.inputs[0] if isinstance(model, keras.Sequential) else model.input
    except (AttributeError, ValueError, IndexError, TypeError):
        return None, ("not audited: no batch given and the model records no input specs (unbuilt, or a "
                      "subclassed model called eagerly); ops inside its layers were not checked: pass x= for "
                      "the op findings")

    def ones(spec):
        shape = [(_PROBE_BATCH if i == 0 else _PROBE_DIM) if d is None else d for i, d in enumerate(spec.shape)]
        return tf.ones(shape, dtype=spec.dtype)

    try:
        batch = keras.tree.map_structure(ones, specs)
    except (TypeError, ValueError) as e:  # a string input (preprocessing): no ones of that dtype
        return None, f"not audited: no probe batch for the model's inputs ({e}); pass x= for the op findings"
    shapes = ", ".join(str(tuple(t.shape)) for t in keras.tree.flatten(batch))
    return batch, f"ops audited on a probe batch of ones {shapes}; pass x= to audit your data's ops"


_AUDIT_FIX = {
    "attention": (
        "under keras_amp.enable() a traced step computes in float32 every matmul of two activations that "
        "feeds a keras softmax; this one was not reached (a raw tf.* softmax, eager execution, or an op "
        "outside the rule's walk): use keras.ops / keras_amp.layers.MultiHeadAttention, or compute it in float32"
    ),
}
# Static findings about what a layer's ops compute: a probe batch adds nothing for their layers.
_OP_FINDING_KINDS = (
    "low_precision_softmax", "low_precision_normalization", "low_precision_exp", "low_precision_loss",
    "low_precision_recurrence",
)
_AUDIT_FIX_DEFAULT = (
    "compute this layer in float32 (dtype='float32', keras_amp.layers.Float32(...), or apply_recipe(..., "
    "rules={{{path!r}: 'float32'}})); under keras_amp.enable() the op rules cover keras.ops calls, "
    "not raw tf.* calls"
)


def _covered(path: str, paths: set[str]) -> bool:
    """Whether `path` or a layer above it is among `paths`."""
    return any(path == p or path.startswith(f"{p}/") for p in paths)


def audit_findings(model, report: audit.AuditReport, static: list[Finding], *, probe: bool) -> list[Finding]:
    """One finding per (layer path, op kind) that ran in 16 bits, naming the ops, dtypes and passes.

    Normalisation ops are "low_precision_normalization" (once per layer beside a static one),
    the rest "low_precision_op". From a probe batch only what no static finding of the layer (or
    of a layer above it) already reports is added: the user gave no batch, so one finding each.
    """
    normalised = {f.layer for f in static if f.kind == "low_precision_normalization"}
    explained = {f.layer for f in static if f.kind in _OP_FINDING_KINDS}
    groups: dict[tuple[str, str], list[audit.OpRecord]] = {}
    for record in report.low_precision():
        groups.setdefault((record.layer_path, record.category), []).append(record)
    findings = []
    for (path, category), records in groups.items():
        path = path or model.name
        kind = "low_precision_normalization" if category == "normalization" else "low_precision_op"
        if (kind == "low_precision_normalization" and path in normalised) or (probe and _covered(path, explained)):
            continue
        ops = ", ".join(sorted({r.op_type for r in records}))
        dtypes = "/".join(sorted({r.dtype for r in records}))
        phases = " and ".join(p for p in audit.PHASES if any(r.phase == p for r in records))
        findings.append(Finding(
            kind, path, f"{category} op(s) {ops} ran in {dtypes} in the {phases} pass",
            _AUDIT_FIX.get(category, _AUDIT_FIX_DEFAULT.format(path=path)),
        ))
    return findings

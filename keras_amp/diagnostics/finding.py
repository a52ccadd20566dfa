"""`Finding`: one mixed-precision hazard of a model, as data, and the kinds a report lists."""

from __future__ import annotations

import dataclasses

# Finding kinds, in the order the report lists them.
KINDS = (
    "built_before_enable",
    "low_precision_softmax",
    "low_precision_normalization",
    "low_precision_exp",
    "low_precision_loss",
    "low_precision_recurrence",
    "low_precision_op",
    "output_not_float32",
    "low_precision_variables",
    "no_loss_scaling",
    "dimension_not_multiple_of_8",
    "xla_on_cpu",
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One hazard.

    Args:
        kind: String. One of `keras_amp.diagnostics.KINDS`.
        layer: String. Path of the layer concerned ("block/conv"), or the model name for
            model-wide findings.
        message: String. What is wrong and why it matters.
        fix: String. What to change.
    """

    kind: str
    layer: str
    message: str
    fix: str

"""Diagnostics: the static `check_model` report, the dynamic op audit, the overflow locator,
per-layer gradient statistics, the activations a training step keeps for its backward pass, the
weight updates lost to rounding (`UpdateLossProbe`), and
the symptom library (the decision tree, as data)."""

from keras_amp.diagnostics import symptoms
from keras_amp.diagnostics.audit import AuditReport, OpRecord, audit_model
from keras_amp.diagnostics.check import KINDS, Finding, ModelReport, check_model
from keras_amp.diagnostics.gradient_probe import (
    GradientProbe,
    GradientReport,
    LayerGradientStats,
    gradient_statistics,
)
from keras_amp.diagnostics.memory import SavedActivationsReport, SavedTensor, saved_activations
from keras_amp.diagnostics.overflow import LayerOverflowStats, OverflowReport, Producer, find_overflow
from keras_amp.diagnostics.vanishing_updates import UpdateLossProbe

__all__ = [
    "KINDS",
    "AuditReport",
    "Finding",
    "GradientProbe",
    "GradientReport",
    "LayerGradientStats",
    "LayerOverflowStats",
    "ModelReport",
    "OpRecord",
    "OverflowReport",
    "Producer",
    "SavedActivationsReport",
    "SavedTensor",
    "UpdateLossProbe",
    "audit_model",
    "check_model",
    "find_overflow",
    "gradient_statistics",
    "saved_activations",
    "symptoms",
]

"""Diagnostics: the static `check_model` report, the dynamic op audit, the overflow locator,
per-layer gradient statistics, and the symptom library (the decision tree, as data)."""

from keras_amp.diagnostics import symptoms
from keras_amp.diagnostics.audit import AuditReport, OpRecord, audit_model
from keras_amp.diagnostics.check import KINDS, Finding, ModelReport, check_model
from keras_amp.diagnostics.gradient_stats import (
    GradientProbe,
    GradientReport,
    LayerGradientStats,
    gradient_statistics,
)
from keras_amp.diagnostics.overflow import LayerOverflowStats, OverflowReport, Producer, find_overflow

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
    "audit_model",
    "check_model",
    "find_overflow",
    "gradient_statistics",
    "symptoms",
]

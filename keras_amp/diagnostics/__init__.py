"""Diagnostics: the static `check_model` report and the dynamic op audit."""

from keras_amp.diagnostics.audit import AuditReport, OpRecord, audit_model
from keras_amp.diagnostics.check import KINDS, Finding, ModelReport, check_model

__all__ = [
    "KINDS",
    "AuditReport",
    "Finding",
    "ModelReport",
    "OpRecord",
    "audit_model",
    "check_model",
]

"""Automatic precision: sensitivity search, float32 fallback, progressive precision, export."""

from keras_amp.auto_precision.fallback import FallbackDecision, Float32Fallback
from keras_amp.auto_precision.export import InferenceExport, export_for_inference, weight_bytes
from keras_amp.auto_precision.schedule import PrecisionChange, ProgressivePrecision
from keras_amp.auto_precision.search import Errors, LayerDecision, SearchResult, search_precision

__all__ = [
    "Errors",
    "FallbackDecision",
    "Float32Fallback",
    "InferenceExport",
    "LayerDecision",
    "PrecisionChange",
    "ProgressivePrecision",
    "SearchResult",
    "export_for_inference",
    "search_precision",
    "weight_bytes",
]

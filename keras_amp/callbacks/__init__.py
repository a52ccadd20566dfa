"""Training callbacks: loss-scale metrics and symptoms, per-layer gradient statistics."""

from keras_amp.callbacks.gradient_statistics import GradientStatistics
from keras_amp.callbacks.loss_scale import LossScaleMonitor

__all__ = ["GradientStatistics", "LossScaleMonitor"]

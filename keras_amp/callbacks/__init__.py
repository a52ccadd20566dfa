"""Training callbacks."""

from keras_amp.callbacks.loss_scale import LossScaleMonitor

__all__ = ["LossScaleMonitor"]

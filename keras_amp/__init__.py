"""keras_amp: mixed precision for Keras 3 on TensorFlow.

    keras_amp.enable()            # before building the model: picks bf16/fp16/fp32 by hardware
"""

from keras_amp import callbacks, distribute, layers, losses, optimizers
from keras_amp.hardware import DeviceInfo, GpuInfo
from keras_amp.optimizers import LossScaleOptimizer, MinScaleError, wrap
from keras_amp.policy import AmpConfig, AmpWarning, config, disable, enable

__version__ = "0.1.0"

__all__ = [
    "AmpConfig",
    "AmpWarning",
    "DeviceInfo",
    "GpuInfo",
    "LossScaleOptimizer",
    "MinScaleError",
    "__version__",
    "callbacks",
    "config",
    "disable",
    "distribute",
    "enable",
    "layers",
    "losses",
    "optimizers",
    "wrap",
]

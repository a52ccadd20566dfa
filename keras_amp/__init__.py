"""keras_amp: mixed precision for Keras 3 on TensorFlow.

    keras_amp.enable()            # before building the model: picks bf16/fp16/fp32 by hardware
"""

from keras_amp import callbacks, distribute, layers, losses, optimizers
from keras_amp import check, recipes  # after layers: recipes swap in keras_amp.layers
from keras_amp.check import Finding, ModelReport, check_model
from keras_amp.hardware import DeviceInfo, GpuInfo
from keras_amp.optimizers import LossScaleOptimizer, MinScaleError, wrap
from keras_amp.policy import AmpConfig, AmpWarning, config, disable, enable
from keras_amp.recipes import RecipePlan, apply_recipe, plan_recipe

__version__ = "0.1.0"

__all__ = [
    "AmpConfig",
    "AmpWarning",
    "DeviceInfo",
    "Finding",
    "GpuInfo",
    "LossScaleOptimizer",
    "MinScaleError",
    "ModelReport",
    "RecipePlan",
    "__version__",
    "apply_recipe",
    "callbacks",
    "check",
    "check_model",
    "config",
    "disable",
    "distribute",
    "enable",
    "layers",
    "losses",
    "optimizers",
    "plan_recipe",
    "recipes",
    "wrap",
]

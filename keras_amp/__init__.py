"""keras_amp: mixed precision for Keras 3 on TensorFlow.

    keras_amp.enable()            # before building the model: picks bf16/fp16/fp32 by hardware
"""

from keras_amp import memory, model_graph, op_rules, validation
from keras_amp import callbacks, distribute, layers, losses, optimizers
from keras_amp import diagnostics, recipes
from keras_amp import auto_precision
from keras_amp.diagnostics import (
    AuditReport,
    Finding,
    ModelReport,
    OpRecord,
    OverflowReport,
    audit_model,
    check_model,
    find_overflow,
)
from keras_amp.hardware import DeviceInfo, GpuInfo
from keras_amp.matmul16_policy import Matmul16DTypePolicy
from keras_amp.optimizers import LossScaleOptimizer, MinScaleError, wrap
from keras_amp.plotting import plot_precision_plan
from keras_amp.policy import AmpConfig, AmpWarning
from keras_amp.state import config, disable, enable
from keras_amp.recipes import RecipePlan, apply_recipe, plan_recipe
from keras_amp.auto_precision import (
    Float32Fallback,
    ProgressivePrecision,
    export_for_inference,
    search_precision,
)
from keras_amp.version import __version__

__all__ = [
    "AmpConfig",
    "AmpWarning",
    "AuditReport",
    "DeviceInfo",
    "Finding",
    "Float32Fallback",
    "GpuInfo",
    "LossScaleOptimizer",
    "Matmul16DTypePolicy",
    "MinScaleError",
    "ModelReport",
    "OpRecord",
    "OverflowReport",
    "ProgressivePrecision",
    "RecipePlan",
    "__version__",
    "apply_recipe",
    "audit_model",
    "auto_precision",
    "callbacks",
    "check_model",
    "config",
    "diagnostics",
    "disable",
    "distribute",
    "enable",
    "export_for_inference",
    "find_overflow",
    "layers",
    "losses",
    "memory",
    "model_graph",
    "op_rules",
    "optimizers",
    "plan_recipe",
    "plot_precision_plan",
    "recipes",
    "search_precision",
    "validation",
    "wrap",
]

"""Loss-scale optimizers: `LossScaleOptimizer`, its update rule, its tiers, and `wrap()`."""

from keras_amp.optimizers.lean_adam import LeanAdam, LeanAdamW
from keras_amp.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras_amp.optimizers.scale_log import MinScaleError
from keras_amp.optimizers.scale_rule import ScaleRule, ScaleState
from keras_amp.optimizers.tiers import TIERS, TierValues, choose_tier
from keras_amp.optimizers.wrap import wrap

__all__ = ["LeanAdam", "LeanAdamW", "LossScaleOptimizer", "MinScaleError", "ScaleRule", "ScaleState", "TIERS", "TierValues", "choose_tier", "wrap"]

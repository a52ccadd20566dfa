"""`LossScaleMonitor`: loss-scaling state in `fit` logs, and host-side logging at cheap points."""

from __future__ import annotations

import keras
from absl import logging

from keras_amp.optimizers.loss_scale_optimizer import LossScaleOptimizer


class LossScaleMonitor(keras.callbacks.Callback):
    """Adds `loss_scale`, `overflow_count` and `consecutive_overflows` to `fit` logs.

    The values are the optimizer's variables, read where Keras already reads the logs: per batch
    as tensors (no extra sync; the progress bar converts them with the loss), per epoch as
    Python numbers. Every `check_every` batches and at each epoch end it calls the optimizer's
    `host_check()`: the one place scale changes are logged under XLA (`jit_compile=True`) and
    in replica context (strategies without merge_call), and where `on_min_scale="raise"` stops
    training there. A stock Keras `LossScaleOptimizer` gets `loss_scale` only.

    Args:
        check_every: Int >= 1. Batches between host checks (each reads five scalars). Defaults
            to 100.
    """

    def __init__(self, check_every: int = 100):
        super().__init__()
        if isinstance(check_every, bool) or not isinstance(check_every, int):
            raise TypeError("`check_every` must be an integer >= 1. "
                            f"Received: check_every={check_every!r}")
        if check_every < 1:
            raise ValueError(f"`check_every` must be >= 1. Received: check_every={check_every}")
        self.check_every = check_every
        self._batches = 0

    def _optimizer(self):
        opt = getattr(self.model, "optimizer", None)
        if isinstance(opt, keras.optimizers.LossScaleOptimizer) and opt.built:
            return opt
        return None

    def _variables(self, opt):
        found = {"loss_scale": opt.dynamic_scale}
        if isinstance(opt, LossScaleOptimizer):
            found["overflow_count"] = opt.overflow_count
            found["consecutive_overflows"] = opt.consecutive_overflows
        return found

    def on_train_begin(self, logs=None):
        if self.model is not None and getattr(self.model, "optimizer", None) is not None and \
                not isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer):
            logging.warning("LossScaleMonitor: the model's optimizer %r does not scale the loss; "
                            "nothing to monitor.", type(self.model.optimizer).__name__)

    def on_train_batch_end(self, batch, logs=None):
        opt = self._optimizer()
        if opt is None:
            return
        if logs is not None:
            for key, variable in self._variables(opt).items():
                logs[key] = variable.value
        self._batches += 1
        if self._batches % self.check_every == 0 and isinstance(opt, LossScaleOptimizer):
            opt.host_check()

    def on_epoch_end(self, epoch, logs=None):
        opt = self._optimizer()
        if opt is None:
            return
        if isinstance(opt, LossScaleOptimizer):
            state = opt.host_check()
            values = {k: state[k] for k in ("loss_scale", "overflow_count",
                                            "consecutive_overflows")}
        else:
            values = {"loss_scale": float(keras.ops.convert_to_numpy(opt.dynamic_scale))}
        if logs is not None:
            logs.update(values)

    def on_train_end(self, logs=None):
        opt = self._optimizer()
        if isinstance(opt, LossScaleOptimizer):
            opt.host_check()

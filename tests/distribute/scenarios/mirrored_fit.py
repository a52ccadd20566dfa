"""MirroredStrategy over 2 logical CPUs: fit under a mixed policy; compare with float64 NumPy SGD.

argv: policy optimizer
  optimizer: "sgd" | "stock_lso" (keras.optimizers.LossScaleOptimizer) | "amp_lso" (keras_amp's)
"""

import sys

import common
import keras

import keras_amp

policy, optimizer_kind = sys.argv[1], sys.argv[2]


class SkippedSteps(keras.callbacks.Callback):
    """Records the global steps a loss-scale optimizer skipped (its overflow counter moved)."""

    def __init__(self):
        super().__init__()
        self.steps, self._seen, self._step = [], 0, 0

    def on_train_batch_end(self, batch, logs=None):
        count = getattr(self.model.optimizer, "overflow_count", None)
        if count is not None and int(count.numpy()) > self._seen:
            self._seen = int(count.numpy())
            self.steps.append(self._step)
        self._step += 1


def make_optimizer():
    sgd = keras.optimizers.SGD(0.05)
    if optimizer_kind == "stock_lso":
        return keras.optimizers.LossScaleOptimizer(sgd)  # initial_scale 2**15
    if optimizer_kind == "amp_lso":
        return keras_amp.optimizers.LossScaleOptimizer(sgd, initial_scale=2.0**15, dynamic_growth_steps=1000)
    return sgd


def main():
    strategy = common.two_cpu_mirrored(policy)
    with strategy.scope():
        model = common.build_model()
        model.compile(optimizer=make_optimizer(), loss="mse")
        model.build((None, common.FEATURES))
    initial = model.get_weights()
    x, y = common.data()
    skipped = SkippedSteps()
    history = model.fit(common.dataset(x, y), epochs=2, verbose=0, callbacks=[skipped])
    per_replica = [
        [c.numpy() for c in var.value.values] for var in model.trainable_variables  # MirroredVariable copies
    ]
    digest, total, finite = common.weights_digest(model)
    common.emit(
        replicas=strategy.num_replicas_in_sync,
        losses=[float(v) for v in history.history["loss"]],
        weight_sum=total,
        finite=finite,
        replicas_identical=all(all((c == copies[0]).all() for c in copies) for copies in per_replica),
        optimizer=type(model.optimizer).__name__,
        compute_dtype=model.layers[0].compute_dtype,
        variable_dtype=model.layers[0].variable_dtype,
        iterations=int(model.optimizer.iterations.numpy()),
        skipped_steps=skipped.steps,
        scale=float(model.optimizer.dynamic_scale.numpy()) if hasattr(model.optimizer, "dynamic_scale") else None,
        ref_max_abs_diff=common.max_abs_diff(
            model.get_weights(), common.sgd_reference(initial, x, y, lr=0.05, epochs=2, skip_steps=skipped.steps)
        ),
    )


common.run(main)

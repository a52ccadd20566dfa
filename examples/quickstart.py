"""Quickstart: `keras_amp.enable()` then an ordinary Keras training run (what `make demo` runs).

Trains a small CNN on a synthetic, learnable image task generated on the fly (offline: no
download), prints the precision config, the per-step time after warm-up, and the accuracy.

    python examples/quickstart.py --policy=auto --epochs=3
"""

from __future__ import annotations

import time

from absl import app, flags, logging

from synthetic import build_model, make_dataset  # same folder

FLAGS = flags.FLAGS
flags.DEFINE_enum("policy", "auto", ["auto", "mixed_float16", "mixed_bfloat16", "float32"], "Precision policy.")
flags.DEFINE_integer("epochs", 4, "Training epochs.", lower_bound=1)
flags.DEFINE_integer("steps_per_epoch", 40, "Steps per epoch.", lower_bound=1)
flags.DEFINE_integer("batch_size", 64, "Global batch size.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Random seed.")

class StepTimer:
    """Per-batch wall time after warm-up (the first epoch traces and compiles)."""

    def __init__(self, warmup_steps: int):
        import keras

        outer = self

        class _Callback(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                outer._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                outer._seen += 1
                if outer._seen > warmup_steps:
                    outer.times.append(time.perf_counter() - outer._start)

        self.callback = _Callback()
        self.times: list[float] = []
        self._seen = 0
        self._start = 0.0


def main(argv):
    del argv
    import keras
    import numpy as np

    import keras_amp

    config = keras_amp.enable(FLAGS.policy)
    logging.info("keras_amp config: %s", config)
    print(f"policy={config.policy} compute={config.compute_dtype} loss_scaling={config.loss_scaling}")
    print(f"device: {config.device}\nwhy: {config.reason}")

    keras.utils.set_random_seed(FLAGS.seed)
    model = build_model()
    # Under mixed_float16 this is keras_amp's bounded loss scaler; otherwise the Adam unchanged.
    optimizer = keras_amp.wrap(keras.optimizers.Adam(1e-3))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    timer = StepTimer(warmup_steps=FLAGS.steps_per_epoch)
    history = model.fit(
        make_dataset(FLAGS.batch_size, FLAGS.seed),
        epochs=FLAGS.epochs,
        steps_per_epoch=FLAGS.steps_per_epoch,
        callbacks=[timer.callback, keras_amp.callbacks.LossScaleMonitor()],
        shuffle=False,  # the dataset shuffles itself
        verbose=2,
    )
    losses = history.history["loss"]
    if not np.all(np.isfinite(losses)):
        raise SystemExit(f"non-finite loss: {losses}")
    if timer.times:
        print(f"median step time after warm-up: {1e3 * float(np.median(timer.times)):.1f} ms")
    if isinstance(optimizer, keras_amp.LossScaleOptimizer):
        print(f"loss scale {optimizer.scale:g}, skipped steps {int(optimizer.overflow_count.numpy())}")
    print(f"final loss {losses[-1]:.3g}, accuracy {history.history['accuracy'][-1]:.3f}")
    keras_amp.disable()


if __name__ == "__main__":
    app.run(main)

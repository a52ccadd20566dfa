"""A custom training loop under mixed precision: GradientTape, `scale_loss`, `apply`, counters.

    python examples/custom_loop.py                          # keras_amp.enable("auto"), pydoc text
    python examples/custom_loop.py --policy=mixed_float16   # loss scaling: scale and counters printed
    python examples/custom_loop.py --compare_float32

What `fit` does for you, written out (the model is the Transformer of transformer.py):

    loss = float32_loss(loss_fn)(y, model(x))        # the loss computes in float32
    scaled = optimizer.scale_loss(loss)              # x loss scale under float16, else unchanged
    grads = tape.gradient(scaled, variables)
    optimizer.apply(grads, variables)                # unscale; skip the step if not finite

`keras_amp.wrap` returns a `keras_amp.LossScaleOptimizer` only under mixed_float16; Keras's
base optimizers have `scale_loss` too (the identity), so the same loop runs under every policy.
"""

from __future__ import annotations

import os
import time

from absl import app

from common import data, flags

flags.define(datasets=data.TEXT_DATASETS, epochs=3, batch_size=32, steps_per_epoch=30, width=128, depth=2)

_STEPS = {}  # one traced step per trainer (per process)


def make_train_step(model, optimizer):
    """A compiled training step returning the float32 loss and the number of correct predictions."""
    import keras
    import tensorflow as tf

    import keras_amp

    # float32_loss casts the logits (bfloat16/float16 under a mixed policy) to float32 first.
    loss_fn = keras_amp.losses.float32_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Frozen weights in 16 bits, and the lean tier's 16-bit weights (--optimizer=lean): before the
    # first step, as fit does it.
    keras_amp.memory.prepare(model, optimizer)
    variables = model.trainable_variables
    # Build before tracing, so the loss scale (tier="auto" picks it from the parameter count) exists.
    optimizer.build(variables)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        optimizer.apply(grads, variables)  # a LossScaleOptimizer unscales and checks finiteness
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), tf.float32))
        return loss, correct / tf.cast(tf.size(y), tf.float32)

    return train_step


def train_epoch(trainer, epoch: int) -> dict[str, float]:
    """One epoch of the custom loop; the `Trainer` hook (common/trainer.py) calls it."""
    import keras
    import tensorflow as tf

    import keras_amp
    from common.scalar_logs import write_scalars

    settings, model, optimizer = trainer.settings, trainer.model, trainer.optimizer
    if id(trainer) not in _STEPS:
        writer = tf.summary.create_file_writer(os.path.join(trainer.log_dir, "logs"))
        _STEPS[id(trainer)] = (make_train_step(model, optimizer), writer)
    train_step, writer = _STEPS[id(trainer)]
    # "batch loss" is the last step's; "loss" and "accuracy" are means over the epoch so far, as in fit, computed
    # here: Keras's Progbar averages a value it is given, but shows the last one on the epoch's last step.
    bar = keras.utils.Progbar(settings.steps_per_epoch, verbose=settings.verbose,
                              stateful_metrics=["batch loss", "loss", "accuracy"])
    losses, accuracies = [], []
    for x, y in trainer.data.train_epoch(epoch).take(settings.steps_per_epoch):
        start = time.perf_counter()
        loss, accuracy = train_step(x, y)
        loss, accuracy = float(loss), float(accuracy)  # waits for the step: the time is the step's
        trainer.timer.times.append(time.perf_counter() - start)
        losses.append(loss)
        accuracies.append(accuracy)
        bar.add(1, [("batch loss", loss), ("loss", sum(losses) / len(losses)),
                    ("accuracy", sum(accuracies) / len(accuracies))])
    logs = {"loss": sum(losses) / len(losses), "accuracy": sum(accuracies) / len(accuracies)}
    if isinstance(optimizer, keras_amp.LossScaleOptimizer):
        # Optimizer variables: checkpointed with the model, the same on every replica.
        logs.update(loss_scale=float(optimizer.scale), overflow_count=int(optimizer.overflow_count.numpy()),
                    consecutive_overflows=int(optimizer.consecutive_overflows.numpy()),
                    total_steps=int(optimizer.total_steps.numpy()), applied_steps=int(optimizer.iterations.numpy()))
        print("  loss scale {loss_scale:g}, overflows {overflow_count} ({consecutive_overflows} in a row), "
              "steps {total_steps} of which applied {applied_steps}".format(**logs))
    write_scalars(writer, logs, epoch, prefix="epoch_")
    return logs  # the trainer checkpoints the model and the optimizer after each epoch (--resume)


def main(argv):
    del argv
    return flags.main("transformer", "transformer", "custom_loop", custom_epoch=train_epoch)


if __name__ == "__main__":
    app.run(main, flags_parser=flags.parse)

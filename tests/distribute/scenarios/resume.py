"""BackupAndRestore with keras_amp's LossScaleOptimizer on 2 workers, killed mid-epoch and restarted.

argv: mode backup_root timeout
  mode: "reference" (3 epochs, never killed), "victim" (worker 1 stops in epoch 1, batch 1, and
        waits to be SIGKILLed), "resume" (same program restarted: BackupAndRestore restores)
Prints BACKUP lines after each epoch's backup, RESTORED at train begin, RESULT at the end.
"""

import json
import os
import sys
import time

import common
import keras

import keras_amp

mode, backup_root, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
EPOCHS = 3


def state(model, **extra) -> dict:
    opt = model.optimizer
    digest, total, finite = common.weights_digest(model)
    return dict(
        worker=common.task_index(),
        digest=digest,
        weight_sum=total,
        finite=finite,
        scale=float(opt.dynamic_scale.numpy()),
        overflow_count=int(opt.overflow_count.numpy()),
        consecutive_overflows=int(opt.consecutive_overflows.numpy()),
        step_counter=int(opt.step_counter.numpy()),
        iterations=int(opt.iterations.numpy()),
        total_steps=int(opt.total_steps.numpy()),
        inner_iterations=int(opt.inner_optimizer.iterations.numpy()),
        **extra,
    )


class Report(keras.callbacks.Callback):
    """Placed after BackupAndRestore, so it sees the state just restored / just backed up."""

    def on_train_begin(self, logs=None):
        print("RESTORED " + json.dumps(state(self.model, initial_epoch=self.model._initial_epoch or 0)), flush=True)

    def on_epoch_end(self, epoch, logs=None):
        print("BACKUP " + json.dumps(state(self.model, epoch=epoch)), flush=True)

    def on_train_batch_end(self, batch, logs=None):
        if mode == "victim" and self._epoch == 1 and batch == 1:
            print(f"MID_EPOCH worker={common.task_index()}", flush=True)
            if common.task_index() == 1:
                time.sleep(600)  # the driver SIGKILLs this process here

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def main():
    keras_amp.enable("mixed_float16")
    strategy = keras_amp.distribute.multi_worker(timeout_seconds=timeout)
    worker = common.task_index()
    with strategy.scope():
        optimizer = keras_amp.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0**8, dynamic_growth_steps=3
        )
        model = common.build_model()
        model.compile(optimizer=optimizer, loss="mse")
        model.build((None, common.FEATURES))
    clean_x, y = common.data()
    # Worker 1's global step 1 of every epoch overflows float16: the scale and counters move.
    x = common.data(poison_step=1, poison_value=1e5)[0] if worker == 1 else clean_x
    backup = keras.callbacks.BackupAndRestore(os.path.join(backup_root, f"worker{worker}"), delete_checkpoint=False)
    model.fit(common.dataset(x, y), epochs=EPOCHS, verbose=0, callbacks=[backup, Report()])
    common.emit(**state(model))


common.run(main)

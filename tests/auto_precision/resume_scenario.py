"""One training run with every precision-changing callback, killed mid-epoch and resumed.

Run by tests/auto_precision/test_checkpoints.py in its own process (BackupAndRestore's use case
is a process that dies). argv: mode backup_dir
  mode: "reference" (4 epochs, never killed), "victim" (prints MID_EPOCH in epoch 2, batch 1,
        and waits to be SIGKILLed), "resume" (the same program restarted: BackupAndRestore
        restores the epoch-1 backup)
The run: mixed_float16, keras_amp's LossScaleOptimizer; `Float32Fallback` moves the overflowing
`sensitive` layer at step 2, `ProgressivePrecision` raises `d2` at epoch 1 and `d1` at global
step 6 (epoch 1, batch 2). Prints RESTORED after BackupAndRestore's train begin and RESULT at
the end.
"""

import hashlib
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_amp  # noqa: E402
from auto_precision_models import Amplify, regression_data  # noqa: E402
from keras_amp.auto_precision import Float32Fallback, ProgressivePrecision, model_policies  # noqa: E402

mode, backup_dir = sys.argv[1], sys.argv[2]
EPOCHS = 4


def build():
    keras_amp.enable("mixed_float16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="d1")(inp)
    h = Amplify(name="sensitive")(h)
    h = keras.layers.Dense(16, activation="relu", name="d2")(h)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(keras_amp.wrap(keras.optimizers.Adam(1e-2)), "mse")
    model.build((None, 8))
    return model


def state(model):
    opt = model.optimizer
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()
    return dict(
        digest=digest,
        weights=len(model.get_weights()),
        policies=model_policies.policy_names(model),
        # Unbuilt before the first step of a fresh run (BackupAndRestore builds it to restore).
        scale=float(opt.dynamic_scale.numpy()) if opt.built else None,
        overflow_count=int(opt.overflow_count.numpy()) if opt.built else 0,
        total_steps=int(opt.total_steps.numpy()) if opt.built else 0,
        finite=all(bool(np.all(np.isfinite(w))) for w in model.get_weights()),
    )


class Report(keras.callbacks.Callback):
    """Listed after BackupAndRestore: sees the state it restored."""

    def on_train_begin(self, logs=None):
        print("RESTORED " + json.dumps(dict(state(self.model), initial_epoch=self.model._initial_epoch or 0)), flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if mode == "victim" and self._epoch == 2 and batch == 1:
            print("MID_EPOCH", flush=True)
            time.sleep(600)  # the driver SIGKILLs this process here


def main():
    model = build()
    x, y = regression_data(n=64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # 4 steps per epoch
    by_epoch = ProgressivePrecision({1: ["d2"]})
    by_step = ProgressivePrecision({6: ["d1"]}, unit="step")
    fallback = Float32Fallback((x[:16], y[:16]), patience=2)
    backup = keras.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)
    history = model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[by_epoch, by_step, fallback, backup, Report()])
    print("RESULT " + json.dumps(dict(
        state(model),
        losses=history.history["loss"],
        epoch_changes=[[c.at, list(c.layers)] for c in by_epoch.changes],
        step_changes=[[c.at, list(c.layers)] for c in by_step.changes],
        decisions=[[d.layer, d.step] for d in fallback.decisions],
    )), flush=True)


main()
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown

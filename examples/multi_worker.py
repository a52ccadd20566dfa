"""Multi-worker training on one machine: N processes on 127.0.0.1, one MultiWorkerMirroredStrategy.

    python examples/multi_worker.py --workers=2 --policy=mixed_bfloat16

Without --worker_mode the script launches itself `--workers` times through
`keras_amp.distribute.LocalCluster` (free ports, TF_CONFIG per process, bounded waits) and
prints each worker's result; on a real cluster, run it with --worker_mode on every node, with
TF_CONFIG set by the scheduler (see README, "Multi-node GPU clusters").
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from synthetic import build_model, make_dataset  # same folder

FLAGS = flags.FLAGS
flags.DEFINE_integer("workers", 2, "Worker processes to launch locally.", lower_bound=1)
flags.DEFINE_bool("worker_mode", False, "Run as one worker (TF_CONFIG must be set).")
flags.DEFINE_enum("policy", "auto", ["auto", "mixed_float16", "mixed_bfloat16", "float32"], "Precision policy.")
flags.DEFINE_integer("epochs", 2, "Training epochs.", lower_bound=1)
flags.DEFINE_integer("steps_per_epoch", 20, "Steps per epoch.", lower_bound=1)
flags.DEFINE_integer("per_replica_batch_size", 32, "Examples per replica per step.", lower_bound=1)
flags.DEFINE_float("timeout_seconds", 120.0, "Collective timeout (a dead worker fails the others).")
flags.DEFINE_float("launch_timeout", 600.0, "Seconds the whole local cluster may run.")


def run_worker() -> None:
    import keras
    import numpy as np

    import keras_amp

    keras_amp.enable(FLAGS.policy)
    strategy = keras_amp.distribute.multi_worker(timeout_seconds=FLAGS.timeout_seconds)  # verifies settings
    batch = keras_amp.distribute.global_batch_size(FLAGS.per_replica_batch_size, strategy)
    # Every worker reads the same synthetic stream; "data" sharding gives each its own slice.
    dataset = keras_amp.distribute.with_auto_shard_policy(make_dataset(batch, seed=0), "data")
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras_amp.wrap(keras.optimizers.Adam(1e-3)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(dataset, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch, verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    print(json.dumps({
        "task": json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}),
        "replicas": strategy.num_replicas_in_sync,
        "losses": [round(float(v), 6) for v in history.history["loss"]],
        "weight_checksum": float(np.sum(weights, dtype=np.float64)),
    }))


def launch_local() -> int:
    from keras_amp import distribute

    argv = [sys.executable, __file__, "--worker_mode", f"--policy={FLAGS.policy}", f"--epochs={FLAGS.epochs}",
            f"--steps_per_epoch={FLAGS.steps_per_epoch}", f"--per_replica_batch_size={FLAGS.per_replica_batch_size}",
            f"--timeout_seconds={FLAGS.timeout_seconds}"]
    results = distribute.launch(argv, FLAGS.workers, timeout=FLAGS.launch_timeout, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    for result in results:
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        print(f"worker {result.index}: rc={result.returncode} {lines[-1] if lines else result.tail(1500)}")
    return 0 if all(r.ok for r in results) else 1


def main(argv):
    del argv
    if FLAGS.worker_mode:
        run_worker()
        return 0
    return launch_local()


if __name__ == "__main__":
    app.run(main)

"""Multi-worker training on one machine: N processes on 127.0.0.1, one MultiWorkerMirroredStrategy.

    python examples/multi_worker.py --workers=2 --policy=mixed_bfloat16
    python examples/multi_worker.py --workers=2 --compare_float32

The same data and models as the other examples (common/): by default the causal CNN of cnn.py
on Python's documentation text. Without --worker_mode the script launches itself `--workers`
times through `keras_amp.distribute.local_cluster` (free ports, TF_CONFIG per process, bounded
waits) and prints each worker's result; on a real cluster, run it with --worker_mode on every
node, with TF_CONFIG set by the scheduler (see README, "Multi-node GPU clusters").
"""

from __future__ import annotations

import json
import os
import sys

from absl import app
from absl import flags as absl_flags

from common import flags

flags.define(epochs=2, batch_size=64, steps_per_epoch=20, seq_len=64, width=64, depth=2)
absl_flags.DEFINE_enum("model", "cnn", ["cnn", "transformer", "rnn"], "Model family (recipe of the same name).")
absl_flags.DEFINE_integer("workers", 2, "Worker processes to launch locally.", lower_bound=1)
absl_flags.DEFINE_bool("worker_mode", False, "Run as one worker (TF_CONFIG must be set).")
absl_flags.DEFINE_float("timeout_seconds", 120.0, "Collective timeout (a dead worker fails the others).")
absl_flags.DEFINE_float("launch_timeout", 600.0, "Seconds the whole local cluster may run.")
FLAGS = absl_flags.FLAGS


def run_worker() -> None:
    import keras
    import numpy as np

    import keras_amp
    from common import data as data_lib
    from common import models

    keras_amp.enable(FLAGS.policy)
    strategy = keras_amp.distribute.multi_worker(timeout_seconds=FLAGS.timeout_seconds)  # verifies settings
    if FLAGS.batch_size % strategy.num_replicas_in_sync:
        raise ValueError(f"`batch_size` (global) must be divisible by the {strategy.num_replicas_in_sync} "
                         f"replicas. Received: batch_size={FLAGS.batch_size}")
    data = data_lib.load(FLAGS.dataset, seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size, seed=FLAGS.seed,
                         data_dir=FLAGS.data_dir, max_examples=FLAGS.max_examples)
    # Every worker builds the same seeded stream; "data" sharding gives each its own slice of each batch.
    dataset = keras_amp.distribute.with_auto_shard_policy(data.train, "data")
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    with strategy.scope():
        keras.utils.set_random_seed(FLAGS.seed)
        model = models.build(FLAGS.model, data, width=FLAGS.width, depth=FLAGS.depth)
        if keras_amp.config().compute_dtype != "float32":
            model = keras_amp.apply_recipe(model, FLAGS.model)
        model.compile(
            optimizer=keras_amp.wrap(keras.optimizers.Adam(FLAGS.learning_rate),
                                     tier=None if FLAGS.tier == "none" else FLAGS.tier),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    # One backup directory per worker: a restarted cluster resumes from the last finished epoch.
    backup = os.path.join(FLAGS.model_dir, "multi_worker", FLAGS.policy, f"worker{task.get('index', 0)}")
    history = model.fit(dataset, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(backup)])
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    print(json.dumps({
        "task": task,
        "policy": keras_amp.config().policy,
        "replicas": strategy.num_replicas_in_sync,
        "losses": [round(float(v), 6) for v in history.history["loss"]],
        "weight_checksum": float(np.sum(weights, dtype=np.float64)),
    }))


def launch_local(policy: str) -> bool:
    from keras_amp.distribute import local_cluster

    passed = ("dataset", "epochs", "steps_per_epoch", "batch_size", "seq_len", "width", "depth", "learning_rate",
              "tier", "seed", "model_dir", "model", "timeout_seconds", "max_examples", "data_dir")
    argv = [sys.executable, os.path.abspath(__file__), "--worker_mode", f"--policy={policy}"]
    argv += [f"--{name}={FLAGS[name].value}" for name in passed if FLAGS[name].value is not None]
    results = local_cluster.launch(argv, FLAGS.workers, timeout=FLAGS.launch_timeout,
                                   env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    for result in results:
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        print(f"worker {result.index}: rc={result.returncode} {lines[-1] if lines else result.tail(1500)}", flush=True)
    return all(r.ok for r in results)


def main(argv):
    del argv
    if FLAGS.worker_mode:
        run_worker()
        return 0
    ok = True
    for _, policy in flags.configs():
        ok = launch_local(policy) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    app.run(main)

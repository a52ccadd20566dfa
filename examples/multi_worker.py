"""Multi-worker training on one machine: N processes on 127.0.0.1, one MultiWorkerMirroredStrategy.

    python examples/multi_worker.py --workers=2 --policy=mixed_bfloat16
    python examples/multi_worker.py --workers=2 --compare_float32

The same data and models as the other examples (common/): by default the causal CNN of cnn.py
on Python's documentation text. Without --worker_mode the script launches itself `--workers`
times through `keras_amp.distribute.local_cluster` (free ports, TF_CONFIG per process, bounded
waits), shows worker 0's progress, and ends with one row per worker and a verdict: do the workers
agree on every epoch's loss, the weights and the loss scale? On a real cluster, run it with
--worker_mode and the same --model_dir on every node, with TF_CONFIG set by the scheduler (see
README, "Multi-node GPU clusters").

Each run folder holds worker 0's TensorBoard logs and final checkpoint (checkpoint.weights.h5),
each worker's result (worker<i>.json) and log files (worker_logs/), and BackupAndRestore's
backup/ while training (Keras deletes it when training ends, so a restarted run resumes only
from an unfinished one).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading

from absl import app
from absl import flags as absl_flags

from common import flags

flags.define(epochs=2, batch_size=64, steps_per_epoch=20, seq_len=64, width=64, depth=2, resumable=False)
absl_flags.DEFINE_enum("model", "cnn", ["cnn", "transformer", "rnn"], "Model family (recipe of the same name).")
absl_flags.DEFINE_integer("workers", 2, "Worker processes to launch locally.", lower_bound=1)
absl_flags.DEFINE_bool("worker_mode", False, "Run as one worker (TF_CONFIG and --model_dir must be set).")
absl_flags.DEFINE_float("timeout_seconds", 120.0, "Collective timeout, seconds > 0 (a dead worker fails the others).")
absl_flags.DEFINE_float("launch_timeout", 600.0, "Seconds > 0 the whole local cluster may run.")
# Checked at parsing: a bad value fails at once, in one line naming its flag, not in a worker after start-up.
absl_flags.register_validator("timeout_seconds", lambda seconds: seconds > 0, message="must be > 0 seconds")
absl_flags.register_validator("launch_timeout", lambda seconds: seconds > 0, message="must be > 0 seconds")
FLAGS = absl_flags.FLAGS
# The launcher's own flags; every other flag is passed on to each worker.
LAUNCHER_ONLY = ("compare_float32", "results_file", "model_dir", "policy", "workers", "worker_mode", "launch_timeout")


def weights_digest(weights) -> str:
    """SHA-256 of the weights' bytes: equal only for bit-identical weights."""
    digest = hashlib.sha256()
    for w in weights:
        digest.update(w.tobytes())
    return digest.hexdigest()


def run_worker() -> None:
    """One worker: trains, evaluates, writes worker<i>.json (and, on worker 0, logs and checkpoint)."""
    import keras

    import keras_amp
    from common import data as data_lib
    from common import models
    from common import scalar_logs
    from common.trainer import evaluate, progress_bar

    if not FLAGS.model_dir:
        raise SystemExit("error: --worker_mode needs --model_dir: the run's folder, the same on every worker.")
    keras_amp.enable(FLAGS.policy)
    strategy = keras_amp.distribute.multi_worker(timeout_seconds=FLAGS.timeout_seconds)  # verifies settings
    if FLAGS.batch_size % strategy.num_replicas_in_sync:
        raise ValueError(f"`batch_size` (global) must be divisible by the {strategy.num_replicas_in_sync} "
                         f"replicas. Received: batch_size={FLAGS.batch_size}")
    index = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    chief, run_dir = index == 0, FLAGS.model_dir
    data = data_lib.load(FLAGS.dataset, seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size, seed=FLAGS.seed,
                         data_dir=FLAGS.data_dir, max_examples=FLAGS.max_examples)
    # Every worker builds the same seeded stream; "data" sharding gives each its own slice of each batch.
    dataset = keras_amp.distribute.with_auto_shard_policy(data.train, "data")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        keras.utils.set_random_seed(FLAGS.seed)
        model = models.build(FLAGS.model, data, width=FLAGS.width, depth=FLAGS.depth)
        if keras_amp.config().compute_dtype != "float32":
            if FLAGS.show_plan and chief:
                print(keras_amp.plan_recipe(model, FLAGS.model), flush=True)
            model = keras_amp.apply_recipe(model, FLAGS.model)
        optimizer = keras_amp.wrap(keras.optimizers.Adam(FLAGS.learning_rate),
                                   tier=None if FLAGS.tier == "none" else FLAGS.tier)
        model.compile(optimizer=optimizer, loss=loss_fn)
    scaled = isinstance(optimizer, keras_amp.LossScaleOptimizer)
    callbacks = [keras_amp.distribute.VerifyPrecision(),  # per-layer policies and loss-scale settings agree
                 # One backup folder per worker: a restarted cluster resumes from the last finished epoch.
                 keras.callbacks.BackupAndRestore(os.path.join(run_dir, "backup", f"worker{index}"))]
    if scaled:
        callbacks.append(keras_amp.callbacks.LossScaleMonitor())
    if chief:  # the workers hold the same weights and logs: one copy is written
        callbacks += scalar_logs.callbacks(os.path.join(run_dir, "logs"))
    callbacks.append(progress_bar(f"worker {index}"))
    history = model.fit(dataset, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch,
                        verbose=FLAGS.verbose, callbacks=callbacks, shuffle=False)
    result = {
        "worker": index,
        "policy": keras_amp.config().policy,
        "replicas": strategy.num_replicas_in_sync,
        "losses": [float(v) for v in history.history["loss"]],
        **evaluate(model, data.eval, loss_fn, FLAGS.eval_steps),
        "loss_scale": float(optimizer.scale) if scaled else None,
        "overflow_count": int(optimizer.overflow_count.numpy()) if scaled else None,
        "weights_sha256": weights_digest(model.get_weights()),
        "log_dir": run_dir,
    }
    if chief:
        model.save_weights(os.path.join(run_dir, "checkpoint.weights.h5"))
    with open(os.path.join(run_dir, f"worker{index}.json"), "w") as f:
        json.dump(result, f, indent=1)


def _relay(cluster, index: int, stop: threading.Event) -> None:
    """Copies what worker `index` prints to this process's stdout as it comes (its progress bar)."""
    shown = 0
    while True:
        stopping = stop.wait(0.2)
        text = cluster.output(index)
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)
        if stopping:
            return


def verdict(results: list[dict]) -> tuple[bool, str]:
    """Whether every worker ended with the same per-epoch losses, weights and loss scale."""
    differ = [what for what, key in (("per-epoch losses", "losses"), ("weights", "weights_sha256"),
                                     ("loss scale", "loss_scale"))
              if len({json.dumps(r[key]) for r in results}) > 1]
    if differ:
        return False, f"workers DISAGREE: {', '.join(differ)} differ"
    scale = results[0]["loss_scale"]
    return True, (f"workers agree: identical per-epoch losses, weights (sha256 {results[0]['weights_sha256'][:12]}) "
                  f"and loss scale ({'none: no loss scaling' if scale is None else f'{scale:g}'})")


def summary(results: list[dict]) -> str:
    """One row per worker."""
    rows = [("worker", "replicas", "policy", "loss per epoch", "eval loss", "eval acc", "loss scale", "weights")]
    for r in results:
        rows.append((str(r["worker"]), str(r["replicas"]), r["policy"], " -> ".join(f"{v:.4f}" for v in r["losses"]),
                     f"{r['eval_loss']:.4f}", f"{r['eval_accuracy']:.4f}",
                     "n/a" if r["loss_scale"] is None else f"{r['loss_scale']:g}", r["weights_sha256"][:12]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def launch_local(label: str, policy: str, run_dir: str) -> dict:
    """Runs the local cluster for `policy`; prints worker 0's progress, the summary and the verdict."""
    from keras_amp.distribute import local_cluster

    logs = os.path.join(run_dir, "worker_logs")
    os.makedirs(logs, exist_ok=True)
    passed = [name for name in (*flags.NAMES, "model", "timeout_seconds") if name not in LAUNCHER_ONLY]
    argv = [sys.executable, os.path.abspath(__file__), "--worker_mode", f"--policy={policy}", f"--model_dir={run_dir}"]
    argv += [f"--{name}={FLAGS[name].value}" for name in passed if FLAGS[name].value is not None]
    print(f"[{label}] {FLAGS.workers} workers; run folder {run_dir}", flush=True)
    stop = threading.Event()
    with local_cluster.LocalCluster(argv, FLAGS.workers, log_dir=logs) as cluster:
        relay = threading.Thread(target=_relay, args=(cluster, 0, stop), daemon=True)
        relay.start()
        try:
            ended = cluster.wait(FLAGS.launch_timeout)
        finally:
            stop.set()
            relay.join()
    failed = [r for r in ended if not r.ok]
    for r in failed:
        why = f"timed out after {FLAGS.launch_timeout:g} s" if r.timed_out else f"exit code {r.returncode}"
        last = next((line for line in reversed(r.stderr.splitlines()) if line.strip()), "(no output)")
        print(f"[{label}] worker {r.index} failed ({why}): {last}\n  full log: {logs}/worker{r.index}.run0.err",
              flush=True)
    run = {"label": label, "policy": policy, "run_dir": run_dir, "ok": not failed, "agree": False, "workers": []}
    if failed:
        print(f"[{label}] no verdict: {len(failed)} of {FLAGS.workers} workers did not finish", flush=True)
        return run
    for i in range(FLAGS.workers):
        with open(os.path.join(run_dir, f"worker{i}.json")) as f:
            run["workers"].append(json.load(f))
    run["agree"], said = verdict(run["workers"])
    print(summary(run["workers"]))
    print(f"[{label}] {said}")
    print(f"[{label}] TensorBoard logs and checkpoint (worker 0) in {run_dir}; worker logs in {logs}", flush=True)
    return run


def main(argv):
    del argv
    if FLAGS.worker_mode:
        run_worker()
        return 0
    if FLAGS.batch_size % FLAGS.workers:
        raise SystemExit(f"error: --batch_size (global) must be divisible by --workers. Received: "
                         f"batch_size={FLAGS.batch_size}, workers={FLAGS.workers}")
    base = flags.run_dir("multi_worker", FLAGS.model_dir)  # before the download: a bad --model_dir fails at once
    flags.prepare_data()  # once, here: the workers must not race to download the same files
    runs = [launch_local(label, policy, os.path.join(base, label)) for label, policy in flags.configs()]
    flags.write_results(runs)
    return 0 if all(r["ok"] and r["agree"] for r in runs) else 1


if __name__ == "__main__":
    app.run(main, flags_parser=flags.parse)

"""Shared pieces of the distributed scenario scripts (each runs in its own process)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

FEATURES = 8
EXAMPLES = 64
GLOBAL_BATCH = 16  # 4 steps per epoch


def task_index() -> int:
    return json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)


def data(poison_step: int | None = None, poison_value: float = 3e4) -> tuple[np.ndarray, np.ndarray]:
    """A linear-regression set; `poison_step` puts `poison_value` into that global batch's inputs."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) * 0.5).astype("float32")
    if poison_step is not None:
        x = x.copy()
        x[poison_step * GLOBAL_BATCH : (poison_step + 1) * GLOBAL_BATCH] = poison_value
    return x, y


def dataset(x, y, shard: str = "data") -> tf.data.Dataset:
    from keras_amp.distribute import with_auto_shard_policy

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    return with_auto_shard_policy(ds, shard)


def two_cpu_mirrored(policy: str):
    """Two logical CPUs, keras_amp enabled with `policy`, and a MirroredStrategy over both."""
    import keras_amp  # noqa: PLC0415
    from keras_amp.distribute import local_cluster  # noqa: PLC0415

    local_cluster.configure_logical_cpus(2)
    keras_amp.enable(policy)
    return keras_amp.distribute.mirrored(["/cpu:0", "/cpu:1"])


def build_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )


def weights_digest(model: keras.Model) -> tuple[str, float, bool]:
    """sha256 of every weight's bytes, their float64 sum, and whether all are finite."""
    h = hashlib.sha256()
    total, finite = 0.0, True
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
        total += float(np.sum(w, dtype=np.float64))
        finite = finite and bool(np.all(np.isfinite(w)))
    return h.hexdigest(), total, finite


def emit(**result) -> None:
    """The one machine-readable line a scenario prints; the pytest driver parses it."""
    print("RESULT " + json.dumps(result, default=str), flush=True)


def emit_error(e: BaseException, **extra) -> None:
    emit(error=type(e).__name__, message=str(e)[:4000], traceback=traceback.format_exc()[-4000:], **extra)


def run(main) -> None:
    """Runs `main()`; an exception becomes an error RESULT line and exit status 3."""
    keras.config.disable_traceback_filtering()
    try:
        main()
    except Exception as e:  # noqa: BLE001 - the driver asserts on the error it expects
        emit_error(e)
        sys.stdout.flush()
        os._exit(3)  # skip interpreter teardown: a dead peer can make TF's shutdown hang
    sys.stdout.flush()
    os._exit(0)


def sgd_reference(weights, x, y, *, lr: float, epochs: int, skip_steps=()) -> list[np.ndarray]:
    """float64 NumPy SGD on `build_model()`'s Dense-relu-Dense + MSE, global batches in order.

    `skip_steps` are global step numbers (counted over all epochs) whose update is skipped, as a
    loss-scale optimizer does on overflow.
    """
    w1, b1, w2, b2 = (np.asarray(w, np.float64) for w in weights)
    x, y = x.astype(np.float64), y.astype(np.float64)
    step = 0
    for _ in range(epochs):
        for s in range(EXAMPLES // GLOBAL_BATCH):
            if step not in skip_steps:
                xb, yb = x[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH], y[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]
                pre = xb @ w1 + b1
                h = np.maximum(pre, 0.0)
                d_out = 2.0 * (h @ w2 + b2 - yb) / GLOBAL_BATCH
                dh = (d_out @ w2.T) * (pre > 0)
                w2, b2, w1, b1 = (
                    w2 - lr * h.T @ d_out,
                    b2 - lr * d_out.sum(0),
                    w1 - lr * xb.T @ dh,
                    b1 - lr * dh.sum(0),
                )
            step += 1
    return [w1, b1, w2, b2]


def max_abs_diff(a: list, b: list) -> float:
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64)))) for u, v in zip(a, b))

"""Step time under mixed_float16: keras_amp.LossScaleOptimizer vs stock Keras's, interleaved.

    python benchmarks/bench_loss_scale.py                 # ~4M-parameter MLP, the recorded figure
    python benchmarks/bench_loss_scale.py --width 512 --blocks 4 --block-steps 20   # quick check
    python benchmarks/bench_loss_scale.py --width 256 --batch 128 --seconds 60     # small steps, many blocks

Both models are identical (same seed), trained on the same cached tf.data input. After a
warm-up, fit() runs alternate blocks of steps for each optimizer; a callback times every batch.
Prints the median step time of each and the median of per-block ratios (target <= 1.02).
With `--seconds`, blocks are added past `--blocks` (in pairs, so each optimizer goes first
equally often) until that much time is spent: a few-millisecond step needs hundreds of
blocks before the median settles, an emulated float16 step a few.
"""

import argparse
import json
import os
import time

from keras_amp_console import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # the start-up banner filtered out; a TF_CPP_MIN_LOG_LEVEL the user set is kept

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_amp.optimizers  # noqa: E402


class _BatchTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._t)


def _model(width, depth, features):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(10, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--blocks", type=int, default=10, help="blocks per optimizer")
    p.add_argument("--block-steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seconds", type=float, default=0.0,
                   help="keep adding pairs of blocks past --blocks until the blocks took this long (0: --blocks only)")
    p.add_argument("--jit", action="store_true", help="jit_compile=True")
    p.add_argument("--json", help="also write the result here (run_all.py reads it)")
    args = p.parse_args()
    # A block's first batch includes fit()'s set-up and is not timed: a block needs 2 steps.
    for name, least in (("width", 1), ("depth", 1), ("batch", 1), ("blocks", 1), ("block_steps", 2), ("warmup", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be an integer >= {least}. Received: {getattr(args, name)}")
    if not args.seconds >= 0:  # NaN fails too
        p.error(f"--seconds must be a number >= 0. Received: {args.seconds}")

    keras.config.set_dtype_policy("mixed_float16")
    features = args.width
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 8, features)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch * 8,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).cache().repeat()
    data = data.prefetch(tf.data.AUTOTUNE)

    makers = {
        "stock": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-4)),
        "keras_amp": lambda: keras_amp.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-4)),
    }
    runs = {}
    for name, make in makers.items():
        model = _model(args.width, args.depth, features)
        model.compile(optimizer=make(), loss=keras.losses.SparseCategoricalCrossentropy(True),
                      jit_compile=args.jit)
        model.fit(data, steps_per_epoch=args.warmup, epochs=1, verbose=0, shuffle=False)  # trace + warm up
        runs[name] = (model, [])
    params = runs["stock"][0].count_params()

    ratios = []
    start, block = time.perf_counter(), 0
    while block < args.blocks or (args.seconds and (block % 2 or time.perf_counter() - start < args.seconds)):
        order = list(runs) if block % 2 == 0 else list(reversed(runs))
        medians = {}
        for name in order:
            model, times = runs[name]
            timer = _BatchTimer()
            model.fit(data, steps_per_epoch=args.block_steps, epochs=1, verbose=0, shuffle=False,
                      callbacks=[timer])
            times.extend(timer.times[1:])  # the first batch of a fit() call includes setup
            medians[name] = float(np.median(timer.times[1:]))
        ratios.append(medians["keras_amp"] / medians["stock"])
        block += 1

    result = {
        "params": params,
        "batch": args.batch,
        "jit": args.jit,
        "blocks": len(ratios),
        "block_steps": args.block_steps,
        "median_step_ms": {k: 1e3 * float(np.median(t)) for k, (_, t) in runs.items()},
        "median_ratio": float(np.median(ratios)),
        "block_ratios": [round(r, 4) for r in ratios],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    print(f"median ratio keras_amp/stock = {result['median_ratio']:.4f} (target <= 1.02)")


if __name__ == "__main__":
    main()

"""Step time of a Transformer encoder: keras_amp's float32 islands vs stock layers vs float32.

Three models of one architecture, trained with `fit` on a cached, repeated tf.data input:

    float32     built under the float32 policy
    stock_bf16  built under mixed_bfloat16 with Keras's layers
    amp_bf16    stock_bf16's architecture after keras_amp.apply_recipe(model, "transformer")
                (keras_amp MultiHeadAttention with float32 scores/softmax, float32 layer norms
                and output head)

After a warm-up fit per model (tracing), the models are measured alternately in interleaved
blocks (rotating the order each block) so drift and neighbours' load hit all three alike. A
callback records the interval between consecutive batch ends within a block; the report gives
the median per model and, for the targets, the median over blocks of the per-block ratios:

    amp_bf16 / stock_bf16 <= 1.10     (islands cost at most 10%)
    float32 / amp_bf16    >= 1.35     (still >= 1.35x faster than float32)

    python benchmarks/bench_layers.py --quick      # < 1-2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_amp  # noqa: E402
from keras_amp.recipes import apply_recipe  # noqa: E402

MAX_ISLAND_COST = 1.10
MIN_SPEEDUP_VS_FLOAT32 = 1.35


def build_encoder(args: argparse.Namespace) -> keras.Model:
    """A post-norm Transformer encoder classifier, built under the global policy in force."""
    inp = keras.Input((args.seq,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(args.vocab, args.dim, name="embed")(inp)
    for i in range(args.layers):
        a = keras.layers.MultiHeadAttention(
            args.heads, args.dim // args.heads, dropout=args.dropout, name=f"mha_{i}"
        )(x, x)
        x = keras.layers.LayerNormalization(name=f"ln_a_{i}")(keras.layers.Add()([x, a]))
        f = keras.layers.Dense(args.ff, activation="gelu", name=f"ffn_in_{i}")(x)
        f = keras.layers.Dense(args.dim, name=f"ffn_out_{i}")(f)
        x = keras.layers.LayerNormalization(name=f"ln_f_{i}")(keras.layers.Add()([x, f]))
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(args.classes, name="head")(x)
    return keras.Model(inp, out, name="encoder")


class BatchTimer(keras.callbacks.Callback):
    """Intervals between consecutive batch ends within one fit call, in seconds."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_begin(self, logs=None):
        self._last = None

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def dataset(args: argparse.Namespace) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    n = args.batch * 8
    x = rng.integers(0, args.vocab, (n, args.seq)).astype("int32")
    y = (x[:, 0] % args.classes).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True).cache().repeat()


def compiled(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def build_models(args: argparse.Namespace) -> dict[str, keras.Model]:
    keras.utils.set_random_seed(0)
    keras_amp.enable("float32")
    models = {"float32": build_encoder(args)}
    keras_amp.enable("mixed_bfloat16")
    stock = build_encoder(args)
    models["stock_bf16"] = stock
    models["amp_bf16"] = apply_recipe(stock, "transformer")
    return {name: compiled(m) for name, m in models.items()}


def run(args: argparse.Namespace) -> dict[str, float]:
    models = build_models(args)
    data = dataset(args)
    for name, model in models.items():  # warm-up: tracing and oneDNN primitive caches
        model.fit(data, steps_per_epoch=args.warmup, epochs=1, verbose=0, shuffle=False)
    names = list(models)
    blocks: list[dict[str, float]] = []  # per block: the median step of each model
    for block in range(args.blocks):
        order = names[block % len(names):] + names[: block % len(names)]
        medians = {}
        for name in order:
            timer = BatchTimer()
            models[name].fit(data, steps_per_epoch=args.steps + 1, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
            medians[name] = statistics.median(timer.times)
        blocks.append(medians)
        print(f"  block {block}: " + "  ".join(f"{n} {medians[n] * 1e3:.1f} ms" for n in order), flush=True)
    return blocks


def paired_ratio(blocks: list[dict[str, float]], a: str, b: str) -> float:
    """Median over blocks of a/b: each ratio compares models measured side by side, so slow drift
    and a neighbour's load cancel out of it."""
    return statistics.median(block[a] / block[b] for block in blocks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, few steps (< 1-2 minutes)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ff", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per model")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per model per block")
    parser.add_argument("--blocks", type=int, default=9, help="interleaved measurement blocks")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.dim, args.ff, args.batch, args.steps, args.blocks = 64, 128, 512, 16, 8, 3
    try:
        blocks = run(args)
    finally:
        keras_amp.disable()
    medians = {name: statistics.median(block[name] for block in blocks) for name in blocks[0]}
    cfg = (
        f"seq={args.seq} dim={args.dim} heads={args.heads} ff={args.ff} layers={args.layers} "
        f"batch={args.batch} dropout={args.dropout} steps={args.steps}x{args.blocks} blocks"
    )
    print(f"bench_layers: Transformer encoder, {cfg}; TF {tf.__version__}, Keras {keras.__version__}")
    for name, median in medians.items():
        print(f"  {name:<11} median step {median * 1e3:8.2f} ms")
    island_cost = paired_ratio(blocks, "amp_bf16", "stock_bf16")
    speedup = paired_ratio(blocks, "float32", "amp_bf16")
    print(f"  median of per-block ratios over {len(blocks)} blocks (stock bf16 vs float32: "
          f"{paired_ratio(blocks, 'float32', 'stock_bf16'):.3f}x)")
    print(f"  amp_bf16 / stock_bf16 = {island_cost:.3f}  (target <= {MAX_ISLAND_COST})  "
          f"{'OK' if island_cost <= MAX_ISLAND_COST else 'MISSED'}")
    print(f"  float32 / amp_bf16    = {speedup:.3f}  (target >= {MIN_SPEEDUP_VS_FLOAT32})  "
          f"{'OK' if speedup >= MIN_SPEEDUP_VS_FLOAT32 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

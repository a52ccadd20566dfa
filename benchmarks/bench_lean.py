"""Memory of the weight state: frozen weights in 16 bits (LoRA) and the lean tier, side by side.

    python benchmarks/bench_lean.py                 # every case, one process per configuration
    python benchmarks/bench_lean.py --smoke         # tiny sizes: only checks that it runs
    python benchmarks/bench_lean.py --case lora --config amp --steps 50 --json out.json   # one run

Cases (each trained `--steps` steps from the same seed on the same cached batches):

    transformer  the Transformer LM of benchmarks/workloads.py
    embedding    parameter-dominated: a 32768-word embedding and head, batch 4 (weights dominate)
    lora         a keras-hub Llama (vocabulary 8192, 4 layers, hidden 256) with enable_lora(4)

Configurations:

    float32      float32 policy, keras.optimizers.Adam
    stock        keras.mixed_precision mixed_bfloat16, Adam (float32 masters; frozen in float32)
    amp          keras_amp.enable("mixed_bfloat16"): frozen weights stored in bfloat16
    amp_frozen32 the same with frozen_weights="float32" (the bit-identity reference for lora)
    lean         keras_amp + keras_amp.optimizers.LeanAdam (bfloat16 weights + exact split)
    lean_sr      LeanAdam(compensation="stochastic")  (6 bytes per parameter)
    pure_bf16    LeanAdam(compensation="none"): 16-bit weights without compensation

Figures per run: state bytes (weights and optimizer variables, exact, from the variables); the
TF allocator peak while training (after two warm-up steps: tracing, the optimizer's build and
`keras_amp.memory.prepare` are behind it; `tf_build_peak_mib` in the JSON covers them) and the
peak RSS above the baseline over the whole run (bench_memory.py's definitions); the median step
time after warm-up; the training losses and the loss on a held-out batch (inference mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
from keras_amp_console import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # the start-up banner filtered out; a TF_CPP_MIN_LOG_LEVEL the user set is kept
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
import keras_amp  # noqa: E402
import workloads  # noqa: E402
from bench_memory import _peak_rss_kib, _reset_hwm, _status_kib, _tf_memory  # noqa: E402

MIB = 1 << 20
CASES = {"transformer": ("float32", "stock", "amp", "lean", "lean_sr", "pure_bf16"),
         "embedding": ("float32", "stock", "amp", "lean", "lean_sr", "pure_bf16"),
         "lora": ("stock", "amp_frozen32", "amp")}
SIZES = {"transformer": workloads.Sizes(batch=32, seq=128, dim=256, vocab=2048),
         "embedding": workloads.Sizes(batch=4, seq=16, dim=256, vocab=32768),
         "lora": workloads.Sizes(batch=4, seq=32, dim=256, vocab=8192)}
SMOKE = {"transformer": workloads.Sizes(batch=4, seq=16, dim=32, vocab=64),
         "embedding": workloads.Sizes(batch=2, seq=8, dim=16, vocab=256),
         "lora": workloads.Sizes(batch=2, seq=8, dim=16, vocab=64)}


class Timer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times, self._last = [], None

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def _model(case: str, s: workloads.Sizes) -> keras.Model:
    keras.utils.set_random_seed(0)
    if case == "transformer":
        return workloads.build_transformer(s)
    if case == "embedding":
        inp = keras.Input((s.seq,), dtype="int32")
        x = keras.layers.Embedding(s.vocab, s.dim)(inp)
        x = keras.layers.Dense(s.dim, activation="gelu")(x)
        return keras.Model(inp, keras.layers.Dense(s.vocab)(x))
    import keras_hub  # noqa: PLC0415  (test extra)

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=s.vocab, num_layers=4 if s.dim > 64 else 1, hidden_dim=s.dim, intermediate_dim=4 * s.dim,
        num_query_heads=4, num_key_value_heads=2)
    backbone.enable_lora(4)
    tokens = keras.Input((s.seq,), dtype="int32")
    hidden = backbone({"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens)})
    head = backbone.token_embedding  # tied: the logits reuse the (frozen) embedding
    return keras.Model(tokens, head(hidden, reverse=True))


def _data(s: workloads.Sizes):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, s.vocab, (s.batch * 9, s.seq + 1)).astype("int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    n = s.batch * 8
    train = tf.data.Dataset.from_tensor_slices((x[:n], y[:n])).batch(s.batch, drop_remainder=True).cache().repeat()
    return train, (x[n:], y[n:])


def _optimizer(config: str):
    if config.startswith("lean") or config == "pure_bf16":
        compensation = {"lean": None, "lean_sr": "stochastic", "pure_bf16": "none"}[config]
        return keras_amp.optimizers.LeanAdam(1e-3, compensation=compensation)
    return keras.optimizers.Adam(1e-3)


def run_one(case: str, config: str, steps: int, smoke: bool) -> dict:
    s = (SMOKE if smoke else SIZES)[case]
    float(tf.reduce_sum(tf.ones((8, 8))))
    baseline_kib = _status_kib("VmRSS") or _peak_rss_kib()
    _reset_hwm()
    _tf_memory("CPU:0", reset=True)
    tf_before = _tf_memory("CPU:0") or 0
    if config == "float32":
        keras.config.set_dtype_policy("float32")
    elif config == "stock":
        keras.config.set_dtype_policy("mixed_bfloat16")
    else:
        keras_amp.enable("mixed_bfloat16", frozen_weights="float32" if config == "amp_frozen32" else "compute")
    model = _model(case, s)
    model.compile(_optimizer(config), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train, (hx, hy) = _data(s)
    timer = Timer()
    warmup = model.fit(train, steps_per_epoch=1, epochs=2, verbose=0, callbacks=[timer])
    tf_build_peak = _tf_memory("CPU:0")
    _tf_memory("CPU:0", reset=True)
    history = model.fit(train, steps_per_epoch=1, epochs=steps - 2, verbose=0, callbacks=[timer])
    tf_peak = _tf_memory("CPU:0")
    peak_kib = _peak_rss_kib()
    held_out = float(model.evaluate(hx, hy, batch_size=s.batch, verbose=0))
    state = keras_amp.memory.state_bytes(model)
    trainable_params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    warm = timer.times[min(5, len(timer.times) - 1):] if timer.times else [float("nan")]
    return {
        "case": case, "config": config, "steps": steps,
        "state_bytes": state, "trainable_params": trainable_params,
        "params": int(model.count_params()),
        "tf_peak_mib": None if tf_peak is None else tf_peak / MIB,
        "tf_build_peak_mib": None if tf_build_peak is None else (tf_build_peak - tf_before) / MIB,
        "rss_mib": (peak_kib - baseline_kib) / 1024,
        "step_ms": 1000 * statistics.median(warm),
        "losses": [float(v) for v in warmup.history["loss"] + history.history["loss"]],
        "held_out_loss": held_out,
        "frozen_16bit": len(keras_amp.memory.frozen_16bit(model)),
    }


def _child(case, config, steps, smoke, timeout=1800) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--config", config, "--steps", str(steps)]
    result = workloads.child_json(cmd + (["--smoke"] if smoke else []), timeout)
    return {"case": case, "config": config, **result} if "error" in result else result


def _ratios(r: dict, base: dict | None, *, step: bool) -> str:
    if not base or base is r:
        return "–"
    text = (f"{r['state_bytes']['total'] / base['state_bytes']['total']:.2f} / "
            f"{(r['tf_peak_mib'] or 0) / max(base['tf_peak_mib'] or 0, 1e-9):.2f}")
    return text + (f" / {r['step_ms'] / base['step_ms']:.2f}" if step else "")


def table(results: list[dict]) -> list[str]:
    """Markdown rows: per case, each configuration against the case's stock and float32 runs."""
    rows = ["| case | config | state MiB | state B/trainable param | TF train peak MiB | RSS MiB | step ms "
            "| held-out loss | vs stock: state / TF peak / step | vs float32: state / TF peak |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for case in CASES:
        runs = {r["config"]: r for r in results if r["case"] == case and "error" not in r}
        for config, r in runs.items():
            b = r["state_bytes"]
            per = (b["trainable"] + b["optimizer"]) / max(r["trainable_params"], 1)
            rows.append(f"| {case} | {config} | {b['total'] / MIB:.1f} | {per:.1f} | {r['tf_peak_mib'] or 0:.1f} | "
                        f"{r['rss_mib']:.0f} | {r['step_ms']:.1f} | {r['held_out_loss']:.4f} | "
                        f"{_ratios(r, runs.get('stock'), step=True)} | {_ratios(r, runs.get('float32'), step=False)} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES))
    parser.add_argument("--config", help="one configuration of --case (runs in this process)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--results", help="write the report here (default: benchmarks/LEAN_RESULTS.md, "
                                          "except --smoke and --case)")
    args = parser.parse_args(argv)
    if args.config:
        if not args.case or args.config not in CASES[args.case]:
            parser.error(f"--config must be one of --case's configurations: {CASES.get(args.case)}")
        print(json.dumps(run_one(args.case, args.config, args.steps, args.smoke)))
        return 0
    cases = [args.case] if args.case else list(CASES)
    results = [_child(c, cfg, args.steps, args.smoke) for c in cases for cfg in CASES[c]]
    for r in results:
        if "error" in r:
            print(f"{r['case']} {r['config']} failed:\n{r['error']}", file=sys.stderr)
    lora = {r["config"]: r for r in results if r["case"] == "lora" and "error" not in r}
    if {"amp", "amp_frozen32"} <= set(lora):
        same = lora["amp"]["losses"] == lora["amp_frozen32"]["losses"]
    device = keras_amp.hardware.detect()
    lines = [f"Machine: {device.summary()}; TF {tf.__version__}, Keras {keras.__version__}; {args.steps} steps "
             "per run, one process per configuration, run one after the other (step times are indicative: "
             "not interleaved)."]
    if {"amp", "amp_frozen32"} <= set(lora):
        lines.append(f"lora: {args.steps}-step loss trajectory bit-identical to frozen weights in float32: {same}")
    lines += [""] + table(results)
    print("\n".join(lines))
    results_path = args.results or (None if args.smoke or args.case else os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "LEAN_RESULTS.md"))
    if results_path:
        with open(results_path, "w") as f:
            f.write("# Memory of the weight state (`benchmarks/bench_lean.py`)\n\n" + "\n".join(lines) + "\n")
        print(f"written to {results_path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

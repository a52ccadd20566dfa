"""Step time of one workload under every configuration, measured alternately in one process.

    python benchmarks/bench_time.py transformer --blocks 8 --steps 15 --json out.json

Every configuration is built and traced first (a warm-up `fit` each: tracing, oneDNN primitive
caches), stock and float32 with keras_amp disabled, amp_* after `keras_amp.enable()`. Then blocks:
in each block every configuration runs `fit(steps + 1)` on the same cached, repeated tf.data
input, the order rotated from block to block so drift and neighbours' load hit all alike. A
callback records the interval between consecutive batch ends (the first batch of a fit call, which
includes its setup, is dropped); a block's figure per configuration is the median of its steps.
The JSON holds those per-block medians; `run_all.py` takes medians and the median of per-block
ratios (each ratio compares runs made side by side).

`--forward` also times the inference forward pass alone in every block: `model(x, training=False)` as
one `tf.function` (compiled as the model's steps are), traced after the warm-up in the state the model
was built in, each call timed on its own over the first batches of the same data (the first call of
each block untimed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Sequence

from keras_amp_console import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # the start-up banner filtered out; a TF_CPP_MIN_LOG_LEVEL the user set is kept
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_amp  # noqa: E402
import workloads  # noqa: E402


class BatchTimer(keras.callbacks.Callback):
    """Intervals between consecutive batch ends within one fit call, in seconds: wall clock, and
    the process's CPU time (all threads; less sensitive to other processes' load than wall time,
    though it counts thread-pool spinning too)."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._last: tuple[float, float] | None = None

    def on_train_begin(self, logs=None):
        self._last = None

    def on_train_batch_end(self, batch, logs=None):
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.times.append(now[0] - self._last[0])
            self.cpu_times.append(now[1] - self._last[1])
        self._last = now


def rotated(names: Sequence[str], block: int) -> list[str]:
    """`names` rotated by `block`, so each configuration runs first, second, ... in turn across blocks."""
    k = block % len(names)
    return [*names[k:], *names[:k]]


def fit_block(models: dict[str, keras.Model], data: dict[str, tf.data.Dataset], order: list[str], steps: int,
              callbacks: dict[str, list] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """One measurement block: each model in `order` trains `steps` + 1 batches of its data in one `fit`
    (the first batch's end only starts the clock). Returns the median wall and CPU seconds per batch of each."""
    wall, cpu = {}, {}
    for name in order:
        timer = BatchTimer()
        models[name].fit(data[name], steps_per_epoch=steps + 1, epochs=1, verbose=0, shuffle=False,
                         callbacks=[timer, *(callbacks or {}).get(name, [])])
        wall[name], cpu[name] = statistics.median(timer.times), statistics.median(timer.cpu_times)
    return wall, cpu


def _traces(model: keras.Model) -> int | None:
    """How often the train step was traced (1 expected: no retracing between blocks), or None.

    Keras 3.15's `train_function` is a Python closure over the `tf.function` it calls.
    """
    for cell in getattr(model.train_function, "__closure__", None) or ():
        count = getattr(cell.cell_contents, "experimental_get_tracing_count", None)
        if callable(count):
            return int(count())
    return None


def forward_function(model: keras.Model):
    """The inference forward pass as one `tf.function`, with the model's own `jit_compile`."""
    return tf.function(lambda x: model(x, training=False), jit_compile=bool(model.jit_compile))


def time_calls(fn, inputs: list, count: int) -> tuple[float, float]:
    """Median wall and CPU seconds of `count` calls of `fn`, cycling over `inputs` (each call returns a
    computed eager tensor: the call ends when the work does). One call more runs first, untimed, as the
    first batch of each `fit` is dropped: the first call after another configuration ran is slower
    (tens of milliseconds more, though nothing is traced again)."""
    fn(inputs[0])
    wall, cpu = [], []
    for i in range(count):
        start = (time.perf_counter(), time.process_time())
        fn(inputs[i % len(inputs)])
        wall.append(time.perf_counter() - start[0])
        cpu.append(time.process_time() - start[1])
    return statistics.median(wall), statistics.median(cpu)


def _jit(value: str):
    return {"auto": "auto", "true": True, "false": False}[value]


def run(args: argparse.Namespace) -> dict:
    s = workloads.sizes(args.workload, args.smoke)
    data = workloads.dataset(args.workload, s)
    models, head, rules, forward = {}, {}, {}, {}
    inputs = [x for x, _ in data.take(8)]
    for name in args.configs:
        model = workloads.build(args.workload, name, s, _jit(args.jit))
        # Warm-up in the state the model was built in (keras_amp enabled only for amp_*).
        model.fit(data, steps_per_epoch=args.warmup, epochs=1, verbose=0, shuffle=False)
        if args.forward and "+" not in name:  # variants' forward passes are their base configuration's
            forward[name] = forward_function(model)
            time_calls(forward[name], inputs, args.warmup)
        rules[name] = workloads.op_rules_state()
        models[name], head[name] = model, workloads.head_dtype(args.workload, model)
    keras_amp.disable()
    keras.config.set_dtype_policy("float32")
    names = list(models)
    extra = {name: workloads.training_callbacks(name, data) for name in names}
    blocks: list[dict[str, float]] = []
    cpu_blocks: list[dict[str, float]] = []
    forward_blocks: list[dict[str, float]] = []
    for block in range(args.blocks):
        order = rotated(names, block)
        medians, cpu = fit_block(models, {name: data for name in names}, order, args.steps, extra)
        blocks.append(medians)
        cpu_blocks.append(cpu)
        print(
            f"  {args.workload} block {block}: " + "  ".join(f"{n} {medians[n] * 1e3:.1f}" for n in order) + " ms",
            flush=True,
        )
        if forward:
            forward_blocks.append({n: time_calls(forward[n], inputs, args.steps)[0] for n in order if n in forward})
            print(f"  {args.workload} block {block} forward: "
                  + "  ".join(f"{n} {t * 1e3:.1f}" for n, t in forward_blocks[-1].items()) + " ms", flush=True)
    units, unit_name = workloads.units_per_step(args.workload, s)
    return {
        "workload": args.workload,
        "sizes": dataclasses.asdict(s),
        "configs": names,
        "blocks": blocks,
        "cpu_blocks": cpu_blocks,
        "forward_blocks": forward_blocks,
        "traces": {name: _traces(model) for name, model in models.items()},
        "steps_per_block": args.steps,
        "units_per_step": units,
        "unit": unit_name,
        "head_dtype": head,
        "op_rules": rules,
        "jit_compile": args.jit,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=workloads.WORKLOADS)
    parser.add_argument("--configs", nargs="+", default=workloads.config_names(("bf16",)))
    parser.add_argument("--blocks", type=int, default=8, help="interleaved measurement blocks")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per configuration per block")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per configuration (discarded)")
    parser.add_argument("--jit", choices=("auto", "true", "false"), default="auto", help="compile(jit_compile=)")
    parser.add_argument("--forward", action="store_true",
                        help="also time the inference forward pass alone, in the same blocks")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--json", help="write the result here (default: stdout)")
    args = parser.parse_args(argv)
    for name in args.configs:
        workloads.parse_config(name)
    try:
        result = run(args)
    finally:
        keras_amp.disable()
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

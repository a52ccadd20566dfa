"""keras_amp's benchmark suite: step time, forward-pass time and peak memory of four workloads, one table.

    python benchmarks/run_all.py                  # the recorded figures: benchmarks/RESULTS.md and .png
    QUICK=1 python benchmarks/run_all.py          # fewer blocks and steps (< 3 minutes)
    python benchmarks/run_all.py --smoke          # tiny sizes: checks that everything runs

Workloads and configurations: see `workloads.py` (CNN, Transformer LM, LSTM and GRU LMs; float32,
stock mixed, keras_amp). On a CPU the mixed policy is mixed_bfloat16 (float16 has no fast CPU path; add
it with `--policies bf16 fp16`); on GPUs every policy the weakest GPU runs fast (bf16 from
compute capability 8.0, fp16 from 7.0).

Time: per workload one process (`bench_time.py`) trains every configuration alternately in
interleaved blocks; the table gives the median step and the median over blocks of the per-block
ratios (side-by-side runs, so load on the machine hits both sides of a ratio), and the inference
forward pass alone, timed in the same blocks. Targets: `targets.py`. Memory: every
configuration trains in processes of its own (`bench_memory.py`; medians over them): peak RSS
above the import baseline, TF's allocator peak, and the saved activations (deterministic). Loss
scaling: `bench_loss_scale.py`, keras_amp's LossScaleOptimizer vs Keras's under mixed_float16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import plot_table  # noqa: E402
import report  # noqa: E402
import targets  # noqa: E402
from keras_amp_console import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # before workloads imports TensorFlow: its start-up banner filtered out
import workloads  # noqa: E402

# blocks, steps per block, warm-up steps, memory steps, memory processes per configuration (the
# allocator peak depends on the order the executor runs ops in: medians of several), workloads
# whose memory is measured (None: all) and the kinds of configuration it is measured for, default
# workloads (None: all), default variants.
MODES = {
    "full": dict(blocks=8, steps=15, warmup=3, memory_steps=5, memory_samples=3, memory=None,
                 memory_kinds=("float32", "stock", "amp"), workloads=None, variants=True),
    # Quick, under 3 minutes: a process costs an import and a trace (~13 s), so memory for the
    # Transformer's stock and keras_amp configurations only (float32 in full mode); CNN, Transformer LM
    # and LSTM (GRU in full mode); no variants.
    "quick": dict(blocks=3, steps=5, warmup=2, memory_steps=2, memory_samples=1, memory=("transformer",),
                  memory_kinds=("stock", "amp"), workloads=("cnn", "transformer", "lstm"), variants=False),
    "smoke": dict(blocks=1, steps=2, warmup=1, memory_steps=1, memory_samples=1, memory=None,
                  memory_kinds=("float32", "stock", "amp"), workloads=None, variants=True),
}
LOSS_SCALE_ARGS = {
    "full": [],
    # A device without a fast float16 path (a CPU) emulates it, at very different speeds from one CPU to the next
    # (the quick MLP's step took 0.6 s on one and 6 ms on another): the quick model, and blocks added until 90 s
    # are spent, as a 6 ms step's block ratios spread +-8% and the median needs ~200 blocks to settle near 1%.
    "full_cpu": ["--width", "256", "--batch", "128", "--blocks", "8", "--block-steps", "30", "--warmup", "5",
                 "--seconds", "90"],
    # float16 matmuls are emulated on CPUs (slow): a small MLP keeps QUICK=1 short there.
    "quick": ["--width", "256", "--batch", "128", "--blocks", "3", "--block-steps", "8", "--warmup", "4"],
    "smoke": ["--width", "32", "--depth", "1", "--batch", "8", "--blocks", "2", "--block-steps", "2",
              "--warmup", "1"],
}


def _device():
    from keras_amp import hardware  # noqa: PLC0415 (imports TF; keep --help fast)

    return hardware.detect()


def default_policies(device) -> tuple[str, ...]:
    if device.gpus:
        fast = (("bf16", device.fast_bfloat16), ("fp16", device.fast_float16))
        return tuple(p for p, is_fast in fast if is_fast) or ("fp16",)
    return ("bf16",)


def _child(script: str, args: list[str], timeout: float) -> dict | None:
    """Runs a benchmark script in its own process; its JSON result, or None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(HERE / script), *args, "--json", str(out)]
        start = time.perf_counter()
        try:
            rc = subprocess.call(cmd, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"  {script} {' '.join(args)}: timed out after {timeout:.0f} s", flush=True)
            return None
        if rc or not out.exists():
            print(f"  {script} {' '.join(args)}: failed (exit {rc})", flush=True)
            return None
        what = " ".join(a for a in args[:2] if not a.startswith("-"))
        print(f"  ({script} {what}: {time.perf_counter() - start:.0f} s)", flush=True)
        return json.loads(out.read_text())


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def header(device, mode: str, policies, args, load_start: str) -> list[str]:
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    import keras_amp  # noqa: PLC0415

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = MODES[mode]
    return [
        f"### keras_amp benchmark suite ({mode}), {now}",
        "",
        f"- Machine: {device.summary()}; {os.cpu_count()} logical CPUs; {platform.platform()}.",
        f"- Versions: Python {platform.python_version()}, TensorFlow {tf.__version__}, Keras "
        f"{keras.__version__}, keras_amp {keras_amp.__version__}, NumPy {np.__version__}.",
        f"- Method: per workload one process, configurations {', '.join(workloads.config_names(policies))} "
        f"(and the variants listed) "
        f"trained alternately in {m['blocks']} blocks x {m['steps']} timed steps (warm-up {m['warmup']} "
        f"steps discarded, order rotated), per-batch callback timing, cached repeated tf.data input; "
        f"jit_compile={args.jit}. Memory: each configuration in {m['memory_samples']} process(es) of its own, "
        f"{m['memory_steps']} steps"
        f"{'' if m['memory'] is None else ' (' + ', '.join(m['memory']) + ' only)'}. "
        f"Load average (1/5/15 min) at start: {load_start}; at end: {_load()}.",
    ] + _device_note(device, policies)


def _device_note(device, policies) -> list[str]:
    """A warning line where the measured 16-bit policy has no fast path on this device."""
    slow = [p for p in policies if not (device.fast_bfloat16 if p == "bf16" else device.fast_float16)]
    if not slow:
        return []
    return [f"- This device has no fast {', '.join(workloads.POLICY[p] for p in slow)} path "
            "(CPU: no AVX512-BF16/AMX with oneDNN on; GPU: compute capability): the 16-bit matmuls "
            "are emulated, slower than float32. Ratios vs float32 say nothing about a device with "
            "one; keras_amp vs stock compares the same emulation."]


RESULTS_HEADER = """# Benchmark results

Written by `make bench` (`benchmarks/run_all.py`); each run replaces this file. Ratios are medians
of per-block ratios measured side by side in one run: compare figures only within one table.

"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer blocks and steps (also QUICK=1)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only checks that it runs")
    parser.add_argument("--workloads", nargs="+", choices=workloads.WORKLOADS,
                        help="default: all (QUICK=1: cnn transformer lstm)")
    parser.add_argument("--policies", nargs="+", choices=sorted(workloads.POLICY), help="default: by hardware")
    parser.add_argument("--variants", nargs="*", default=None,
                        help="extra configurations (time only), e.g. amp_bf16+head32, or lstm:amp_bf16+amplstm "
                             "for one workload; default: the CNN with keras_amp's GradientStatistics attached "
                             "and idle (its cost when it does not fire); none under QUICK=1")
    parser.add_argument("--memory-variants", action="store_true", help="measure the variants' memory too")
    parser.add_argument("--jit", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--blocks", type=int, help="override the mode's number of blocks")
    parser.add_argument("--steps", type=int, help="override the mode's timed steps per block")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-loss-scale", action="store_true")
    parser.add_argument("--results", help="write the report here (default: benchmarks/RESULTS.md, except --smoke)")
    parser.add_argument("--json", help="also write every raw result here")
    plot_table.add_arguments(parser)
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("QUICK", "").strip() not in ("", "0")
    mode = "smoke" if args.smoke else "quick" if quick else "full"
    base = MODES[mode]
    m = MODES[mode] = dict(base, blocks=args.blocks or base["blocks"], steps=args.steps or base["steps"])
    args.workloads = args.workloads or list(m["workloads"] or workloads.WORKLOADS)
    results_path = args.results or (None if args.smoke else str(ROOT / "benchmarks" / "RESULTS.md"))
    plot_path = plot_table.planned_path(parser, args, results_path)
    load_start = _load()
    device = _device()
    policies = tuple(args.policies) if args.policies else default_policies(device)
    default_specs = [f"cnn:amp_{policies[0]}+gradstats"] if m["variants"] else []
    specs = args.variants if args.variants is not None else default_specs
    variants: dict[str, list[str]] = {w: [] for w in args.workloads}
    for spec in specs:
        workload, _, name = spec.rpartition(":")
        workloads.parse_config(name)
        if workload and workload not in workloads.WORKLOADS:
            parser.error(f"--variants: unknown workload in {spec!r}; allowed: {', '.join(workloads.WORKLOADS)}")
        for w in [workload] if workload else args.workloads:
            if w in variants and name not in variants[w]:
                variants[w].append(name)
    configs = workloads.config_names(policies)
    smoke = ["--smoke"] if args.smoke else []
    timeout = 3600 if mode == "full" else 900
    failed: list[str] = []

    results, memory = {}, {}
    for workload in args.workloads:
        names = configs + variants[workload]
        print(f"=== time: {workload} ({', '.join(names)})", flush=True)
        res = _child("bench_time.py", [workload, "--configs", *names, "--blocks", str(m["blocks"]),
                                       "--steps", str(m["steps"]), "--warmup", str(m["warmup"]),
                                       "--jit", args.jit, "--forward", *smoke], timeout)
        if res is None:
            failed.append(f"time {workload}")
            continue
        results[workload] = res
    if not args.no_memory:
        for workload in [w for w in args.workloads if m["memory"] is None or w in m["memory"]]:
            kinds = m["memory_kinds"]
            for name in [c for c in configs if workloads.parse_config(c)[0] in kinds] + (
                    variants[workload] if args.memory_variants else []):
                print(f"=== memory: {workload} {name} ({m['memory_samples']} process(es))", flush=True)
                samples = [_child("bench_memory.py", [workload, name, "--steps", str(m["memory_steps"]),
                                                      "--jit", args.jit, *smoke], timeout)
                           for _ in range(m["memory_samples"])]
                samples = [r for r in samples if r is not None]
                if not samples:
                    failed.append(f"memory {workload} {name}")
                else:
                    memory.setdefault(workload, {})[name] = report.median_memory(samples)
    loss_scale = None
    if not args.no_loss_scale:
        print("=== loss scaling (mixed_float16)", flush=True)
        emulated = not device.fast_float16  # no tensor cores: float16 is emulated
        loss_scale = _child("bench_loss_scale.py",
                            LOSS_SCALE_ARGS["full_cpu" if mode == "full" and emulated else mode], timeout)
        if loss_scale is None:
            failed.append("loss scaling")

    text, _ = report.build_table(results, memory, loss_scale, header(device, mode, policies, args, load_start),
                          amx=targets.AMX_FLAG in device.cpu_flags)
    rules = sorted({state for res in results.values() for name, state in res["op_rules"].items()
                    if name.startswith("amp_")})
    text += f"\n\nkeras_amp op-level rules during the amp_* traces: {', '.join(rules) or '–'}."
    retraced = [f"{w}/{n} ({t}x)" for w, res in results.items() for n, t in res.get("traces", {}).items()
                if t is not None and t != 1]
    if retraced:
        text += f"\n\nTraced more than once (timings include retracing): {', '.join(retraced)}."
    if failed:
        text += f"\n\nFailed: {', '.join(failed)}."
    print("\n" + text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"time": results, "memory": memory, "loss_scale": loss_scale}, indent=1))
    if results_path:
        picture = ""
        if plot_path and Path(plot_path).resolve().parent == Path(results_path).resolve().parent:
            picture = f"\n\n![The step-time and memory figures above, as bars]({Path(plot_path).name})"
        Path(results_path).write_text(RESULTS_HEADER + text + picture + "\n")
        print(f"written to {results_path}")
    plot_table.write(plot_path, results, memory, loss_scale, text.splitlines()[:3])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

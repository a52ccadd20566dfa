"""Peak memory of one configuration of one workload, trained in a process of its own.

    python benchmarks/bench_memory.py transformer amp_bf16 --steps 5 --json out.json

Two figures, both taken over model build, compile, tracing and `steps` training steps:

    rss_mib   peak resident set size above the baseline measured after the imports and TF's
              runtime start (one op run). Linux: the kernel's high-water mark (VmHWM) is reset
              through /proc/self/clear_refs at the baseline, so the peak is this phase's own;
              elsewhere ru_maxrss (then the baseline's own peak may hide a smaller one).
    rss_file_mib  of it, the growth of the file-backed part (RssFile; Linux): shared-library code
              paged in, such as XLA's CPU compiler where a configuration compiles with XLA (clean
              pages, shared with other processes and dropped under memory pressure). None elsewhere.
    tf_peak_mib  TensorFlow's allocator peak on the device that trains
              (`tf.config.experimental.get_memory_info(device)["peak"]` after
              `reset_memory_stats`): GPU:0 on a GPU; on CPU, TF 2.21 keeps allocator statistics
              only in its BFC allocator, which oneDNN builds use (AVX-512 CPUs) and
              TF_CPU_ALLOCATOR_USE_BFC=true (set here unless already set) turns on elsewhere, so
              every configuration and CPU is measured with the same allocator. oneDNN's own
              scratch buffers are not in it; they are in rss_mib.

Then, after those figures are taken, one more (deterministic) figure from a trace of the step:

    saved_mib    the forward tensors the backward pass reads, by static shape
              (`keras_amp.diagnostics.saved_activations`): activation memory without the
              allocator's timing; saved_upcast_mib is its float32-upcast part, saved_unsized
              the count of tensors without a static size (an RNN loop's per-step TensorLists,
              not in saved_mib).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # before TF starts: see the docstring
from keras_amp_console import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # the start-up banner filtered out; a TF_CPP_MIN_LOG_LEVEL the user set is kept
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

import keras_amp  # noqa: E402
import workloads  # noqa: E402

MIB = 1 << 20


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_kib() -> int:
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB on Linux


def _device() -> str:
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def _tf_memory(device: str, reset: bool = False) -> int | None:
    try:
        if reset:
            tf.config.experimental.reset_memory_stats(device)
            return None
        return int(tf.config.experimental.get_memory_info(device)["peak"])
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None


def measure(workload: str, name: str, steps: int, smoke: bool, jit) -> dict:
    s = workloads.sizes(workload, smoke)
    device = _device()
    float(tf.reduce_sum(tf.ones((8, 8))))  # start TF's runtime before the baseline
    baseline_kib = _status_kib("VmRSS") or _peak_rss_kib()
    file_before = _status_kib("RssFile")
    hwm_reset = _reset_hwm()
    _tf_memory(device, reset=True)
    tf_before = _tf_memory(device) or 0
    model = workloads.build(workload, name, s, jit)
    data = workloads.dataset(workload, s)
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)
    peak_kib = _peak_rss_kib()
    file_after = _status_kib("RssFile")
    tf_peak = _tf_memory(device)
    x, y = next(iter(data))
    saved = keras_amp.diagnostics.saved_activations(model, x, y)  # same state: keras_amp as built
    keras_amp.disable()
    return {
        "workload": workload,
        "config": name,
        "device": device,
        "rss_mib": (peak_kib - baseline_kib) / 1024,
        "rss_exact": hwm_reset,
        "rss_file_mib": None if file_before is None or file_after is None else (file_after - file_before) / 1024,
        "tf_peak_mib": None if tf_peak is None else (tf_peak - tf_before) / MIB,
        "baseline_rss_mib": baseline_kib / 1024,
        "saved_mib": saved.total_bytes / MIB,
        "saved_upcast_mib": saved.upcast_bytes / MIB,
        "saved_unsized": saved.unsized,
        "params": model.count_params(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=workloads.WORKLOADS)
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--jit", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the result here (default: stdout)")
    args = parser.parse_args(argv)
    workloads.parse_config(args.config)
    jit = {"auto": "auto", "true": True, "false": False}[args.jit]
    text = json.dumps(measure(args.workload, args.config, args.steps, args.smoke, jit))
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

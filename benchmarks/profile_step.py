"""Where a training step's time goes, op by op: matmul/conv, element-wise, casts, reductions, the
optimizer update, data movement.

    python benchmarks/profile_step.py                               # cnn, transformer, lstm; float32 and keras_amp
    python benchmarks/profile_step.py --workloads transformer --configs amp_bf16 stock_bf16
    python benchmarks/profile_step.py --smoke                       # tiny sizes: checks that it runs
    python benchmarks/profile_step.py --forward                     # the inference forward pass instead

Each (workload, configuration) trains in a process of its own on the benchmark's model and cached
batches (benchmarks/workloads.py); after warm-up, `--steps` steps run under TensorFlow's profiler,
and the host's op events (TF executor ops, one per kernel run) are summed by category. Per step:
the wall time, the op time by category (ms and share), and the limit: the step time if only
the matmuls and convolutions cost anything (their share of op time times the wall time). Ops
run on both cores at once, so op time can exceed wall time; shares are of op time. keras_amp's XLA
kernels (attention scores, gelu, the cross-entropy: matmul and element-wise work fused) are their own
category, read from XLA's own events (below). Op time is
also split by phase, from each op's node name: the backward pass (names under the gradient tape or
a gradient function), the optimizer update (under the optimizer's name scope), the forward pass and
loss (under the model's scope or the loss's), and the rest (metrics, the step counter; a custom
gradient other than keras_amp's, which TensorFlow names at the root scope).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

from keras_amp_console import import_tensorflow_quietly, quiet_tensorflow_by_default  # noqa: E402

quiet_tensorflow_by_default()  # TensorFlow is imported in run_one, its banner filtered out there
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Op type -> category. Types not listed are "other" (printed, so the table can grow).
MATMUL = {"MatMul", "_MklMatMul", "BatchMatMulV2", "BatchMatMulV3", "_MklBatchMatMulV2", "Einsum", "_MklEinsum",
          "Conv2D", "_MklConv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "_MklConv2DBackpropInput",
          "_MklConv2DBackpropFilter", "Conv3D", "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
          "DepthwiseConv2dNativeBackpropFilter", "_MklFusedMatMul", "_MklNativeFusedMatMul", "_FusedMatMul",
          "_MklNativeMatMul", "_MklNativeBatchMatMulV2", "_MklNativeConv2D", "_FusedConv2D", "_MklFusedConv2D",
          "_MklNativeFusedConv2D", "_MklNativeConv2DBackpropInput", "_MklNativeConv2DBackpropFilter",
          "_MklFusedBatchMatMulV2", "_MklNativeFusedBatchMatMulV2"}
CAST = {"Cast", "_MklCast", "Bitcast"}
REDUCE = {"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin", "BiasAddGrad", "L2Loss",
          "_MklLayerNorm", "FusedBatchNormV3", "FusedBatchNormGradV3", "_MklFusedBatchNormV3",
          "_MklFusedBatchNormGradV3", "SparseSoftmaxCrossEntropyWithLogits", "Softmax", "LogSoftmax"}
UPDATE = {"ResourceApplyAdam", "ResourceApplyAdamWithAmsgrad", "AssignVariableOp", "AssignAddVariableOp",
          "AssignSubVariableOp", "ReadVariableOp", "ResourceApplyGradientDescent", "ResourceGather"}
MOVE = {"Reshape", "Transpose", "_MklTranspose", "ConcatV2", "Concat", "Pack", "Unpack", "Split", "SplitV", "Slice",
        "StridedSlice", "StridedSliceGrad", "GatherV2", "Tile", "BroadcastTo", "Pad", "PadV2", "Identity",
        "IdentityN", "ExpandDims", "Squeeze", "Fill", "ZerosLike", "OnesLike", "Const", "Shape", "ShapeN",
        "ScatterNd", "TensorScatterUpdate", "UnsortedSegmentSum", "IteratorGetNext", "Select", "SelectV2",
        "Range", "ReverseV2", "OptionalGetValue"}
XLA = {"XlaLaunch", "_XlaRun", "_XlaCompile", "XlaLaunchV2"}
PHASES = ("forward", "backward", "update", "other")
CATEGORIES = ("matmul/conv", "element-wise", "cast", "reduction/norm/softmax", "optimizer update",
              "data movement", "XLA kernels")
_CONTROL = {"_Recv", "_Send", "NoOp", "Placeholder", "_Arg", "_Retval", "Enter", "Exit", "Merge", "Switch",
            "NextIteration", "LoopCond", "While", "StatelessWhile", "If", "StatelessIf", "PartitionedCall",
            "StatefulPartitionedCall", "__inference", "_MklToTf", "_HostRecv", "_HostSend"}


def category(op_type: str) -> str | None:
    """The category of an op type; None for control flow and function calls (their bodies count)."""
    if op_type in _CONTROL or op_type.startswith("__inference"):
        return None
    if op_type in MATMUL:
        return "matmul/conv"
    if op_type in XLA:  # the attention-score kernels: matmul and element-wise work in one
        return "XLA kernels"
    if op_type in CAST:
        return "cast"
    if op_type in REDUCE or "BatchNorm" in op_type or "LayerNorm" in op_type:
        return "reduction/norm/softmax"
    if op_type in UPDATE or op_type.startswith("ResourceApply"):
        return "optimizer update"
    if op_type in MOVE:
        return "data movement"
    return "element-wise"


# A TF op's event is named "<node name>:<op type>" (node names hold no ':'); executor and thread-pool
# events ("ExecutorState::Process", ...) are not ops.
_OP = re.compile(r"^([^:]+):([A-Za-z_][A-Za-z_0-9]*)$")
_BACKWARD = re.compile(r"(^|/)(gradient_tape|gradients)/|_grad/")


def _unsuffixed(scope: str) -> str:
    return re.sub(r"_\d+$", "", scope)


def phase(node: str, model_scope: str, optimizer_scopes: frozenset[str]) -> str:
    """The phase of the step an op's node name places it in (see the module docstring)."""
    if _BACKWARD.search(node):
        return "backward"
    # Scopes are uniquified when traced again ("adam_1"): a segment is the scope or it plus "_<n>".
    segments = {_unsuffixed(seg) for seg in node.split("/")}
    if segments & {_unsuffixed(scope) for scope in optimizer_scopes}:
        return "update"
    if _unsuffixed(model_scope) in segments or "compile_loss" in segments:
        return "forward"
    return "other"


# TF 2.21 runs an XLA computation as no TF op: its call is an asynchronous kernel
# ("ExecutorState::ProcessAsync::Start", its node name a stat), the computation one
# "CpuExecutable::ExecuteAsyncOnStream" span on the calling thread (its parallel parts run on the
# Eigen pool inside that span, as a oneDNN op's threads do), and inside it each HLO kernel an event
# named after its instruction ("dot.1", "multiply_convert_fusion"), whose "hlo_module" stat names
# the compiled function: "a_inference__scores_gradient_compiled_1702__.2".
_XLA_RUN = "CpuExecutable::ExecuteAsyncOnStream"
_ASYNC_START = "ExecutorState::ProcessAsync::Start"
_HLO = re.compile(r"^[a-z][a-z0-9_\-]*(\.\d+)*$")
_XLA_FUNCTION = re.compile(r"^a_inference_|_\d+__(\.\d+)*$")


def _enclosing(calls: list[tuple[int, int, str]], starts: list[int], start: int, end: int) -> str | None:
    """The node name of the innermost call (of `calls`, sorted; `starts` their starts) whose span holds
    [start, end]: the latest-starting one."""
    i = bisect.bisect_right(starts, start) - 1
    while i >= 0:
        if calls[i][1] >= end:
            return calls[i][2]
        i -= 1
    return None


def _add_xla_runs(runs, calls, launches, hlo, by_cat, by_type, by_phase, phase_of) -> None:
    """Adds each XLA computation's run on one thread (`runs`: (start, end)) to the totals: its phase
    is its enclosing call's (else its function's name's: keras_amp names its compiled gradients
    *backward*/*gradient*), its type "XLA <function>" from the first HLO kernel inside it."""
    calls, launches = sorted(calls), sorted(launches)
    call_starts, launch_starts = [c[0] for c in calls], [c[0] for c in launches]
    hlo_starts = [h[0] for h in hlo]
    for start, end in runs:
        if _enclosing(launches, launch_starts, start, end) is not None:
            continue
        seconds = (end - start) * 1e-12
        i = bisect.bisect_left(hlo_starts, start)
        module = hlo[i][1] if i < len(hlo) and hlo[i][0] <= end else ""
        function = _XLA_FUNCTION.sub("", module) or "?"
        by_cat["XLA kernels"] += seconds
        by_type["XLA " + function] += seconds
        node = _enclosing(calls, call_starts, start, end)
        if node is not None:
            by_phase[phase_of(node)] += seconds
        else:
            by_phase["backward" if re.search("backward|grad", function) else "forward"] += seconds


def op_times(logdir: str, model_scope: str = "", optimizer_scopes: frozenset[str] = frozenset()
             ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(seconds per category, per op type, per phase) from the profiler's XPlane files under `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

    by_cat: dict[str, float] = collections.defaultdict(float)
    by_type: dict[str, float] = collections.defaultdict(float)
    by_phase: dict[str, float] = collections.defaultdict(float)
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            if plane.name != "/host:CPU":
                continue
            names = {k: m.name for k, m in plane.event_metadata.items()}
            stat_names = {k: m.name for k, m in plane.stat_metadata.items()}

            def text(stat):  # a string stat: inline, or interned as a stat metadata's name
                return stat_names.get(stat.ref_value, "") if stat.ref_value else stat.str_value

            for line in plane.lines:
                if not line.name.startswith("tf_Compute") and "TfOp" not in line.name and line.name != "TF Ops":
                    continue
                # calls: (start, end, node) of function calls, XLA's included ("ProcessAsync::Start",
                # its node name a stat); runs: XLA computations on the calling thread; hlo: (start, module)
                calls, launches, runs, hlo = [], [], [], []
                for event in line.events:
                    name = names.get(event.metadata_id, "")
                    span = (event.offset_ps, event.offset_ps + event.duration_ps)
                    match = _OP.match(name)
                    if not match:
                        stats = {stat_names.get(st.metadata_id): st for st in event.stats}
                        if name == _XLA_RUN:
                            runs.append(span)
                        elif name == _ASYNC_START and "name" in stats:
                            calls.append((*span, text(stats["name"])))
                        elif _HLO.match(name) and "hlo_module" in stats:
                            hlo.append((span[0], text(stats["hlo_module"])))
                        continue
                    node, op_type = match.groups()
                    cat = category(op_type)
                    seconds = event.duration_ps * 1e-12
                    if cat is None:  # a call's body's ops count; the call's span is kept apart
                        by_type["(calls) " + op_type] += seconds
                        calls.append((*span, node))
                        continue
                    by_cat[cat] += seconds
                    by_type[op_type] += seconds
                    by_phase[phase(node, model_scope, optimizer_scopes)] += seconds
                    if op_type in XLA:  # a cluster's op event: its computation's time, counted once (here)
                        launches.append((*span, node))
                _add_xla_runs(runs, calls, launches, sorted(hlo), by_cat, by_type, by_phase,
                              lambda node: phase(node, model_scope, optimizer_scopes))
    return dict(by_cat), dict(by_type), dict(by_phase)


def run_one(workload: str, config: str, steps: int, smoke: bool, forward: bool = False) -> dict:
    """One configuration's profile: of `steps` training steps, or with `forward` of as many inference
    forward passes (`bench_time.forward_function`, on one cached batch)."""
    import_tensorflow_quietly()
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    import workloads  # noqa: PLC0415

    s = workloads.sizes(workload, smoke=smoke)
    model = workloads.build(workload, config, s)
    data = workloads.dataset(workload, s)
    batch = next(iter(data))
    model.fit(data, steps_per_epoch=3, epochs=1, verbose=0)  # traces, builds the optimizer
    if forward:
        import bench_time  # noqa: PLC0415

        call, x = bench_time.forward_function(model), batch[0]
        run = lambda: call(x)  # noqa: E731
    else:
        step, iterator = model.make_train_function(), iter(data.repeat())
        run = lambda: step(iterator)["loss"]  # noqa: E731
    for _ in range(3):
        run()
    logdir = tempfile.mkdtemp(prefix="profile_step_")
    tf.profiler.experimental.start(logdir)
    start = time.perf_counter()
    for _ in range(steps):
        out = run()
    keras.ops.convert_to_numpy(out)
    wall = (time.perf_counter() - start) / steps
    tf.profiler.experimental.stop()
    optimizer = model.optimizer
    scopes = frozenset(o.name for o in (optimizer, getattr(optimizer, "inner_optimizer", None)) if o is not None)
    by_cat, by_type, by_phase = op_times(logdir, model.name, scopes)
    return {"workload": workload, "config": config, "steps": steps, "wall_ms": wall * 1e3,
            "ms": {c: by_cat.get(c, 0.0) / steps * 1e3 for c in CATEGORIES},
            "phase_ms": {p: by_phase.get(p, 0.0) / steps * 1e3 for p in PHASES},
            "top_types": sorted(((t, v / steps * 1e3) for t, v in by_type.items()), key=lambda x: -x[1])[:12]}


def table(results: list[dict]) -> list[str]:
    rows = ["| workload | config | wall ms/step | op ms/step | " + " | ".join(CATEGORIES)
            + " | limit ms/step (matmul/conv alone) |",
            "|---|---|---|---|" + "---|" * len(CATEGORIES) + "---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['workload']} | {r['config']} | failed | | " + " | " * len(CATEGORIES))
            continue
        total = sum(r["ms"].values()) or 1e-9
        shares = " | ".join(f"{r['ms'][c]:.1f} ({100 * r['ms'][c] / total:.0f}%)" for c in CATEGORIES)
        # Ops overlap on the two cores: the matmul/conv-only step is their share of the wall time.
        limit = r["wall_ms"] * r["ms"]["matmul/conv"] / total
        rows.append(f"| {r['workload']} | {r['config']} | {r['wall_ms']:.1f} | {total:.1f} | {shares} | {limit:.1f} |")
    return rows


def phase_table(results: list[dict]) -> list[str]:
    """Op ms per step by phase (forward + loss, backward, optimizer update, the rest)."""
    rows = ["| workload | config | " + " | ".join(PHASES) + " |", "|---|---|" + "---|" * len(PHASES)]
    for r in results:
        if "error" not in r:
            total = sum(r["phase_ms"].values()) or 1e-9
            rows.append(f"| {r['workload']} | {r['config']} | " + " | ".join(
                f"{r['phase_ms'][p]:.1f} ({100 * r['phase_ms'][p] / total:.0f}%)" for p in PHASES) + " |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["cnn", "transformer", "lstm"])
    parser.add_argument("--configs", nargs="+", default=["float32", "stock_bf16", "amp_bf16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--forward", action="store_true",
                        help="profile the inference forward pass (model(x, training=False)), not the training step")
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*args.one, args.steps, args.smoke, args.forward)))
        return 0
    import_tensorflow_quietly()
    import keras_amp  # noqa: PLC0415
    import workloads  # noqa: PLC0415

    results = []
    for w in args.workloads:
        for c in args.configs:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", w, c, "--steps", str(args.steps)]
            cmd += (["--smoke"] if args.smoke else []) + (["--forward"] if args.forward else [])
            result = workloads.child_json(cmd)
            results.append({"workload": w, "config": c, **result} if "error" in result else result)
            if "error" in results[-1]:
                print(f"{w} {c} failed:\n{results[-1]['error']}", file=sys.stderr)
    print(f"Machine: {keras_amp.hardware.detect().summary()}; {os.cpu_count()} logical CPUs; "
          f"{args.steps} profiled {'inference forward passes' if args.forward else 'training steps'} per run")
    print("\n".join(table(results)))
    print("\nOp ms per step by phase:")
    print("\n".join(phase_table(results)))
    for r in results:
        if "error" not in r:
            print(f"{r['workload']} {r['config']} top op types (ms/step): "
                  + ", ".join(f"{t} {v:.1f}" for t, v in r["top_types"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a training step's time goes, op by op: matmul/conv, element-wise, casts, reductions, the
optimizer update, data movement.

    python benchmarks/profile_step.py                               # cnn, transformer, lstm; float32 and keras_amp
    python benchmarks/profile_step.py --workloads transformer --configs amp_bf16 stock_bf16
    python benchmarks/profile_step.py --smoke                       # tiny sizes: checks that it runs

Each (workload, configuration) trains in a process of its own on the benchmark's model and cached
batches (benchmarks/workloads.py); after warm-up, `--steps` steps run under TensorFlow's profiler,
and the host's op events (TF executor ops, one per kernel run) are summed by category. Per step:
the wall time, the op time by category (ms and share), and the limit: the step time if only
the matmuls and convolutions cost anything (their share of op time times the wall time). Ops
run on both cores at once, so op time can exceed wall time; shares are of op time. The XLA
attention-score kernels are their own category (matmul and element-wise work fused).
"""

from __future__ import annotations

import argparse
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
_OP = re.compile(r"^[^:]+:([A-Za-z_][A-Za-z_0-9]*)$")


def op_times(logdir: str) -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per category, seconds per op type) from the profiler's XPlane files under `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

    by_cat: dict[str, float] = collections.defaultdict(float)
    by_type: dict[str, float] = collections.defaultdict(float)
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            if plane.name != "/host:CPU":
                continue
            names = {k: m.name for k, m in plane.event_metadata.items()}
            for line in plane.lines:
                if not line.name.startswith("tf_Compute") and "TfOp" not in line.name and line.name != "TF Ops":
                    continue
                for event in line.events:
                    name = names.get(event.metadata_id, "")
                    match = _OP.match(name)
                    if not match:
                        continue
                    op_type = match.group(1)
                    cat = category(op_type)
                    seconds = event.duration_ps * 1e-12
                    if cat is None:  # a call's body's ops count; the call's span is kept apart
                        by_type["(calls) " + op_type] += seconds
                        continue
                    by_cat[cat] += seconds
                    by_type[op_type] += seconds
    return dict(by_cat), dict(by_type)


def run_one(workload: str, config: str, steps: int, smoke: bool) -> dict:
    import_tensorflow_quietly()
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    import workloads  # noqa: PLC0415

    s = workloads.sizes(workload, smoke=smoke)
    model = workloads.build(workload, config, s)
    data = workloads.dataset(workload, s)
    batch = next(iter(data))
    model.fit(data, steps_per_epoch=3, epochs=1, verbose=0)  # traces, builds the optimizer
    step = model.make_train_function()
    iterator = iter(data.repeat())
    for _ in range(3):
        step(iterator)
    logdir = tempfile.mkdtemp(prefix="profile_step_")
    tf.profiler.experimental.start(logdir)
    start = time.perf_counter()
    for _ in range(steps):
        logs = step(iterator)
    keras.ops.convert_to_numpy(logs["loss"])
    wall = (time.perf_counter() - start) / steps
    tf.profiler.experimental.stop()
    by_cat, by_type = op_times(logdir)
    del batch
    return {"workload": workload, "config": config, "steps": steps, "wall_ms": wall * 1e3,
            "ms": {c: by_cat.get(c, 0.0) / steps * 1e3 for c in CATEGORIES},
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["cnn", "transformer", "lstm"])
    parser.add_argument("--configs", nargs="+", default=["float32", "stock_bf16", "amp_bf16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*args.one, args.steps, args.smoke)))
        return 0
    import keras_amp  # noqa: PLC0415
    import workloads  # noqa: PLC0415

    results = []
    for w in args.workloads:
        for c in args.configs:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", w, c, "--steps", str(args.steps)]
            result = workloads.child_json(cmd + (["--smoke"] if args.smoke else []))
            results.append({"workload": w, "config": c, **result} if "error" in result else result)
            if "error" in results[-1]:
                print(f"{w} {c} failed:\n{results[-1]['error']}", file=sys.stderr)
    print(f"Machine: {keras_amp.hardware.detect().summary()}; {os.cpu_count()} logical CPUs; "
          f"{args.steps} profiled steps per run")
    print("\n".join(table(results)))
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

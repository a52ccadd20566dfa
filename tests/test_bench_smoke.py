"""The benchmark suite runs end to end (smoke mode: tiny sizes, no figure asserted), and draws its picture."""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import workloads  # noqa: E402

# TensorFlow's start-up banner: absl's notice and INFO lines written before absl is initialised.
BANNER = re.compile(r"^(I\d{4} .*\] |WARNING: All log messages before absl)", re.M)


@pytest.mark.slow
@pytest.mark.parametrize("workload", workloads.WORKLOADS)
def test_every_configuration_builds(workload):
    s = workloads.sizes(workload, smoke=True)
    for name in workloads.config_names(("bf16", "fp16"), ("amp_bf16+head32", "amp_bf16+logits")):
        model = workloads.build(workload, name, s)
        assert model.compiled, name
        if name.startswith("amp_") and "+" not in name:
            assert model.get_layer(workloads.HEAD[workload]) is not None


@pytest.mark.slow
def test_lean_variants_train_with_lean_adam():
    import keras_amp  # noqa: PLC0415

    s = workloads.sizes("transformer", smoke=True)
    for name, compensation in (("amp_bf16+lean", None), ("amp_bf16+leansr", "stochastic")):
        model = workloads.build("transformer", name, s)
        optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        assert isinstance(optimizer, keras_amp.optimizers.LeanAdam) and optimizer.compensation == compensation
        model.fit(workloads.dataset("transformer", s), steps_per_epoch=1, epochs=1, verbose=0)
        assert keras_amp.memory.storage_dtype(model.get_layer(workloads.HEAD["transformer"]).kernel) == "bfloat16"
    keras_amp.disable()


def test_unknown_configuration_is_refused():
    with pytest.raises(ValueError, match="Received: name='amp_int8'"):
        workloads.parse_config("amp_int8")


@pytest.mark.slow
def test_suite_prints_the_table(tmp_path):
    # TF_CPP_MIN_LOG_LEVEL unset, as a user runs it: the suite and each benchmark it starts filter the banner.
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_AMP_QUIET_TF")}
    env["QUICK"] = ""
    results = ROOT / "benchmarks" / "RESULTS.md"
    before = results.read_bytes() if results.exists() else None
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--workloads", "transformer",
         "--variants", "amp_bf16+logits", "--json", str(tmp_path / "raw.json"),
         "--results", str(tmp_path / "RESULTS.md")],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not BANNER.search(proc.stderr), proc.stderr[:3000]
    out = proc.stdout
    assert "keras_amp benchmark suite (smoke)" in out
    assert "TensorFlow" in out and "Keras" in out and "Machine:" in out
    for name in ("float32", "stock_bf16", "amp_bf16", "amp_bf16+logits"):
        assert f"| transformer | {name} |" in out
    assert "Targets" in out and "loss scaling keras_amp/stock" in out
    assert re.search(r"2 blocks x 2 steps\): .* \(middle half of the blocks \d\.\d{3}–\d\.\d{3}\)", out), out
    assert "transformer amp_bf16/float32 forward pass: " in out  # issue 26's forward-pass floor
    forward = out[out.index("Forward pass alone"):].split("\n\n")[1]  # the forward table
    rows = [line.split(" | ")[1] for line in forward.splitlines() if line.startswith("| transformer |")]
    assert rows == ["float32", "stock_bf16", "amp_bf16"], forward  # variants' forward passes are their base's
    assert (tmp_path / "raw.json").exists()
    written = (tmp_path / "RESULTS.md").read_text()
    assert written.startswith("# Benchmark results") and "| transformer | amp_bf16 |" in written
    assert (results.read_bytes() if results.exists() else None) == before  # only where --results says
    # The picture beside the report, from the same raw results; plot_table.py redraws it from --json.
    assert f"picture: {tmp_path / 'RESULTS.png'}" in out
    assert_png(tmp_path / "RESULTS.png")
    assert written.rstrip().endswith("(RESULTS.png)")  # the report shows its picture
    import plot_table  # noqa: PLC0415  (benchmarks/ is on sys.path above)

    raw = json.loads((tmp_path / "raw.json").read_text())
    figure = plot_table.plot(raw["time"], raw["memory"], raw["loss_scale"], ["smoke"], tmp_path / "again.png")
    assert_png(tmp_path / "again.png")
    time_ax, peak_ax, rss_ax = figure.axes
    assert len(time_ax.patches) == len(raw["time"]["transformer"]["configs"]) == 4
    heights = [p.get_height() for p in time_ax.patches]
    assert heights[0] == 1.0 and all(h > 0 for h in heights)  # float32 / float32, then the others' ratios
    assert [p.get_height() for p in peak_ax.patches] == [m["tf_peak_mib"] for m in raw["memory"]["transformer"].values()]
    if sys.platform.startswith("linux"):  # RssFile: the mapped files each configuration paged in
        assert all(m["rss_file_mib"] is not None for m in raw["memory"]["transformer"].values())


def _block(**ms):
    return {name: value / 1e3 for name, value in ms.items()}


def test_targets_are_issue_26s_floors_with_the_forward_pass_and_the_machine_said():
    import report  # noqa: PLC0415  (benchmarks/ is on sys.path above)

    blocks = [_block(float32=100, stock_bf16=80, amp_bf16=60), _block(float32=100, stock_bf16=70, amp_bf16=56)]
    results = {"transformer": {
        "configs": ["float32", "stock_bf16", "amp_bf16"], "blocks": blocks, "cpu_blocks": blocks,
        "forward_blocks": [_block(float32=40, stock_bf16=30, amp_bf16=28)] * 2, "units_per_step": 4096,
        "unit": "tokens", "head_dtype": {}}}
    text, found = report.build_table(results, {}, None, ["header"], amx=False)
    assert found == [
        "transformer amp_bf16/stock_bf16 time: 0.775 (target <= 1.0) OK (CPU time: 0.775)",
        "transformer amp_bf16/float32 time: 0.580 (target <= 0.55) MISSED",
        "transformer amp_bf16/float32 forward pass: 0.700 (target <= 0.6) MISSED",
    ]
    assert "| transformer | amp_bf16 | 28.0 | 0.700 | 0.933 | 0.933–0.933 |" in text
    assert "this machine has none, so they are shown for reference only" in text
    assert "shown for reference" not in report.build_table(results, {}, None, [], amx=True)[0]
    del results["transformer"]["forward_blocks"]  # a result without forward timing: no forward table or floor
    text, found = report.build_table(results, {}, None, [], amx=True)
    assert "Forward pass alone" not in text and not any("forward" in t for t in found)


def test_rss_is_shown_with_and_without_the_mapped_files_paged_in():
    import report  # noqa: PLC0415

    def mem(rss, files, peak):
        return report.median_memory([{"rss_mib": rss, "rss_file_mib": files, "tf_peak_mib": peak, "saved_mib": 10.0}])

    memory = {"gru": {"float32": mem(200, 10, 100), "stock_bf16": mem(250, 15, 160), "amp_bf16": mem(275, 70, 125)}}
    text, found = report.build_table({}, memory, None, [], amx=False)
    assert "gru amp_bf16/stock_bf16 RSS: 1.100 (target <= 1.03) MISSED (less mapped files: 0.872)" in found
    assert "gru amp_bf16/float32 RSS: 1.375 (target <= 0.7) MISSED (less mapped files: 1.079)" in found
    assert "gru amp_bf16/stock_bf16 TF peak: 0.781 (target <= 1.03) OK (saved activations: 1.000)" in found
    assert "| gru | amp_bf16 | 275 (70) | 125 |" in text
    del memory["gru"]["stock_bf16"]["rss_file_mib"]  # a figure from a machine without RssFile: RSS alone
    found = report.build_table({}, memory, None, [], amx=False)[1]
    assert "gru amp_bf16/stock_bf16 RSS: 1.100 (target <= 1.03) MISSED" in found


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, (path, len(data))


def test_picture_needs_a_measurement():
    import plot_table  # noqa: PLC0415

    with pytest.raises(ValueError, match="`results` or `memory` must hold a measured workload"):
        plot_table.plot({}, {}, None, ["nothing"])


def _planned_runs(argv):
    """The child processes `run_all.main(argv)` would start: {script: [args, ...]}, none run."""
    import run_all  # noqa: PLC0415  (benchmarks/ is on sys.path above)

    captured = {}
    real = run_all._child

    def fake_child(script, args, timeout):
        captured.setdefault(script, []).append(args)
        return None  # no measurement: only which configurations would run

    run_all._child = fake_child
    try:  # the (empty) report goes to a temporary folder, not benchmarks/RESULTS.md
        with tempfile.TemporaryDirectory() as tmp:
            run_all.main([*argv, "--results", os.path.join(tmp, "RESULTS.md")])
    except SystemExit:
        pass
    finally:
        run_all._child = real
    return captured


@pytest.mark.slow
def test_default_suite_includes_the_idle_gradient_statistics_variant():
    captured = _planned_runs(["--smoke", "--workloads", "cnn", "--no-memory", "--no-loss-scale"])
    assert any("amp_bf16+gradstats" in a for calls in captured.values() for args in calls for a in args), captured


@pytest.mark.slow
def test_quick_mode_times_the_three_workloads_without_variants(monkeypatch):
    # QUICK=1 must stay under 3 minutes: CNN, Transformer LM and LSTM, no variants, memory for one.
    monkeypatch.setenv("QUICK", "1")
    captured = _planned_runs(["--no-loss-scale"])
    timed = [args[0] for args in captured["bench_time.py"]]
    assert timed == ["cnn", "transformer", "lstm"], captured
    assert not any("+" in a for args in captured["bench_time.py"] for a in args), captured
    assert [args[:2] for args in captured["bench_memory.py"]] == [
        ["transformer", "stock_bf16"], ["transformer", "amp_bf16"]], captured
    monkeypatch.delenv("QUICK")
    full = _planned_runs(["--no-memory", "--no-loss-scale"])
    assert [args[0] for args in full["bench_time.py"]] == list(workloads.WORKLOADS)


@pytest.mark.slow
def test_loss_scale_benchmark_adds_pairs_of_blocks_until_its_seconds_are_spent(tmp_path):
    script = [sys.executable, str(ROOT / "benchmarks" / "bench_loss_scale.py")]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    tiny = ["--width", "16", "--depth", "1", "--batch", "4", "--block-steps", "2", "--warmup", "1"]
    bad = subprocess.run([*script, *tiny, "--seconds", "-1"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "--seconds must be a number >= 0. Received: -1.0" in bad.stderr, bad.stderr
    bad = subprocess.run([*script, "--block-steps", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "--block-steps must be an integer >= 2. Received: 1" in bad.stderr, bad.stderr
    start = time.perf_counter()
    proc = subprocess.run([*script, *tiny, "--blocks", "1", "--seconds", "3", "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    # Past the one block asked for: pairs (each optimizer first equally often) until 3 s of blocks.
    assert result["blocks"] >= 4 and result["blocks"] % 2 == 0, result
    assert len(result["block_ratios"]) == result["blocks"]
    assert time.perf_counter() - start >= 3


@pytest.mark.slow
def test_search_figures_script_prints_its_table():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_search.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    rows = {row[0]: row for row in lines if row and row[0] in ("transformer", "cnn")}
    assert set(rows) == {"transformer", "cnn"}, proc.stdout
    assert all(float(row[1]) > 0 for row in rows.values())  # the search took measurable time


@pytest.mark.slow
def test_lean_benchmark_lora_case_is_bit_identical_and_smaller(tmp_path):
    """bench_lean's LoRA case (smoke sizes): frozen weights in bfloat16 train bit for bit as in float32."""
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_lean.py"), "--smoke", "--case", "lora", "--steps", "6",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "bit-identical to frozen weights in float32: True" in proc.stdout, proc.stdout
    assert "Machine: " in proc.stdout and "| lora | amp |" in proc.stdout
    runs = {r["config"]: r for r in json.loads(out.read_text())}
    assert len(runs["amp"]["losses"]) == 6 and runs["amp"]["losses"] == runs["amp_frozen32"]["losses"]
    # The frozen base weights are half the bytes: the state is below stock's (float32 frozen weights).
    assert runs["amp"]["state_bytes"]["total"] < 0.8 * runs["stock"]["state_bytes"]["total"]
    assert runs["amp_frozen32"]["state_bytes"]["total"] == runs["stock"]["state_bytes"]["total"]


@pytest.mark.parametrize("node, expected", [
    # Names as TF 2.21's profiler gives them for the benchmark models (scopes uniquified when retraced).
    ("StatefulPartitionedCall/transformer_lm_1/block_0_1/attn_1/MatMul:_MklBatchMatMulV2", "forward"),
    ("StatefulPartitionedCall/compile_loss/sparse_categorical_crossentropy/Sum", "forward"),
    ("StatefulPartitionedCall/gradient_tape/transformer_lm_1/block_0_1/ffn_1/MatMul_1", "backward"),
    ("StatefulPartitionedCall/lstm_lm_1/lstm_0_1/while/body/_36/lstm_lm_1/lstm_0_1/while/gradient_tape/x/"
     "TensorListGetItem_grad/TensorListLength", "backward"),  # a gradient accumulator in the forward loop
    ("StatefulPartitionedCall/x/IdentityN_grad/MatMul", "backward"),
    ("StatefulPartitionedCall/adam/UnsortedSegmentSum_1", "update"),
    ("StatefulPartitionedCall/loss_scale_optimizer_2/Select", "update"),
    ("StatefulPartitionedCall/MatMul_10", "other"),  # a custom gradient's op, named outside any scope
    ("StatefulPartitionedCall/AssignVariableOp_2", "other"),
])
def test_step_profile_phase_of_an_op_by_its_node_name(node, expected):
    import profile_step  # noqa: PLC0415  (benchmarks/ is on sys.path above)

    scopes = frozenset({"loss_scale_optimizer", "adam"})
    assert profile_step.phase(node, "transformer_lm" if "transformer" in node else "lstm_lm", scopes) == expected


@pytest.mark.parametrize("module, function", [
    ("a_inference__scores_gradient_compiled_1702__.2", "_scores_gradient_compiled"),
    ("a_inference_backward_1554__.1", "backward"),
    ("a_inference__probabilities_compiled_742__", "_probabilities_compiled"),
])
def test_step_profile_names_an_xla_kernels_function_from_its_module(module, function):
    import profile_step  # noqa: PLC0415

    assert profile_step._XLA_FUNCTION.sub("", module) == function
    assert profile_step._HLO.match("wrapped_reduce-window.1") and profile_step._HLO.match("dot.1")
    assert not profile_step._HLO.match("ExecutorState::ProcessAsync::Start")


def test_step_profile_places_each_xla_run_by_its_call_and_names_it_by_its_function():
    import collections  # noqa: PLC0415

    import profile_step  # noqa: PLC0415

    calls = [(0, 100, "StatefulPartitionedCall/m_1/ffn_in_0_1/PartitionedCall"),
             (200, 300, "StatefulPartitionedCall/gradient_tape/m_1/mha_0_1/PartitionedCall")]
    hlo = [(10, "a_inference_forward_434__.1"), (210, "a_inference__scores_gradient_compiled_1702__.2"),
           (410, "a_inference_backward_1554__.1"), (610, "a_inference_forward_9__")]
    runs = [(5, 95), (205, 295), (405, 495), (605, 695)]
    launches = [(600, 700, "x:XlaLaunch")]  # a cluster's op event already holds that run: not counted twice
    by_cat, by_type, by_phase = (collections.defaultdict(float) for _ in range(3))
    profile_step._add_xla_runs(runs, calls, launches, hlo, by_cat, by_type, by_phase,
                               lambda node: profile_step.phase(node, "m", frozenset({"adam"})))
    ps = 1e-12
    assert by_cat == pytest.approx({"XLA kernels": 270 * ps})
    assert by_type == pytest.approx({"XLA forward": 90 * ps, "XLA _scores_gradient_compiled": 90 * ps,
                                     "XLA backward": 90 * ps})
    # The third run has no call around it: keras_amp's compiled gradient is named "backward".
    assert by_phase == pytest.approx({"forward": 90 * ps, "backward": 180 * ps})


@pytest.mark.slow
def test_step_profile_sums_the_ops_by_category(tmp_path):
    """profile_step.py (smoke sizes): the profiler's op events are read and the matmuls are found."""
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--smoke", "--workloads", "transformer",
         "--configs", "amp_bf16", "--steps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())
    assert run["ms"]["matmul/conv"] > 0 and run["wall_ms"] > 0, run
    assert any(t.startswith("_Mkl") or "MatMul" in t for t, _ in run["top_types"]), run["top_types"]
    assert "| transformer | amp_bf16 |" in proc.stdout and "Machine: " in proc.stdout
    # Every op lands in one phase; the forward pass, the backward pass and the update are each found.
    assert sum(run["phase_ms"].values()) == pytest.approx(sum(run["ms"].values()), rel=1e-6)
    assert min(run["phase_ms"][p] for p in ("forward", "backward", "update")) > 0, run["phase_ms"]
    assert "Op ms per step by phase:" in proc.stdout
    # keras_amp's XLA kernels (scores, gelu, cross-entropy) are read from XLA's own events, by function.
    assert run["ms"]["XLA kernels"] > 0, run["ms"]

"""Every example in a smoke mode (a few steps, tiny sizes): offline data, and tfds through mock_data.

Each run is a subprocess (absl flags, fresh global state). The tfds runs go through
`tfds.testing.mock_data` with `MockPolicy.USE_CODE` and an empty data_dir: generated examples,
no download, no network.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY = ["--epochs=2", "--steps_per_epoch=3", "--batch_size=8", "--seq_len=16", "--width=16", "--depth=1",
        "--eval_steps=2", "--verbose=2"]
UNIFORM_BYTE_LOSS = math.log(256)  # cross-entropy of a model that has learned nothing about bytes

# Runs an example as __main__, optionally inside tfds.testing.mock_data.
_RUNNER = """
import os, runpy, sys
script, mock, data_dir, *args = sys.argv[1:]
sys.argv = [script, *args]
sys.path.insert(0, os.path.dirname(script))
if mock == "1":
    import tensorflow_datasets as tfds
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE, data_dir=data_dir):
        runpy.run_path(script, run_name="__main__")
else:
    runpy.run_path(script, run_name="__main__")
"""


def run_example(name, tmp_path, *args, mock=False, timeout=300):
    """Runs examples/<name>.py with `args`; returns (stdout, the results JSON)."""
    results = tmp_path / "results.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(EXAMPLES / f"{name}.py"), "1" if mock else "0", str(tmp_path / "tfds"),
         f"--model_dir={tmp_path / 'runs'}", f"--results_file={results}", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout, json.loads(results.read_text())


def assert_logged(result):
    """The run wrote TensorBoard scalars and a checkpoint under its log_dir."""
    log_dir = Path(result["log_dir"])
    assert any(p.name.startswith("events.out.tfevents") for p in (log_dir / "logs").iterdir()), log_dir
    assert (log_dir / "checkpoint.weights.h5").exists() or (log_dir / "checkpoint").is_dir(), log_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "transformer", "rnn", "custom_loop"])
def test_example_offline_default_data(name, tmp_path):
    stdout, (result,) = run_example(name, tmp_path, *TINY, "--learning_rate=1e-2")
    assert "Python's pydoc_data.topics (offline)" in result["data"]
    assert result["policy"] in ("mixed_bfloat16", "mixed_float16", "float32")
    assert result["timed_steps"] == 3  # the second epoch, after the first (warm-up)
    assert math.isfinite(result["eval_loss"]) and 0.0 <= result["eval_accuracy"] <= 1.0
    # Six steps at lr 1e-2 on real text already beat the uniform-byte guess by a margin.
    assert result["eval_loss"] < UNIFORM_BYTE_LOSS - 0.5, result
    assert result["rss_above_baseline_mib"] > 0
    assert "check_model(" in result["check_model"] and "median step" in stdout
    assert_logged(result)


@pytest.mark.slow
@pytest.mark.parametrize("name,dataset,task_text", [
    ("cnn", "mnist", "images (28, 28, 1)"),
    ("transformer", "tiny_shakespeare", "held-out windows of 16 bytes"),
    ("rnn", "imdb_reviews", "first 16 bytes of each review"),
])
def test_example_tfds_mock(name, dataset, task_text, tmp_path):
    _, (result,) = run_example(name, tmp_path, *TINY, f"--dataset={dataset}", "--max_examples=16", mock=True)
    assert result["data"].startswith(f"tensorflow-datasets {dataset}") and task_text in result["data"], result
    assert math.isfinite(result["eval_loss"]) and math.isfinite(result["train_loss"])


@pytest.mark.slow
def test_compare_float32_trains_the_twin_on_the_same_data_and_seed(tmp_path):
    stdout, (amp, base) = run_example("transformer", tmp_path, *TINY, "--policy=mixed_float16", "--compare_float32")
    assert (amp["policy"], base["policy"]) == ("mixed_float16", "float32")
    # float16 needs loss scaling: the scale and the counters are reported (no step skipped here).
    assert amp["loss_scale"] >= 1 and amp["overflow_count"] == 0 and amp["total_steps"] == 6
    assert "loss_scale" not in base
    # Same initial weights and batches: after six steps the two differ only by float16 rounding.
    # (A different seed or data order moves the loss by far more than 1%.)
    assert abs(amp["train_loss"] / base["train_loss"] - 1) < 0.01, (amp["train_loss"], base["train_loss"])
    assert abs(amp["eval_loss"] / base["eval_loss"] - 1) < 0.01, (amp["eval_loss"], base["eval_loss"])
    assert "speed-up mixed_float16 vs float32" in stdout
    assert Path(amp["log_dir"]).name == "mixed_float16" and Path(base["log_dir"]).name == "float32"
    assert_logged(amp)
    assert_logged(base)


@pytest.mark.slow
def test_custom_loop_float16_counters(tmp_path):
    stdout, (result,) = run_example("custom_loop", tmp_path, *TINY, "--policy=mixed_float16")
    assert "loss scale" in stdout and "of which applied" in stdout
    assert result["total_steps"] == 6 and result["overflow_count"] == 0
    assert (Path(result["log_dir"]) / "checkpoint").is_dir()


@pytest.mark.slow
def test_demo_smoke(tmp_path):
    stdout, (amp, base) = run_example("demo", tmp_path, *TINY)
    assert base["policy"] == "float32" and amp["label"] == "auto"
    for line in ("speed-up", "eval loss", "peak RSS+", "TensorBoard logs", "training time", "demo wall time"):
        assert line in stdout, line
    if amp["policy"] != "float32":
        assert "target >= 1.4x" in stdout and "check_model(" in stdout

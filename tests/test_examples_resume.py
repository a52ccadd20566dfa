"""`--resume`: a killed example run continues after its last finished epoch and ends where the
uninterrupted run ends, bit for bit (weights, optimizer state, loss-scale counters, data order).

The kill is a real SIGKILL of the example's process, at a chosen point: while it writes epoch
`kill_at`'s checkpoint, after the weights file and before the state that names it (the worst
moment), so the run must resume from the epoch before.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY = ["--steps_per_epoch=3", "--batch_size=8", "--seq_len=16", "--width=16", "--depth=1", "--eval_steps=2",
        "--verbose=0"]

# Runs an example as __main__; kill_at > 0: SIGKILL itself just before epoch kill_at's state is renamed
# into place (its weights file already written).
_RUNNER = """
import json, os, runpy, signal, sys
script, kill_at, *args = sys.argv[1:]
sys.argv = [script, *args]
sys.path.insert(0, os.path.dirname(script))
from common import resume
replace = os.replace
def killing_replace(src, dst):
    if os.path.basename(dst) == resume.STATE and json.load(open(src))["epochs_done"] == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)
    return replace(src, dst)
os.replace = killing_replace
runpy.run_path(script, run_name="__main__")
"""


def run(name, model_dir, *args, kill_at=0):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_AMP_QUIET_TF")}
    return subprocess.run([sys.executable, "-c", _RUNNER, str(EXAMPLES / f"{name}.py"), str(kill_at),
                           f"--model_dir={model_dir}", *TINY, *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=model_dir.parent)


def finished(name, model_dir, *args, **kwargs):
    """Runs to the end; returns (stdout, results)."""
    results = model_dir.parent / f"{model_dir.name}.json"
    out = run(name, model_dir, f"--results_file={results}", *args, **kwargs)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout, json.loads(results.read_text())


FIGURES = ("train_loss", "train_accuracy", "eval_loss", "eval_accuracy", "loss_scale", "overflow_count",
           "total_steps")


@pytest.mark.slow
@pytest.mark.parametrize("name,args", [
    ("transformer", ["--policy=mixed_float16"]),  # fit; loss scale and counters
    ("custom_loop", ["--policy=mixed_bfloat16", "--optimizer=lean_stochastic"]),  # LeanAdam, its random bits
    # The loop builds the restored optimizer again: the scale grows every 20 steps, so a scale or a growth counter
    # started afresh on resume ends on another scale.
    ("custom_loop", ["--policy=mixed_float16", "--tier=large", "--steps_per_epoch=15"]),
])
def test_killed_run_resumes_to_the_uninterrupted_result(name, args, tmp_path):
    _, whole = finished(name, tmp_path / "whole", "--epochs=3", *args)
    killed = run(name, tmp_path / "resumed", "--epochs=3", *args, kill_at=2)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]  # guard: it was killed
    checkpoint = next((tmp_path / "resumed").rglob("checkpoint"))
    assert json.loads((checkpoint / "state.json").read_text())["epochs_done"] == 1
    assert (checkpoint / "epoch-0002.weights.h5").exists()  # written, not yet named by the state
    stdout, resumed = finished(name, tmp_path / "resumed", "--epochs=3", "--resume", *args)
    assert "resumed after epoch 1 from " in stdout and "(2 of 3 epochs to go)" in stdout, stdout
    assert "epoch 1/3" not in stdout and "epoch 2/3" in stdout and "epoch 3/3" in stdout, stdout
    for a, b in zip(whole, resumed, strict=True):
        assert {k: a.get(k) for k in FIGURES} == {k: b.get(k) for k in FIGURES}
    if "--policy=mixed_float16" in args:
        steps = int(next((a for a in reversed(TINY + args) if a.startswith("--steps_per_epoch=")))
                    .split("=")[1])
        assert resumed[0]["total_steps"] == 3 * steps  # the counters continued from the checkpoint
    assert sorted(p.name for p in checkpoint.iterdir()) == ["epoch-0003.weights.h5", "state.json"]


@pytest.mark.slow
def test_resume_refuses_other_settings_and_a_missing_model_dir(tmp_path):
    finished("transformer", tmp_path / "run", "--epochs=1", "--policy=mixed_bfloat16")
    out = run("transformer", tmp_path / "run", "--epochs=2", "--resume", "--policy=mixed_bfloat16", "--width=32")
    # One error line; a keras_amp warning (mixed_bfloat16 on a CPU without native bfloat16) is one more.
    lines = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("warning: ")]
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "width: saved 16, now 32" in lines[0] and "only --epochs may change" in lines[0], lines[0]
    # Nothing was trained or overwritten.
    assert json.loads(next((tmp_path / "run").rglob("state.json")).read_text())["epochs_done"] == 1
    # Without --resume the same folder is a new run, and it says what it replaces.
    stdout, _ = finished("transformer", tmp_path / "run", "--epochs=1", "--policy=mixed_bfloat16")
    assert "holds a checkpoint after epoch 1: this run starts over" in stdout, stdout
    out = subprocess.run([sys.executable, str(EXAMPLES / "cnn.py"), "--resume"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.startswith("error: --resume needs --model_dir"), out.stderr[-2000:]


@pytest.mark.slow
def test_resume_without_a_checkpoint_starts_at_epoch_one(tmp_path):
    stdout, (result,) = finished("cnn", tmp_path / "new", "--epochs=1", "--resume", "--policy=mixed_bfloat16")
    assert "--resume: no checkpoint in " in stdout and "training from epoch 1" in stdout, stdout
    assert result["timed_steps"] == 2 and json.loads(next((tmp_path / "new").rglob("state.json")).read_text())[
        "epochs_done"] == 1
    # Another --policy has no checkpoint of its own in that folder; the message names the run that does.
    stdout, _ = finished("cnn", tmp_path / "new", "--epochs=1", "--resume", "--policy=float32")
    assert "[float32] --resume: no checkpoint in " in stdout, stdout
    assert "(not the checkpoint of: --policy=mixed_bfloat16 after epoch 1 in " in stdout, stdout


def test_twins_resumed_from_different_epochs_each_go_on_from_their_own(monkeypatch):
    """--compare_float32 alternates the twins by epoch; a kill between their turns leaves one an epoch ahead."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for name in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_AMP_QUIET_TF"):  # importing `common` sets them; restored after
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)
    from common import compare  # noqa: PLC0415

    calls = []

    class Run:
        def __init__(self, label, start_epoch):
            self.label, self.start_epoch = label, start_epoch

        def run_epoch(self, epoch):
            calls.append((self.label, epoch))

    compare.take_turns([Run("mixed", 2), Run("float32", 1)], 4)
    assert calls == [("float32", 1), ("mixed", 2), ("float32", 2), ("float32", 3), ("mixed", 3)]
    calls.clear()
    compare.take_turns([Run("mixed", 4), Run("float32", 4)], 4)  # all trained: nothing to do
    assert calls == []
    for name in [n for n in sys.modules if n == "common" or n.startswith("common.")]:
        del sys.modules[name]

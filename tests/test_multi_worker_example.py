"""examples/multi_worker.py: two real workers on the examples' data and model end identical, and say so.

The launcher honours the common flags (progress, plan, eval_steps, results_file, the default run
folder) and keeps the logs, checkpoint and worker logs it names.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "multi_worker.py"
SMALL = ["--workers=2", "--epochs=2", "--steps_per_epoch=6", "--batch_size=16", "--seq_len=32", "--width=16",
         "--depth=1", "--learning_rate=1e-2", "--timeout_seconds=90", "--launch_timeout=400"]


def _run(*args, env=None, timeout=450):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


@pytest.mark.distributed
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_multi_worker_example(policy, tmp_path):
    results_file = tmp_path / "results.json"
    # No --model_dir: the default run folder, under the temporary directory (TMPDIR here).
    out = _run(*SMALL, f"--policy={policy}", "--verbose=2", "--show_plan", "--eval_steps=2",
               f"--results_file={results_file}", env={"TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = json.loads(results_file.read_text())
    workers = run["workers"]
    assert run["ok"] and run["agree"] and [w["worker"] for w in workers] == [0, 1]
    assert all(w["replicas"] == 2 and w["policy"] == policy and w["eval_batches"] == 2 for w in workers)
    # Same collective all-reduce on both workers: bit-identical losses, weights and loss scale.
    assert workers[0]["losses"] == workers[1]["losses"] and workers[0]["losses"][-1] < workers[0]["losses"][0]
    assert workers[0]["weights_sha256"] == workers[1]["weights_sha256"]
    assert workers[0]["loss_scale"] == workers[1]["loss_scale"]
    assert (workers[0]["loss_scale"] is None) == (policy == "mixed_bfloat16")  # scaling under float16 only
    assert f"[{policy}] workers agree: identical per-epoch losses, weights (sha256 " \
           f"{workers[0]['weights_sha256'][:12]}) and loss scale" in out.stdout, out.stdout
    # A row per worker, worker 0's progress (one header an epoch, Keras's epoch line) and the plan, once.
    assert re.search(r"^0 +2 +" + policy, out.stdout, re.M) and re.search(r"^1 +2 +" + policy, out.stdout, re.M)
    assert out.stdout.count("[worker 0] epoch 1/2") == 1 and "[worker 0] epoch 2/2" in out.stdout
    assert "Epoch 1/2" not in out.stdout and re.search(r"6/6 - .* - loss: ", out.stdout), out.stdout
    assert out.stdout.count("recipe 'cnn', compute policy") == 1
    # The run folder is new for this run, and the logs and checkpoint it names are there after the exit.
    run_dir = Path(run["run_dir"])
    assert run_dir.parent.parent.parent == tmp_path / "keras_amp_examples" and run_dir.name == policy
    assert re.fullmatch(r"\d{8}-\d{6}-\d+", run_dir.parent.name), run_dir
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "logs").rglob("*"))
    assert (run_dir / "checkpoint.weights.h5").stat().st_size > 0
    worker_logs = Path(re.search(r"worker logs in (\S+)", out.stdout).group(1))
    assert sorted(p.name for p in worker_logs.iterdir()) == [
        "worker0.run0.err", "worker0.run0.out", "worker1.run0.err", "worker1.run0.out"]


def test_disagreeing_workers_get_a_verdict_that_says_what_differs():
    probe = ("import multi_worker as m; same = dict(losses=[2.0, 1.0], weights_sha256='ab' * 32, loss_scale=None); "
             "print(m.verdict([same, same])); print(m.verdict([same, dict(same, weights_sha256='cd' * 32)])); "
             "print(m.verdict([same, dict(same, losses=[2.0, 1.5], loss_scale=8.0)]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         cwd=SCRIPT.parent)
    assert out.returncode == 0, out.stderr
    agree, weights, losses = out.stdout.splitlines()
    assert agree.startswith("(True, 'workers agree: identical per-epoch losses, weights (sha256 abababababab)")
    assert weights == "(False, 'workers DISAGREE: weights differ')"
    assert losses == "(False, 'workers DISAGREE: per-epoch losses, loss scale differ')"


@pytest.mark.parametrize("args,message", [
    (["--batch_size=15"], "error: --batch_size (global) must be divisible by --workers. Received: batch_size=15, "
                          "workers=2"),
    (["--worker_mode"], "error: --worker_mode needs --model_dir: the run's folder, the same on every worker."),
    (["--verbose=3"], "flag --verbose=3: 3 is not an integer in the range [0, 2]"),
    # At parsing, not in a worker after its start-up (the collective timeout) or in the launcher's wait.
    (["--timeout_seconds=-1"], "flag --timeout_seconds=-1.0: must be > 0 seconds"),
    (["--timeout_seconds=0"], "flag --timeout_seconds=0.0: must be > 0 seconds"),
    (["--launch_timeout=-5"], "flag --launch_timeout=-5.0: must be > 0 seconds"),
    (["--seed=-1"], "flag --seed=-1: -1 is not an integer in the range [0, 4294967295]"),
    ([f"--model_dir={ROOT / 'pyproject.toml'}"],
     "error: --model_dir must be a folder (made if missing) for the runs' checkpoints and TensorBoard logs, but "
     f"{ROOT / 'pyproject.toml'} is a file."),
])
def test_bad_flags_fail_with_one_clear_message(args, message):
    out = _run("--workers=2", *args, timeout=120)
    assert out.returncode == 1 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "workers; run folder" not in out.stdout  # no worker launched

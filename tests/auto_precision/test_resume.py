"""Precision decisions survive a SIGKILL: `resume_scenario.py` run whole, killed mid-epoch and resumed.

Each run is its own process (BackupAndRestore's use case is a process that dies). Before the
decisions were checkpointed, the resumed run left `d2` in 16 bits (a change applied only at the
exact scheduled epoch, and the layer policy was not in the backup), never applied the step-unit
change, and the fallback relearned its move with another skipped step: 27 of 33 arrays differed.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow
HERE = pathlib.Path(__file__).resolve().parent
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
           PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))


def _argv(mode, backup):
    return [sys.executable, str(HERE / "resume_scenario.py"), mode, str(backup)]


def _tagged(text, tag):
    return [json.loads(line[len(tag) + 1:]) for line in text.splitlines() if line.startswith(tag + " ")]


def _run(mode, backup):
    proc = subprocess.run(_argv(mode, backup), capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _kill_mid_epoch(backup):
    proc = subprocess.Popen(_argv("victim", backup), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    lines = []
    deadline = time.monotonic() + 300
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("MID_EPOCH") or time.monotonic() > deadline:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert any(l.startswith("MID_EPOCH") for l in lines), "".join(lines) + proc.stderr.read()[-3000:]
    assert proc.returncode == -signal.SIGKILL


def test_killed_and_resumed_run_matches_the_uninterrupted_one(tmp_path):
    reference = _tagged(_run("reference", tmp_path / "ref"), "RESULT")[0]
    _kill_mid_epoch(tmp_path / "run")
    out = _run("resume", tmp_path / "run")
    restored = _tagged(out, "RESTORED")[0]
    resumed = _tagged(out, "RESULT")[0]
    # Guards: the decisions were made before the kill (so the resume has something to restore),
    # and the resume started from the epoch-2 backup, not from scratch.
    assert reference["decisions"] and reference["epoch_changes"] and reference["step_changes"], reference
    assert restored["initial_epoch"] == 2, restored
    # (The callbacks listed before BackupAndRestore set the restored decisions again at epoch begin.)
    # The resumed run is the uninterrupted one, bit for bit: same decisions, policies, counters, weights.
    for key in ("policies", "decisions", "epoch_changes", "step_changes", "overflow_count", "total_steps", "scale"):
        assert resumed[key] == reference[key], (key, resumed[key], reference[key])
    assert resumed["finite"] and resumed["digest"] == reference["digest"]
    assert resumed["losses"] == reference["losses"][2:]  # the resumed fit reports epochs 3 and 4

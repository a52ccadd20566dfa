"""Replica consistency under MirroredStrategy (two logical CPUs, run as a subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scenarios" / "mirrored_overflow.py"


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=str(SCRIPT.parents[2]))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["num_replicas"] == 2
    return out


@pytest.mark.parametrize("poisoned", [1, 0], ids=["replica1", "replica0"])
def test_ours_skips_on_every_replica(result, poisoned):
    r = result[f"ours_replica{poisoned}"]
    # Guard: only the poisoned replica saw non-finite local gradients.
    assert r["local_finite"] == [i != poisoned for i in range(2)]
    assert r["weights_finite"] and r["replicas_identical"] and r["weights_unchanged"]
    assert r["scale_after"] == r["scale_before"] / 2  # halved exactly once
    assert r["overflow_count"] == 1 and r["iterations"] == 1 and r["total_steps"] == 2


def test_stock_writes_non_finite_weights_when_only_replica1_overflows(result):
    r = result["stock_replica1"]
    assert r["local_finite"] == [True, False]
    assert not r["weights_finite"]  # stock defect: replica 0's flag decided, NaN was applied
    assert r["scale_after"] == r["scale_before"]  # and the scale never backed off


def test_stock_handles_replica0_overflow(result):
    r = result["stock_replica0"]
    assert r["local_finite"] == [False, True]
    assert r["weights_finite"] and r["weights_unchanged"]
    assert r["scale_after"] == r["scale_before"] / 2

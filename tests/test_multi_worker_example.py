"""examples/multi_worker.py: the launcher runs two real workers, on the examples' shared data and model, that end identical."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_multi_worker_example(policy, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "multi_worker.py"), "--workers=2", f"--policy={policy}",
         "--epochs=2", "--steps_per_epoch=10", "--batch_size=32", "--learning_rate=3e-3", "--timeout_seconds=90",
         "--launch_timeout=400", f"--model_dir={tmp_path}"],
        capture_output=True, text=True, timeout=450, env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    reports = [json.loads(line.split(" ", 3)[3]) for line in out.stdout.splitlines() if line.startswith("worker ")]
    assert [r["task"]["index"] for r in reports] == [0, 1]
    assert all(r["replicas"] == 2 and r["policy"] == policy for r in reports)
    # Same collective all-reduce on both workers: bit-identical losses and weights.
    assert reports[0]["losses"] == reports[1]["losses"]
    assert reports[0]["weight_checksum"] == reports[1]["weight_checksum"]
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]

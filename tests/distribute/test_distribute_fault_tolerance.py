"""BackupAndRestore + keras_amp LossScaleOptimizer: SIGKILL a worker mid-epoch, restart, resume."""

import signal
import tempfile
import time

import pytest

from keras_amp.distribute import local_cluster
from tests.distribute.harness import ENV, argv, tagged

pytestmark = pytest.mark.distributed

STATE = ("digest", "scale", "overflow_count", "consecutive_overflows", "step_counter", "iterations", "total_steps")


def _pick(r):
    return {k: r[k] for k in STATE}


def test_killed_worker_resumes_from_last_backup_and_matches_uninterrupted_run():
    with tempfile.TemporaryDirectory() as root:
        reference = local_cluster.launch(argv("resume", "reference", f"{root}/ref", 90), 2, timeout=300, env=ENV)
        assert all(w.ok for w in reference), [w.tail() for w in reference]
        ref_final = [tagged(w.stdout, "RESULT")[0] for w in reference]

        with local_cluster.LocalCluster(argv("resume", "victim", f"{root}/run", 20), 2, env=ENV) as cluster:
            assert cluster.wait_for_output(1, "MID_EPOCH", timeout=240), cluster.output(1)
            cluster.kill(1, signal.SIGKILL)
            killed_at = time.monotonic()
            survivor = cluster.wait(timeout=120)[0]
            # The surviving worker fails (peer gone / collective timeout) instead of hanging.
            assert survivor.returncode != 0 and not survivor.timed_out, survivor.tail()
            assert time.monotonic() - killed_at < 90
            last_backup = tagged(cluster.result(1).stdout, "BACKUP")
            assert [b["epoch"] for b in last_backup] == [0]  # killed in epoch 1: one backup on disk
            assert last_backup[0]["overflow_count"] == 1 and last_backup[0]["scale"] != 2.0**8  # non-trivial state

            cluster.argv = argv("resume", "resume", f"{root}/run", 90)
            for i in range(2):
                cluster.start_worker(i)
            resumed = cluster.wait(timeout=300)
        assert all(w.ok for w in resumed), [w.tail() for w in resumed]
        for w in resumed:
            restored = tagged(w.stdout, "RESTORED")[0]
            assert restored["initial_epoch"] == 1
            assert _pick(restored) == _pick(last_backup[0])  # weights, scale, counters, step
            assert _pick(tagged(w.stdout, "RESULT")[0]) == _pick(ref_final[0])  # nothing lost or repeated
        assert _pick(ref_final[0]) == _pick(ref_final[1])

"""keras_amp.distribute.local_cluster: ports, TF_CONFIG, and worker processes on 127.0.0.1 (plain
Python workers; the TensorFlow clusters run in tests/distribute/test_distribute_*.py). The
bad-argument rows are in tests/test_bad_input.py."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from keras_amp.distribute import local_cluster


def test_free_ports_distinct_and_bindable():
    ports = local_cluster.free_ports(np.int64(3))
    assert len(set(ports)) == 3
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_tf_config_layout():
    cfg = local_cluster.tf_config([1111, 2222], 1)
    assert cfg == {"cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}, "task": {"type": "worker", "index": 1}}


def test_launch_collects_outputs_and_kills_on_timeout():
    code = "import json,os,sys,time; c=json.loads(os.environ['TF_CONFIG']); i=c['task']['index']; " \
           "print('hello', i, len(c['cluster']['worker'])); sys.stdout.flush(); time.sleep(60 if i else 0)"
    results = local_cluster.launch([sys.executable, "-c", code], 2, timeout=5)
    assert results[0].ok and results[0].stdout.strip() == "hello 0 2"
    assert results[1].timed_out and results[1].returncode == -9 and "hello 1 2" in results[1].stdout


def test_local_cluster_unknown_worker_is_a_value_error():
    with local_cluster.LocalCluster([sys.executable, "-c", "pass"], 1) as cluster:
        cluster.wait(timeout=30)
        with pytest.raises(ValueError, match="index"):
            cluster.output(1)
        with pytest.raises(ValueError, match="index"):
            cluster.kill(-1)


@pytest.mark.parametrize(
    "returncode, timed_out, ok",
    [(0, False, True), (1, False, False), (-9, False, False), (0, True, False)],
    ids=["exit-0", "exit-1", "killed", "timed-out"],
)
def test_worker_result_ok_only_for_a_clean_exit_in_time(returncode, timed_out, ok):
    assert local_cluster.WorkerResult(0, returncode, "", "", timed_out).ok is ok


def test_worker_result_tail_keeps_the_end_of_each_stream():
    result = local_cluster.WorkerResult(3, 1, "abcdef", "uvwxyz", False)
    assert result.tail(chars=2) == "--- worker 3 rc=1 timed_out=False\n[stdout]\nef\n[stderr]\nyz"


def test_python_argv_runs_the_script_with_this_interpreter():
    assert local_cluster.python_argv("scenario.py", "--steps", "4") == [sys.executable, "scenario.py", "--steps", "4"]


_PRINT_ENV = "import json,os; print(os.environ.get('A'), os.environ.get('B'), json.loads(os.environ['TF_CONFIG'])['task']['index'])"


def test_env_reaches_every_worker_and_worker_env_only_its_own():
    results = local_cluster.launch([sys.executable, "-c", _PRINT_ENV], 3, timeout=60, env={"A": "all"},
                                   worker_env={1: {"B": "one"}})
    assert [r.stdout.strip() for r in results] == ["all None 0", "all one 1", "all None 2"]
    assert all(r.ok for r in results)


def test_a_killed_worker_restarts_with_a_fresh_log(tmp_path):
    code = "import os,sys,time; print('run', os.environ.get('RUN', '0')); sys.stdout.flush(); time.sleep(60)"
    cluster = local_cluster.LocalCluster([sys.executable, "-c", code], 1, log_dir=str(tmp_path))
    with cluster:
        assert cluster.wait_for_output(0, "run 0", timeout=30)
        first_pid = cluster.pid(0)
        with pytest.raises(ValueError, match="still running"):
            cluster.start_worker(0)
        cluster.kill(0)
        assert cluster.result(0).returncode == -9 and not cluster.result(0).timed_out
        cluster.start_worker(0, env={"RUN": "1"})
        assert cluster.wait_for_output(0, "run 1", timeout=30)
        assert cluster.pid(0) != first_pid and "run 0" not in cluster.output(0)
    assert sorted(os.listdir(tmp_path)) == ["worker0.run0.err", "worker0.run0.out", "worker0.run1.err", "worker0.run1.out"]
    assert (tmp_path / "worker0.run0.out").read_text() == "run 0\n"


def test_wait_for_output_is_false_when_the_worker_exits_without_it():
    with local_cluster.LocalCluster([sys.executable, "-c", "print('other')"], 1) as cluster:
        assert cluster.wait_for_output(0, "never printed", timeout=30) is False
        assert cluster.wait(timeout=30)[0].stdout == "other\n"


def test_configure_logical_cpus_splits_the_cpu_before_tensorflow_starts_and_refuses_after():
    # Logical devices are fixed when TensorFlow initialises: only a fresh process can show both.
    code = ("from keras_amp.distribute import local_cluster as lc; import tensorflow as tf\n"
            "print(len(lc.configure_logical_cpus(3)), len(tf.config.list_logical_devices('CPU')))\n"
            "try:\n    lc.configure_logical_cpus(2)\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines[0] == "3 3", proc.stderr[-2000:]
    assert lines[1].startswith("refused: configure_logical_cpus() must be called before TensorFlow initialises")
    assert "Received: count=2" in lines[1]

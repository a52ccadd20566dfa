"""keras_amp.distribute.strategies: TF_CONFIG reading and `mirrored()` in one process (no cluster;
the multi-worker and 2-replica scenarios run in subprocesses, tests/distribute/test_distribute_*.py).
The bad-argument rows are in tests/test_bad_input.py."""

import json
import logging as py_logging

import pytest
import tensorflow as tf

from keras_amp.distribute import local_cluster, strategies
import keras_amp


@pytest.mark.parametrize(
    "text, part",
    [
        pytest.param("[]", "must be a JSON object", id="list"),
        pytest.param("not json", "must be JSON", id="not-json"),
        pytest.param("", "must be JSON", id="empty"),
        pytest.param('{"cluster": []}', '"cluster" must be a JSON object', id="cluster-list"),
        pytest.param('{"task": 0}', '"task" must be a JSON object', id="task-int"),
        pytest.param('{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 5}}',
                     'task "index" must name one of the cluster\'s 2 "worker" tasks \\(0 to 1\\)', id="index-past"),
        pytest.param('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}',
                     'task "index" must name one of', id="index-negative"),
    ],
)
def test_malformed_tf_config_is_a_clear_value_error(monkeypatch, text, part):
    monkeypatch.setenv("TF_CONFIG", text)
    with pytest.raises(ValueError, match=part) as info:
        keras_amp.distribute.multi_worker(timeout_seconds=5)
    assert f"Received: TF_CONFIG={text!r}" in str(info.value)


def test_well_formed_tf_config_is_read(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(local_cluster.tf_config([1111, 2222], 1)))
    assert strategies.read_tf_config()["task"] == {"type": "worker", "index": 1}
    monkeypatch.delenv("TF_CONFIG")
    assert strategies.read_tf_config() is None


def test_tf_config_without_cluster_or_task_is_returned_as_is(monkeypatch):
    # TensorFlow itself accepts a TF_CONFIG naming neither (e.g. only "environment").
    monkeypatch.setenv("TF_CONFIG", '{"environment": "cloud"}')
    assert strategies.read_tf_config() == {"environment": "cloud"}


def _absl_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("keras_amp.distribute.mirrored")]


def test_mirrored_on_one_device_logs_the_enabled_policy(caplog):
    caplog.set_level(py_logging.INFO, logger="absl")
    keras_amp.enable("mixed_bfloat16")
    strategy = strategies.mirrored(["/cpu:0"])
    assert type(strategy) is tf.distribute.MirroredStrategy
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    assert _absl_lines(caplog) == ["keras_amp.distribute.mirrored: 1 replicas in sync, policy mixed_bfloat16"]


def test_mirrored_without_enable_says_the_global_keras_policy_applies(caplog):
    caplog.set_level(py_logging.INFO, logger="absl")
    strategies.mirrored(("/cpu:0",))
    lines = _absl_lines(caplog)
    assert len(lines) == 2 and "keras_amp.enable() not called" in lines[0]
    assert lines[1] == "keras_amp.distribute.mirrored: 1 replicas in sync, policy (Keras global)"

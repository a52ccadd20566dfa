"""In-process tests of keras_amp.distribute's helpers (no cluster needed)."""

import json
import socket
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
import importlib

from keras_amp.distribute import data, launcher

# The package re-exports the function `verify`, which shadows the submodule of the same name.
verify = importlib.import_module("keras_amp.distribute.verify")


class _Fake:
    def __init__(self, n):
        self.num_replicas_in_sync = n


@pytest.mark.parametrize("replicas, per_replica, total", [(1, 32, 32), (2, 8, 16), (8, 64, 512)])
def test_batch_sizes_round_trip(replicas, per_replica, total):
    s = _Fake(replicas)
    assert data.global_batch_size(per_replica, s) == total
    assert data.per_replica_batch_size(total, s) == per_replica


def test_batch_size_errors():
    with pytest.raises(ValueError, match="multiple of the 4 replicas.*Received: global_batch_size=10"):
        data.per_replica_batch_size(10, _Fake(4))
    with pytest.raises(TypeError, match="must be an int"):
        data.global_batch_size(8.0, _Fake(2))
    with pytest.raises(ValueError, match=">= 1"):
        data.global_batch_size(0, _Fake(2))


@pytest.mark.parametrize("policy", ["auto", "file", "data", "hint", "off"])
def test_auto_shard_policy_round_trip(policy):
    ds = data.with_auto_shard_policy(tf.data.Dataset.range(4), policy)
    assert data.auto_shard_policy(ds) == policy


def test_prepare_batches_globally_drops_remainder_and_shards_by_data():
    ds = data.prepare(tf.data.Dataset.range(10), _Fake(2), per_replica_batch_size=2)
    assert [b.numpy().tolist() for b in ds] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert data.auto_shard_policy(ds) == "data"
    with pytest.raises(ValueError, match="Unknown auto-shard"):
        data.with_auto_shard_policy(ds, "rows")


def test_free_ports_distinct_and_bindable():
    ports = launcher.free_ports(3)
    assert len(set(ports)) == 3
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_tf_config_layout():
    cfg = launcher.tf_config([1111, 2222], 1)
    assert cfg == {"cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match="index"):
        launcher.tf_config([1111], 1)


def test_launch_collects_outputs_and_kills_on_timeout():
    code = "import json,os,sys,time; c=json.loads(os.environ['TF_CONFIG']); i=c['task']['index']; " \
           "print('hello', i, len(c['cluster']['worker'])); sys.stdout.flush(); time.sleep(60 if i else 0)"
    results = launcher.launch([sys.executable, "-c", code], 2, timeout=10)
    assert results[0].ok and results[0].stdout.strip() == "hello 0 2"
    assert results[1].timed_out and results[1].returncode == -9 and "hello 1 2" in results[1].stdout


def test_verify_single_replica_returns_fields_of_global_policy_when_not_enabled():
    keras.config.set_dtype_policy("mixed_float16")
    fields = verify.verify(tf.distribute.get_strategy())
    assert fields["policy"] == "mixed_float16" and fields["loss_scaling"] == "True"
    cfg = keras_amp.enable("mixed_bfloat16")
    assert verify.verify(tf.distribute.get_strategy()) == cfg.fingerprint_fields()


def test_verify_argument_errors():
    with pytest.raises(TypeError, match="tf.distribute.Strategy"):
        verify.verify("mirrored")
    with pytest.raises(ValueError, match="timeout_seconds"):
        verify.verify(tf.distribute.get_strategy(), timeout_seconds=0)


def test_differing_parts_narrow_json_values():
    parts = verify._differing_parts({0: json.dumps({"a": 1, "tier": "small"}), 1: json.dumps({"a": 1, "tier": "large"})})
    assert parts == {0: '{"tier": "small"}', 1: '{"tier": "large"}'}


def test_hash64_is_stable_int64():
    h = verify._hash64("mixed_float16")
    assert h == verify._hash64("mixed_float16") and -(2**63) <= h < 2**63 and h != verify._hash64("float32")

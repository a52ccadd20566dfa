"""In-process tests of keras_amp.distribute's data helpers, strategies' argument checks and the
local-cluster tool (no cluster needed). The bad-argument rows of the distribute API are in
tests/test_bad_input.py."""

import json
import math
import socket
import sys

import numpy as np
import pytest
import tensorflow as tf

from keras_amp.distribute import data, local_cluster, strategies
import keras_amp


class _Replicas(tf.distribute.OneDeviceStrategy):
    """A real Strategy that reports `n` replicas: tests the batch arithmetic without n devices."""

    def __init__(self, n):
        super().__init__("/cpu:0")
        self._n = n

    @property
    def num_replicas_in_sync(self):
        return self._n


_DEFAULT = tf.distribute.get_strategy()
_DS = tf.data.Dataset.range(8)

@pytest.mark.parametrize(
    "text, part",
    [
        pytest.param("[]", "must be a JSON object", id="list"),
        pytest.param("not json", "must be JSON", id="not-json"),
        pytest.param("", "must be JSON", id="empty"),
        pytest.param('{"cluster": []}', '"cluster" must be a JSON object', id="cluster-list"),
        pytest.param('{"task": 0}', '"task" must be a JSON object', id="task-int"),
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


@pytest.mark.parametrize("replicas, per_replica, total", [(1, 32, 32), (2, 8, 16), (8, 64, 512)])
def test_batch_sizes_round_trip(replicas, per_replica, total):
    s = _Replicas(replicas)
    assert data.global_batch_size(per_replica, s) == total
    assert data.per_replica_batch_size(total, s) == per_replica


def test_numpy_integer_batch_sizes_are_accepted_as_python_ints():
    s = _Replicas(2)
    total = data.global_batch_size(np.int64(8), s)
    assert total == 16 and type(total) is int
    assert type(data.per_replica_batch_size(np.int32(16), s)) is int
    ds = data.prepare(tf.data.Dataset.range(8), s, per_replica_batch_size=np.uint8(2))
    assert [b.numpy().tolist() for b in ds] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_uneven_global_batch_is_refused():
    with pytest.raises(ValueError, match="multiple of the 4 replicas.*Received: global_batch_size=10"):
        data.per_replica_batch_size(10, _Replicas(4))


@pytest.mark.parametrize("policy", ["auto", "file", "data", "hint", "off"])
def test_auto_shard_policy_round_trip(policy):
    ds = data.with_auto_shard_policy(tf.data.Dataset.range(4), policy)
    assert data.auto_shard_policy(ds) == policy


def test_prepare_batches_globally_drops_remainder_and_shards_by_data():
    ds = data.prepare(tf.data.Dataset.range(10), _Replicas(2), per_replica_batch_size=2)
    assert [b.numpy().tolist() for b in ds] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert data.auto_shard_policy(ds) == "data"


_BATCHED = {
    "batch": lambda ds: ds.batch(2),
    "batch-then-map-prefetch": lambda ds: ds.batch(2).map(lambda x: x * 2).prefetch(1),
    "padded_batch": lambda ds: ds.padded_batch(2),
    "ragged_batch": lambda ds: ds.ragged_batch(2),
    "parallel-batch": lambda ds: ds.batch(2, num_parallel_calls=2),
    "zip-with-batched": lambda ds: tf.data.Dataset.zip((ds, ds.batch(2))),
    "bucket_by_sequence_length": lambda ds: ds.bucket_by_sequence_length(
        lambda x: tf.cast(x, tf.int32), [4], [2, 2]
    ),
}
_UNBATCHED = {
    "range": lambda ds: ds,
    "map-shuffle-repeat": lambda ds: ds.map(lambda x: x + 1).shuffle(4).repeat(2),
    "batch-then-unbatch": lambda ds: ds.batch(2).unbatch(),
    "batch-then-flat_map": lambda ds: ds.batch(2).flat_map(tf.data.Dataset.from_tensor_slices),
}


@pytest.mark.parametrize("make", list(_BATCHED.values()), ids=list(_BATCHED))
def test_prepare_refuses_an_already_batched_dataset(make):
    """Reads tf.data's private `_inputs()` chain: this fails if TensorFlow changes it."""
    ds = make(tf.data.Dataset.range(8))
    assert data._batched_by(ds) is not None
    with pytest.raises(ValueError, match="`dataset` must be unbatched.*Received: dataset batched upstream by"):
        data.prepare(ds, _Replicas(2), per_replica_batch_size=2)


@pytest.mark.parametrize("make", list(_UNBATCHED.values()), ids=list(_UNBATCHED))
def test_prepare_accepts_unbatched_datasets(make):
    ds = make(tf.data.Dataset.range(8))
    assert data._batched_by(ds) is None
    batches = list(data.prepare(ds, _Replicas(2), per_replica_batch_size=2))
    assert batches and all(b.shape == (4,) for b in batches)  # one batch level, global size 4


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

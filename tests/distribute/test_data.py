"""keras_amp.distribute.data: global and per-replica batch sizes, auto-shard policy, prepare().
The bad-argument rows are in tests/test_bad_input.py."""

import numpy as np
import pytest
import tensorflow as tf

from keras_amp.distribute import data


class _Replicas(tf.distribute.OneDeviceStrategy):
    """A real Strategy that reports `n` replicas: tests the batch arithmetic without n devices."""

    def __init__(self, n):
        super().__init__("/cpu:0")
        self._n = n

    @property
    def num_replicas_in_sync(self):
        return self._n


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


@pytest.mark.parametrize("function, name", [("global_batch_size", "per_replica_batch_size"),
                                            ("per_replica_batch_size", "global_batch_size")])
def test_the_strategy_first_is_refused_naming_the_order(function, name):
    # `prepare(dataset, strategy, per_replica_batch_size=...)` takes the strategy first; these two do not.
    with pytest.raises(TypeError, match=rf"`{function}\({name}, strategy\)` takes the batch size first\. "
                                        rf"Received: {name}=_Replicas object, strategy=16\."):
        getattr(data, function)(_Replicas(2), 16)


def test_uneven_global_batch_is_refused():
    with pytest.raises(ValueError, match="multiple of the 4 replicas.*Received: global_batch_size=10"):
        data.per_replica_batch_size(10, _Replicas(4))


@pytest.mark.parametrize("total, suggested", [(10, 8), (3, 4), (13, 12)], ids=["round-down", "below-n", "odd"])
def test_uneven_global_batch_error_suggests_the_nearest_multiple(total, suggested):
    # The nearest multiple at or below the batch, or one per replica when the batch is below n.
    with pytest.raises(ValueError, match=f"Allowed: multiples of 4, e.g. {suggested}$"):
        data.per_replica_batch_size(total, _Replicas(4))


@pytest.mark.parametrize("policy", ["auto", "file", "data", "hint", "off"])
def test_auto_shard_policy_round_trip(policy):
    ds = data.with_auto_shard_policy(tf.data.Dataset.range(4), policy)
    assert data.auto_shard_policy(ds) == policy


def test_an_untouched_dataset_carries_the_auto_policy():
    assert data.auto_shard_policy(tf.data.Dataset.range(4)) == "auto"  # tf.data's default


def test_prepare_batches_globally_drops_remainder_and_shards_by_data():
    ds = data.prepare(tf.data.Dataset.range(10), _Replicas(2), per_replica_batch_size=2)
    assert [b.numpy().tolist() for b in ds] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert data.auto_shard_policy(ds) == "data"


def test_prepare_sets_the_shard_policy_it_is_given():
    ds = data.prepare(tf.data.Dataset.range(12), _Replicas(3), per_replica_batch_size=2, shard="off")
    assert data.auto_shard_policy(ds) == "off"
    assert [b.numpy().tolist() for b in ds] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]


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

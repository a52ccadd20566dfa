"""Input pipelines under tf.distribute: global vs per-replica batch size, auto-shard policy.

Keras `fit` treats the batch size of a `tf.data.Dataset` as the *global* batch: with N replicas
in sync each replica computes on global/N examples per step. Under MultiWorkerMirroredStrategy
each worker also needs a distinct part of the data; `tf.data` auto-sharding does that (by files
when the source is files, otherwise by elements), and `OFF` means every worker reads everything.
"""

from __future__ import annotations

import tensorflow as tf

_POLICIES = {
    "auto": tf.data.experimental.AutoShardPolicy.AUTO,
    "file": tf.data.experimental.AutoShardPolicy.FILE,
    "data": tf.data.experimental.AutoShardPolicy.DATA,
    "hint": tf.data.experimental.AutoShardPolicy.HINT,
    "off": tf.data.experimental.AutoShardPolicy.OFF,
}


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int. Received: {name}={value!r} of type {type(value).__name__}")
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1. Received: {name}={value}")


def global_batch_size(per_replica_batch_size: int, strategy: tf.distribute.Strategy) -> int:
    """The batch size to give the dataset so that each replica computes on `per_replica_batch_size`."""
    _check_positive("per_replica_batch_size", per_replica_batch_size)
    return per_replica_batch_size * strategy.num_replicas_in_sync


def per_replica_batch_size(global_batch_size: int, strategy: tf.distribute.Strategy) -> int:
    """The batch each replica computes on for a dataset batched at `global_batch_size`.

    Raises ValueError when the global batch does not split evenly: uneven replica batches give
    replicas different gradient scales and (in float16) different overflow behaviour.
    """
    _check_positive("global_batch_size", global_batch_size)
    n = strategy.num_replicas_in_sync
    if global_batch_size % n:
        raise ValueError(
            f"`global_batch_size` must be a multiple of the {n} replicas in sync. "
            f"Received: global_batch_size={global_batch_size}; allowed: multiples of {n}, "
            f"e.g. {global_batch_size - global_batch_size % n or n}"
        )
    return global_batch_size // n


def with_auto_shard_policy(dataset: tf.data.Dataset, policy: str) -> tf.data.Dataset:
    """`dataset` with its distribute auto-shard policy set ("auto", "file", "data", "hint", "off")."""
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"`dataset` must be a tf.data.Dataset. Received: dataset={dataset!r}")
    if policy not in _POLICIES:
        raise ValueError(f"Unknown auto-shard `policy`. Received: policy={policy!r}. Allowed: {', '.join(_POLICIES)}")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = _POLICIES[policy]
    return dataset.with_options(options)


def auto_shard_policy(dataset: tf.data.Dataset) -> str:
    """The auto-shard policy `dataset` carries, as one of the names `with_auto_shard_policy` takes."""
    found = dataset.options().experimental_distribute.auto_shard_policy
    return next(name for name, value in _POLICIES.items() if value == found)


def prepare(
    dataset: tf.data.Dataset,
    strategy: tf.distribute.Strategy,
    *,
    per_replica_batch_size: int,
    shard: str = "data",
) -> tf.data.Dataset:
    """Batches an unbatched `dataset` at the global batch size for `strategy` and sets auto-sharding.

    The last partial batch is dropped: under multi-worker training a short final batch on one
    worker would give the workers different step counts, and a collective would wait forever.

    Args:
        dataset: Unbatched `tf.data.Dataset` of examples.
        strategy: The `tf.distribute.Strategy` it will be trained under.
        per_replica_batch_size: Int. Examples each replica computes on per step.
        shard: String. Auto-shard policy (default "data": each worker keeps every N-th element,
            which works for any source; use "file" for many input files, "off" when each worker
            already reads its own data).

    Example:
        >>> ds = keras_amp.distribute.prepare(ds, strategy, per_replica_batch_size=64)
        >>> model.fit(ds, epochs=3)
    """
    batch = global_batch_size(per_replica_batch_size, strategy)
    return with_auto_shard_policy(dataset.batch(batch, drop_remainder=True), shard)

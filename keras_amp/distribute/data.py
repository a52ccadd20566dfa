"""Input pipelines under tf.distribute: global vs per-replica batch size, auto-shard policy.

Keras `fit` treats the batch size of a `tf.data.Dataset` as the *global* batch: with N replicas
in sync each replica computes on global/N examples per step. Under MultiWorkerMirroredStrategy
each worker also needs a distinct part of the data; `tf.data` auto-sharding does that (by files
when the source is files, otherwise by elements), and `OFF` means every worker reads everything.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from keras_amp import validation

_POLICIES = {
    "auto": tf.data.experimental.AutoShardPolicy.AUTO,
    "file": tf.data.experimental.AutoShardPolicy.FILE,
    "data": tf.data.experimental.AutoShardPolicy.DATA,
    "hint": tf.data.experimental.AutoShardPolicy.HINT,
    "off": tf.data.experimental.AutoShardPolicy.OFF,
}
# tf.data transformations after which an element is no longer what the input's element was, so a
# batch upstream of them says nothing about the output (unbatch, flat_map, interleave, window).
_RESTRUCTURING = ("Unbatch", "FlatMap", "Interleave", "Window")


def _check_strategy(strategy) -> tf.distribute.Strategy:
    return validation.check_type("strategy", strategy, tf.distribute.Strategy, "a tf.distribute.Strategy")


def _check_dataset(dataset) -> tf.data.Dataset:
    return validation.check_type(
        "dataset", dataset, tf.data.Dataset, "a tf.data.Dataset (e.g. tf.data.Dataset.from_tensor_slices(arrays))"
    )


def _batch_first(function: str, name: str, value: Any, strategy: Any) -> None:
    """A TypeError naming the order when the strategy came first (`prepare` takes the strategy first)."""
    if isinstance(value, tf.distribute.Strategy):
        raise TypeError(f"`{function}({name}, strategy)` takes the batch size first. Received: {name}="
                        f"{type(value).__name__} object, strategy={strategy!r}. Allowed: "
                        f"{function}({name}=..., strategy=...)")


def global_batch_size(per_replica_batch_size: int, strategy: tf.distribute.Strategy) -> int:
    """The batch size to give the dataset so that each replica computes on `per_replica_batch_size`."""
    _batch_first("global_batch_size", "per_replica_batch_size", per_replica_batch_size, strategy)
    per_replica_batch_size = validation.check_int("per_replica_batch_size", per_replica_batch_size, min_value=1)
    return per_replica_batch_size * _check_strategy(strategy).num_replicas_in_sync


def per_replica_batch_size(global_batch_size: int, strategy: tf.distribute.Strategy) -> int:
    """The batch each replica computes on for a dataset batched at `global_batch_size`.

    Raises ValueError when the global batch does not split evenly: uneven replica batches give
    replicas different gradient scales and (in float16) different overflow behaviour.
    """
    _batch_first("per_replica_batch_size", "global_batch_size", global_batch_size, strategy)
    global_batch_size = validation.check_int("global_batch_size", global_batch_size, min_value=1)
    n = _check_strategy(strategy).num_replicas_in_sync
    if global_batch_size % n:
        raise ValueError(
            f"`global_batch_size` must be a multiple of the {n} replicas in sync. "
            f"Received: global_batch_size={global_batch_size}. Allowed: multiples of {n}, "
            f"e.g. {global_batch_size - global_batch_size % n or n}"
        )
    return global_batch_size // n


def _batched_by(dataset: tf.data.Dataset) -> str | None:
    """The batching transformation upstream of `dataset` (e.g. "_BatchDataset"), or None if none is seen.

    Reads tf.data's transformation chain (`Dataset._inputs()`, a private method of TF 2.x
    datasets; tests/distribute/test_data.py fails if that changes). A dataset that
    reads batches from files or a generator is not recognised.
    """
    pending = [_check_dataset(dataset)]
    while pending:
        ds = pending.pop()
        name = type(ds).__name__
        # batch, padded_batch, ragged_batch, map_and_batch, ...; group_by_window (and so
        # bucket_by_sequence_length) exists to batch each group.
        if "Batch" in name and "Unbatch" not in name or "GroupByWindow" in name:
            return name
        if any(part in name for part in _RESTRUCTURING):
            continue
        inputs = getattr(ds, "_inputs", None)
        pending.extend(inputs() if callable(inputs) else [])
    return None


def with_auto_shard_policy(dataset: tf.data.Dataset, policy: str) -> tf.data.Dataset:
    """`dataset` with its distribute auto-shard policy set ("auto", "file", "data", "hint", "off")."""
    _check_dataset(dataset)
    validation.check_choice("policy", policy, _POLICIES)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = _POLICIES[policy]
    return dataset.with_options(options)


def auto_shard_policy(dataset: tf.data.Dataset) -> str:
    """The auto-shard policy `dataset` carries, as one of the names `with_auto_shard_policy` takes."""
    found = _check_dataset(dataset).options().experimental_distribute.auto_shard_policy
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
    An already-batched dataset raises ValueError rather than being batched a second time.

    Args:
        dataset: Unbatched `tf.data.Dataset` of examples. One batched by `.batch()`,
            `.padded_batch()`, `.ragged_batch()` or similar raises ValueError; batch it with
            `global_batch_size()` yourself and call `with_auto_shard_policy()`, or pass
            `dataset.unbatch()`.
        strategy: The `tf.distribute.Strategy` it will be trained under.
        per_replica_batch_size: Int. Examples each replica computes on per step.
        shard: String. Auto-shard policy (default "data": each worker keeps every N-th element,
            which works for any source; use "file" for many input files, "off" when each worker
            already reads its own data).

    Example:
        >>> ds = keras_amp.distribute.prepare(ds, strategy, per_replica_batch_size=64)
        >>> model.fit(ds, epochs=3)
    """
    _check_dataset(dataset)
    batch = global_batch_size(per_replica_batch_size, strategy)
    validation.check_choice("shard", shard, _POLICIES)
    found = _batched_by(dataset)
    if found is not None:
        raise ValueError(
            "`dataset` must be unbatched: prepare() batches it at the global batch size, and a "
            "second batch would train on batches of batches. "
            f"Received: dataset batched upstream by {found}, element_spec={dataset.element_spec}. "
            "Allowed: an unbatched dataset, e.g. dataset.unbatch(); or keep your batches and call "
            "with_auto_shard_policy(dataset, shard) with global_batch_size(per_replica_batch_size, strategy)."
        )
    return with_auto_shard_policy(dataset.batch(batch, drop_remainder=True), shard)

"""Cross-worker verification: every replica and worker runs the same precision settings, or all fail.

`verify(strategy)` checks once, where it is called; `VerifyPrecision` is a Keras callback that
checks at the start of every `fit()` and `evaluate()`, when the model and optimizer are built.

The fields come from `AmpConfig.fingerprint_fields()` (policy, per-layer policies, loss-scale
config, TF32, TF/Keras versions), the single definition of "settings that must match". Each field
is hashed to an int64 and the vectors are all-gathered, so every worker sees the same table and
raises the same error naming the differing fields; nothing waits on a worker that already failed.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from keras_amp import model_graph
from keras_amp import policy as amp_policy
from keras_amp import validation

_MAX_SHOWN = 160  # characters of a differing value shown per worker (layer_policies can be long)


class FingerprintMismatchError(ValueError):
    """Workers of one strategy run different precision settings.

    Attributes:
        fields: Sorted list of the field names that differ.
        values: Dict field -> list of each worker's value (by worker index).
    """

    def __init__(self, message: str, fields: list[str], values: dict[str, list[str]]):
        super().__init__(message)
        self.fields = fields
        self.values = values


def current_config() -> amp_policy.AmpConfig:
    """`keras_amp.config()`, or a description of the global Keras policy when not enabled."""
    config = amp_policy.config()
    if config is not None:
        return config
    dtype_policy = keras.config.dtype_policy()
    return amp_policy.AmpConfig(
        policy=dtype_policy.name,
        compute_dtype=dtype_policy.compute_dtype,
        variable_dtype=dtype_policy.variable_dtype,
        loss_scaling=dtype_policy.compute_dtype == "float16",
        tf32=bool(tf.config.experimental.tensor_float_32_execution_enabled()),
        device="",
        requested="keras global policy",
        reason="keras_amp.enable() not called",
    )


def check_timeout_seconds(timeout_seconds: Any) -> float | None:
    """`timeout_seconds` as a float > 0, or None (wait forever)."""
    if timeout_seconds is None:
        return None
    return validation.check_float("timeout_seconds", timeout_seconds, min_value=0, min_inclusive=False)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big", signed=True)


# strategy -> {timeout: its all-gather tf.function}. One function per strategy and timeout, the array its
# argument: a function made per call is traced per call, and TensorFlow warns of retracing after five.
_GATHERS: "weakref.WeakKeyDictionary[tf.distribute.Strategy, dict]" = weakref.WeakKeyDictionary()


def _gather_function(strategy: tf.distribute.Strategy, options):
    gathers = _GATHERS.setdefault(strategy, {})
    if options.timeout_seconds not in gathers:
        owner = weakref.ref(strategy)  # the cached function must not keep its strategy alive

        def gather(value):
            # An identity on the replica's device: a function argument has none, and
            # MultiWorkerMirroredStrategy gathers to the devices of the value it is given.
            return tf.distribute.get_replica_context().all_gather(tf.identity(value), axis=0, options=options)

        # Inside a tf.function: eager collectives under MultiWorkerMirroredStrategy are slow and warn.
        def run(value):
            return owner().run(gather, args=(value,))

        # Traced once per array length (not `reduce_retracing`: a collective needs static shapes).
        gathers[options.timeout_seconds] = tf.function(run, autograph=False)
    return gathers[options.timeout_seconds]


def _all_gather(strategy: tf.distribute.Strategy, array: np.ndarray, options) -> np.ndarray:
    """Gathers a 1-D int64 array from every replica: shape [num_replicas_in_sync, len(array)]."""
    gathered = _gather_function(strategy, options)(tf.constant(np.asarray(array, np.int64)[None, :]))
    return strategy.experimental_local_results(gathered)[0].numpy()


def _gather_strings(strategy, texts: list[str], options) -> list[list[str]]:
    """All-gathers short strings (as padded utf-8 bytes): result[replica][i]."""
    blobs = [t.encode("utf-8") for t in texts]
    lengths = _all_gather(strategy, np.array([len(b) for b in blobs], np.int64), options)
    width = int(lengths.max()) if lengths.size else 0
    padded = np.zeros((len(blobs), max(width, 1)), np.int32)
    for i, b in enumerate(blobs):
        padded[i, : len(b)] = np.frombuffer(b, np.uint8)
    table = _all_gather(strategy, padded.reshape(-1), options).reshape(lengths.shape[0], len(blobs), -1)
    return [
        [bytes(table[r, i, : lengths[r, i]].astype(np.uint8)).decode("utf-8", "replace") for i in range(len(blobs))]
        for r in range(lengths.shape[0])
    ]


def _barrier(strategy) -> None:
    """One more collective before the caller raises (and probably exits).

    Collectives are pulled from the peer: a worker that leaves a collective first and exits at once
    can take its buffers with it, and the slower worker then dies of "peer unavailable" instead of
    raising the mismatch error. After this barrier every worker holds all phase-3 data, so an error
    here (peer already gone) is ignored: the message is already complete.
    """
    try:
        _all_gather(strategy, np.zeros(1, np.int64), tf.distribute.experimental.CommunicationOptions(timeout_seconds=30))
    except (tf.errors.OpError, RuntimeError) as e:  # noqa: PERF203
        logging.info("keras_amp.distribute.verify: barrier before raising failed (%s); raising anyway", e)


def _worker_of_replica(strategy) -> list[int]:
    local = len(getattr(strategy.extended, "worker_devices", ())) or 1
    return [r // local for r in range(strategy.num_replicas_in_sync)]


def verify(
    strategy: tf.distribute.Strategy,
    *,
    model: Any = None,
    optimizer: Any = None,
    timeout_seconds: float | None = None,
) -> dict[str, str]:
    """Checks that every replica and worker of `strategy` runs the same precision settings.

    Call it on every worker at the same point of the program (it runs collectives).

    Args:
        strategy: A `tf.distribute.Strategy`.
        model: Keras model or None. Adds the per-layer dtype policies to the comparison.
        optimizer: Keras optimizer or None. Adds the loss-scale configuration.
        timeout_seconds: Float or None. Collective timeout for the check; None uses the
            strategy's communication options.

    Returns:
        This worker's fingerprint fields (identical on every worker when it returns).

    Raises:
        FingerprintMismatchError: (a ValueError) on every worker, naming the fields that differ
            and each worker's value.

    Example:
        >>> keras_amp.enable("mixed_bfloat16")
        >>> strategy = keras_amp.distribute.multi_worker(timeout_seconds=300)  # verifies already
        >>> with strategy.scope():
        ...     model = build_model()
        ...     model.compile(optimizer=keras_amp.wrap(keras.optimizers.Adam()), loss="mse")
        >>> model.build((None, 8))
        >>> keras_amp.distribute.verify(strategy, model=model, optimizer=model.optimizer)
    """
    validation.check_type("strategy", strategy, tf.distribute.Strategy, "a tf.distribute.Strategy")
    if model is not None:
        validation.check_type("model", model, keras.layers.Layer, "a Keras model (or layer) or None")
    if optimizer is not None:
        validation.check_type("optimizer", optimizer, keras.optimizers.Optimizer, "a Keras optimizer or None")
    timeout_seconds = check_timeout_seconds(timeout_seconds)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    layers = None if model is None else model_graph.walk(model)  # the recipes' layer list
    fields = current_config().fingerprint_fields(layers=layers, optimizer=optimizer)
    names = sorted(fields)
    if strategy.num_replicas_in_sync == 1:
        return fields

    # Phase 1: the set of field names (one int64), so phase 2's vectors have equal lengths.
    name_hashes = _all_gather(strategy, np.array([_hash64("\n".join(names))], np.int64), options)
    if len(set(name_hashes[:, 0].tolist())) > 1:
        per_replica = _gather_strings(strategy, [",".join(names)], options)
        values = {"field names": [row[0] for row in per_replica]}
        error = FingerprintMismatchError(_message(strategy, ["field names"], values), ["field names"], values)
        _barrier(strategy)
        raise error

    # Phase 2: one hash per field; every worker computes the same list of differing fields.
    table = _all_gather(strategy, np.array([_hash64(fields[n]) for n in names], np.int64), options)
    differ = [n for j, n in enumerate(names) if len(set(table[:, j].tolist())) > 1]
    if differ:
        # Phase 3 (only on mismatch, identically on every worker): the readable values.
        per_replica = _gather_strings(strategy, [fields[n] for n in differ], options)
        values = {n: [row[i] for row in per_replica] for i, n in enumerate(differ)}
        error = FingerprintMismatchError(_message(strategy, differ, values), differ, values)
        _barrier(strategy)
        raise error
    logging.info("keras_amp.distribute.verify: %d replicas agree on %s", strategy.num_replicas_in_sync, names)
    return fields


def _differing_parts(per_worker: dict[int, str]) -> dict[int, str]:
    """Each worker's value cut down to what differs: JSON object keys / list items, else the text."""
    try:
        parsed = {w: json.loads(v) for w, v in per_worker.items()}
    except ValueError:
        parsed = None
    if parsed and all(isinstance(p, dict) for p in parsed.values()):
        keys = sorted({k for p in parsed.values() for k in p})
        diff = [k for k in keys if len({json.dumps(p.get(k), sort_keys=True) for p in parsed.values()}) > 1]
        return {w: json.dumps({k: p.get(k) for k in diff}) for w, p in parsed.items()}
    if parsed and all(isinstance(p, list) for p in parsed.values()) and len({len(p) for p in parsed.values()}) == 1:
        rows = zip(*parsed.values())
        diff = [i for i, row in enumerate(rows) if len({json.dumps(r) for r in row}) > 1]
        return {w: json.dumps([p[i] for i in diff]) for w, p in parsed.items()}
    return per_worker


def _message(strategy, differ: list[str], values: dict[str, list[str]]) -> str:
    workers = _worker_of_replica(strategy)
    lines = [
        "Every worker must run the same precision settings (keras_amp.enable() policy, per-layer "
        f"policies, loss-scale settings, TF32, TF/Keras versions). Received different {', '.join(differ)}:"
    ]
    for field in differ:
        seen = {}
        for replica, value in enumerate(values[field]):
            seen.setdefault(workers[replica], value)
        shown = ", ".join(
            f"worker {w}: {v[:_MAX_SHOWN] + ('...' if len(v) > _MAX_SHOWN else '')}"
            for w, v in sorted(_differing_parts(seen).items())
        )
        lines.append(f"  {field}: {shown}")
    lines.append(
        "Start every worker with the same keras_amp.enable() arguments, model code and optimizer "
        "settings (enable() before building the model)."
    )
    return "\n".join(lines)


class VerifyPrecision(keras.callbacks.Callback):
    """Verifies, as `fit()` and `evaluate()` start, that every worker runs the same precision settings.

    Runs `verify()` on the model's distribute strategy with the model (per-layer dtype policies)
    and its optimizer (loss-scale configuration): a worker that built a layer with another policy
    or chose another loss-scale tier makes every worker raise `FingerprintMismatchError` naming
    the field, before the first step. Under a strategy Keras builds the model and the optimizer
    before it calls `on_train_begin` / `on_test_begin`, so layers created in `build()` are
    compared too. It checks again at each validation run inside `fit()` (two small collectives),
    which also catches a policy changed by another callback during training.

    Pass it to `fit()`/`evaluate()` on every worker: it runs collectives, and callbacks run in
    the same order everywhere. With one replica it compares nothing and costs nothing.

    Args:
        timeout_seconds: Float or None. Collective timeout of the check; None (default) uses the
            strategy's communication options.

    Attributes:
        fields: Dict or None. The fingerprint fields of the last successful check.

    Example:
        >>> strategy = keras_amp.distribute.multi_worker(timeout_seconds=600)
        >>> with strategy.scope():
        ...     model = build_model()
        ...     model.compile(optimizer=keras_amp.wrap(keras.optimizers.Adam()), loss="mse")
        >>> model.fit(dataset, epochs=3, callbacks=[keras_amp.distribute.VerifyPrecision()])
    """

    def __init__(self, timeout_seconds: float | None = None):
        super().__init__()
        self.timeout_seconds = check_timeout_seconds(timeout_seconds)
        self.fields = None

    def _verify(self) -> None:
        self.fields = verify(
            self.model.distribute_strategy,
            model=self.model,
            optimizer=getattr(self.model, "optimizer", None),
            timeout_seconds=self.timeout_seconds,
        )

    def on_train_begin(self, logs=None):
        self._verify()

    def on_test_begin(self, logs=None):
        self._verify()

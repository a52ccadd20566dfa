"""`mirrored()` and `multi_worker()`: tf.distribute strategies that keep precision consistent.

Both are thin over TensorFlow's strategies. What they add: the `keras_amp.enable()` settings are
compared across replicas/workers as soon as a collective is possible (right after creation), and
`multi_worker()` installs the Keras 3.15 fit fix. To compare the model's per-layer policies and
the optimizer's loss-scale settings as well, pass `VerifyPrecision()` to `fit()`/`evaluate()`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import tensorflow as tf
from absl import logging

from keras_amp import policy as amp_policy
from keras_amp import validation
from keras_amp.distribute import trainer_fix
from keras_amp.distribute.verification import check_timeout_seconds, verify

_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}
_TF_CONFIG_EXAMPLE = '{"cluster": {"worker": ["host0:12345", "host1:12345"]}, "task": {"type": "worker", "index": 0}}'


def read_tf_config() -> dict[str, Any] | None:
    """The TF_CONFIG environment variable as a dict, None when unset; ValueError when malformed.

    TensorFlow reads TF_CONFIG itself and fails deep inside on a malformed one (a bare
    JSONDecodeError, or an AttributeError for a JSON list); this names the variable instead.
    """
    text = os.environ.get("TF_CONFIG")
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(
            f"The TF_CONFIG environment variable must be JSON ({e}). Received: TF_CONFIG={text!r}. "
            f"Allowed: a JSON object such as {_TF_CONFIG_EXAMPLE}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"The TF_CONFIG environment variable must be a JSON object. Received: TF_CONFIG={text!r}. "
            f"Allowed: a JSON object such as {_TF_CONFIG_EXAMPLE}"
        )
    for key in ("cluster", "task"):
        if key in config and not isinstance(config[key], dict):
            raise ValueError(
                f'TF_CONFIG\'s "{key}" must be a JSON object. Received: TF_CONFIG={text!r}. '
                f"Allowed: a JSON object such as {_TF_CONFIG_EXAMPLE}"
            )
    task, cluster = config.get("task", {}), config.get("cluster", {})
    index, members = task.get("index"), cluster.get(task.get("type"))
    if isinstance(index, int) and not isinstance(index, bool) and isinstance(members, list):
        if not 0 <= index < len(members):
            raise ValueError(
                f'TF_CONFIG\'s task "index" must name one of the cluster\'s {len(members)} '
                f'"{task.get("type")}" tasks (0 to {len(members) - 1}). Received: TF_CONFIG={text!r}. '
                f"Allowed: a JSON object such as {_TF_CONFIG_EXAMPLE}"
            )
    return config


def _log_policy(kind: str, strategy: tf.distribute.Strategy) -> None:
    config = amp_policy.config()
    if config is None:
        logging.info(
            "keras_amp.distribute.%s: keras_amp.enable() not called; replicas run the global Keras "
            "policy. Call keras_amp.enable() before creating the strategy to choose one.",
            kind,
        )
    logging.info(
        "keras_amp.distribute.%s: %d replicas in sync, policy %s",
        kind,
        strategy.num_replicas_in_sync,
        config.policy if config else "(Keras global)",
    )


def mirrored(
    devices: Sequence[str] | None = None,
    *,
    cross_device_ops: tf.distribute.CrossDeviceOps | None = None,
) -> tf.distribute.MirroredStrategy:
    """A `tf.distribute.MirroredStrategy` over this machine's devices, after `keras_amp.enable()`.

    Args:
        devices: List of device strings or None. None (default) uses every GPU, or the CPU.
        cross_device_ops: `tf.distribute.CrossDeviceOps` or None. How gradients are all-reduced;
            None lets TensorFlow choose (NCCL on GPUs).

    Returns:
        The strategy, after checking that its replicas agree on the precision settings.

    Example:
        >>> keras_amp.enable()
        >>> strategy = keras_amp.distribute.mirrored()
        >>> with strategy.scope():
        ...     model = build_model()
        ...     model.compile(optimizer=keras_amp.optimizers.LossScaleOptimizer(...), loss=...)
    """
    if devices is not None:
        if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
            raise TypeError(
                "`devices` must be a list of device strings or None. "
                f"Received: devices={devices!r} of type {type(devices).__name__}"
            )
        for device in devices:
            validation.check_type("devices", device, str, 'a list of device strings such as ["/gpu:0", "/gpu:1"]')
    if cross_device_ops is not None:
        validation.check_type(
            "cross_device_ops", cross_device_ops, tf.distribute.CrossDeviceOps, "a tf.distribute.CrossDeviceOps or None"
        )
    strategy = tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=cross_device_ops)
    _log_policy("mirrored", strategy)
    # One process: replicas share the global policy, so this is a cheap consistency check that
    # exercises the same path the multi-worker case uses.
    verify(strategy)
    return strategy


def multi_worker(
    *,
    timeout_seconds: float | None = None,
    implementation: str = "auto",
    cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
) -> tf.distribute.MultiWorkerMirroredStrategy:
    """A `tf.distribute.MultiWorkerMirroredStrategy` from TF_CONFIG that checks every worker's precision.

    Creating it installs the Keras 3.15 fit fix (see `keras_amp.distribute.trainer_fix`) and
    verifies the `keras_amp.enable()` settings across workers right away: a worker started with
    another policy or TF32 setting fails here, on every worker, naming the field. Pass
    `keras_amp.distribute.VerifyPrecision()` to `fit()` to also compare the model's per-layer
    policies and the optimizer's loss-scale settings.

    Args:
        timeout_seconds: Float or None. Timeout of every collective; a worker that dies or takes
            another branch then fails the others with DeadlineExceeded instead of hanging them.
            None (default) waits forever, TensorFlow's default. Size it above the slowest step,
            including the first one (tracing) and any checkpoint a worker writes alone.
        implementation: String. "auto" (default), "ring" (gRPC, works on CPUs) or "nccl"
            (GPUs; the fastest all-reduce across nodes with GPUs).
        cluster_resolver: `tf.distribute.cluster_resolver.ClusterResolver` or None. None reads
            the TF_CONFIG environment variable (a malformed one raises ValueError).

    Returns:
        The strategy.

    Example:
        >>> # On every node, with TF_CONFIG set for that node:
        >>> keras_amp.enable("mixed_bfloat16")
        >>> strategy = keras_amp.distribute.multi_worker(timeout_seconds=600, implementation="nccl")
        >>> model.fit(dataset, callbacks=[keras_amp.distribute.VerifyPrecision()])
    """
    timeout_seconds = check_timeout_seconds(timeout_seconds)
    validation.check_choice("implementation", implementation, _IMPLEMENTATIONS)
    if cluster_resolver is not None:
        validation.check_type(
            "cluster_resolver",
            cluster_resolver,
            tf.distribute.cluster_resolver.ClusterResolver,
            "a tf.distribute.cluster_resolver.ClusterResolver or None",
        )
    else:
        tf_config = read_tf_config()
        if tf_config is None:
            logging.warning("keras_amp.distribute.multi_worker: TF_CONFIG is not set; running as a single worker.")
        else:
            logging.info("keras_amp.distribute.multi_worker: task %s", tf_config.get("task", {}))
    trainer_fix.install_fit_fix()
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout_seconds, implementation=_IMPLEMENTATIONS[implementation]
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=cluster_resolver, communication_options=options
    )
    _log_policy("multi_worker", strategy)
    verify(strategy)
    return strategy

"""`mirrored()` and `multi_worker()`: tf.distribute strategies that keep precision consistent.

Both are thin over TensorFlow's strategies. What they add: the precision fingerprint is compared
across replicas/workers as soon as a collective is possible (right after creation, and again at
the start of every `fit()`/`evaluate()` with the model's per-layer policies and the optimizer's
loss-scale settings), and for multi-worker the Keras 3.15 fit fix is installed.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import tensorflow as tf
from absl import logging

from keras_amp import policy as amp_policy
from keras_amp.distribute import trainer_fix
from keras_amp.distribute.verify import verify

_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


def configure_logical_cpus(count: int) -> list[tf.config.LogicalDevice]:
    """Splits the first CPU into `count` logical devices, e.g. to try MirroredStrategy without GPUs.

    Must run before TensorFlow initialises its devices (before any op or strategy is created).
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"`count` must be a positive int. Received: count={count!r}")
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError as e:
        raise RuntimeError(
            "configure_logical_cpus() must be called before TensorFlow initialises its devices "
            f"(before creating any tensor or strategy). Received: count={count}; TensorFlow said: {e}"
        ) from e
    return tf.config.list_logical_devices("CPU")


def _check_timeout(timeout_seconds):
    if timeout_seconds is not None and (not isinstance(timeout_seconds, (int, float)) or timeout_seconds <= 0):
        raise ValueError(
            f"`timeout_seconds` must be None or a positive number. Received: timeout_seconds={timeout_seconds!r}"
        )


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
    verify_at_fit: bool = True,
) -> tf.distribute.MultiWorkerMirroredStrategy:
    """A `tf.distribute.MultiWorkerMirroredStrategy` from TF_CONFIG that checks every worker's precision.

    Creating it installs the Keras 3.15 fit fix (see `keras_amp.distribute.trainer_fix`) and
    verifies the `keras_amp.enable()` settings across workers right away: a worker started with
    another policy, loss-scale tier or TF32 setting fails here, on every worker, naming the field.

    Args:
        timeout_seconds: Float or None. Timeout of every collective; a worker that dies or takes
            another branch then fails the others with DeadlineExceeded instead of hanging them.
            None (default) waits forever, TensorFlow's default. Size it above the slowest step,
            including the first one (tracing) and any checkpoint a worker writes alone.
        implementation: String. "auto" (default), "ring" (gRPC, works on CPUs) or "nccl"
            (GPUs; the fastest all-reduce across nodes with GPUs).
        cluster_resolver: `ClusterResolver` or None. None reads TF_CONFIG.
        verify_at_fit: Bool. Also verify the model's per-layer policies and the optimizer's
            loss-scale settings at the start of every `fit()`/`evaluate()` (default True).

    Returns:
        The strategy.

    Example:
        >>> # On every node, with TF_CONFIG set for that node:
        >>> keras_amp.enable("mixed_bfloat16")
        >>> strategy = keras_amp.distribute.multi_worker(timeout_seconds=600, implementation="nccl")
    """
    _check_timeout(timeout_seconds)
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"Unknown `implementation`. Received: implementation={implementation!r}. "
            f"Allowed: {', '.join(_IMPLEMENTATIONS)}"
        )
    if cluster_resolver is None and "TF_CONFIG" not in os.environ:
        logging.warning("keras_amp.distribute.multi_worker: TF_CONFIG is not set; running as a single worker.")
    elif cluster_resolver is None:
        task = json.loads(os.environ["TF_CONFIG"]).get("task", {})
        logging.info("keras_amp.distribute.multi_worker: task %s", task)
    trainer_fix.install_fit_fix()
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout_seconds, implementation=_IMPLEMENTATIONS[implementation]
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=cluster_resolver, communication_options=options
    )
    strategy._keras_amp_verify_at_fit = bool(verify_at_fit)
    _log_policy("multi_worker", strategy)
    verify(strategy)
    return strategy

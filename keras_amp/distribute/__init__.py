"""Distributed training with consistent precision: strategies, verification, data, the fit fix.

    keras_amp.enable("mixed_bfloat16")
    strategy = keras_amp.distribute.multi_worker(timeout_seconds=600)   # TF_CONFIG; verifies
    keras_amp.distribute.verify(strategy, model=model, optimizer=model.optimizer)
"""

from keras_amp.distribute.data import (
    auto_shard_policy,
    global_batch_size,
    per_replica_batch_size,
    prepare,
    with_auto_shard_policy,
)
from keras_amp.distribute.launcher import LocalCluster, WorkerResult, free_ports, launch, tf_config
from keras_amp.distribute.strategies import configure_logical_cpus, mirrored, multi_worker
from keras_amp.distribute.trainer_fix import fit_fix_installed, install_fit_fix, uninstall_fit_fix
from keras_amp.distribute.verify import FingerprintMismatchError, verify

__all__ = [
    "FingerprintMismatchError",
    "LocalCluster",
    "WorkerResult",
    "auto_shard_policy",
    "configure_logical_cpus",
    "fit_fix_installed",
    "free_ports",
    "global_batch_size",
    "install_fit_fix",
    "launch",
    "mirrored",
    "multi_worker",
    "per_replica_batch_size",
    "prepare",
    "tf_config",
    "uninstall_fit_fix",
    "verify",
    "with_auto_shard_policy",
]

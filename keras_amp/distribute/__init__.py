"""Distributed training with consistent precision: strategies, verification, data, the fit fix.

    keras_amp.enable("mixed_bfloat16")
    strategy = keras_amp.distribute.multi_worker(timeout_seconds=600)   # TF_CONFIG; verifies
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras_amp.wrap(keras.optimizers.Adam()), loss="mse")
    model.fit(dataset, callbacks=[keras_amp.distribute.VerifyPrecision()])

`keras_amp.distribute.local_cluster` runs such code on one machine (logical CPUs, or N worker
processes on 127.0.0.1) for trying and testing it.
"""

from keras_amp.distribute import local_cluster
from keras_amp.distribute.data import (
    auto_shard_policy,
    global_batch_size,
    per_replica_batch_size,
    prepare,
    with_auto_shard_policy,
)
from keras_amp.distribute.strategies import mirrored, multi_worker
from keras_amp.distribute.trainer_fix import fit_fix_installed, install_fit_fix, uninstall_fit_fix
from keras_amp.distribute.verification import FingerprintMismatchError, VerifyPrecision, verify

__all__ = [
    "FingerprintMismatchError",
    "VerifyPrecision",
    "auto_shard_policy",
    "fit_fix_installed",
    "global_batch_size",
    "install_fit_fix",
    "local_cluster",
    "mirrored",
    "multi_worker",
    "per_replica_batch_size",
    "prepare",
    "uninstall_fit_fix",
    "verify",
    "with_auto_shard_policy",
]

"""The Keras 3.15 fix that makes `model.fit` work under `MultiWorkerMirroredStrategy`.

Two defects in `keras/src/backend/tensorflow/trainer.py` (Keras 3.15.1, TF 2.21), both only on the
multi-worker path (`_collective_all_reduce_multi_worker(strategy)` is True):

1. `TensorFlowTrainer._maybe_symbolic_build` takes the first batch and reduces it with
   `strategy.reduce("MEAN", batch, axis=None)` just to get its shapes. The collective reducer
   cannot take a nested `PerReplica` structure and fit dies with
   "Attempt to convert a value (PerReplica:{...}) ... to a Tensor". Fix: symbolic build needs
   only shapes and dtypes, so use this worker's first local replica batch (no collective at all).
2. `reduce_per_replica(..., reduction="auto"|"mean")` calls `strategy.reduce("MEAN", v, axis=0)`
   on every log value; the logs are scalars, so the first train step dies with
   "Invalid reduction dimension 0 for input with 0 dimensions". Fix: reduce across replicas only
   (`axis=None`), which is what the single-worker branch of the same function computes
   (`tf.reduce_mean(local_results, axis=0)` over the stacked replicas).

Both replacements delegate to the original Keras function on every other path, so single-worker,
MirroredStrategy, TPU, "concat" and "sum" behaviour is untouched. The fix is installed only for
Keras 3.15.x and only when the original sources are the ones it was written against (pinned in
keras_amp._compat.PINS).
"""

from __future__ import annotations

import threading
import warnings

import keras
from absl import logging

from keras_amp import _compat
from keras_amp.policy import AmpWarning

_TRAINER = "keras.src.backend.tensorflow.trainer"
BUILD = f"{_TRAINER}.TensorFlowTrainer._maybe_symbolic_build"
REDUCE = f"{_TRAINER}.reduce_per_replica"
# Read, not replaced: it decides which path is "multi-worker", for Keras and for this fix alike.
IS_MULTI_WORKER = f"{_TRAINER}._collective_all_reduce_multi_worker"
PINNED = (BUILD, REDUCE, IS_MULTI_WORKER)  # keras_amp._compat.PINS rows, feature FIT_FIX

_ORIGINAL_BUILD = _compat.original(BUILD)
_ORIGINAL_REDUCE = _compat.original(REDUCE)
_IS_MULTI_WORKER = _compat.original(IS_MULTI_WORKER)
_lock = threading.Lock()
_installed = False


def _trainer_module():
    return _compat.lookup(_TRAINER)


def _multi_worker(strategy) -> bool:
    return strategy is not None and _IS_MULTI_WORKER(strategy)


def fixed_maybe_symbolic_build(self, iterator=None, data_batch=None):
    """`TensorFlowTrainer._maybe_symbolic_build` that builds from a local batch on multi-worker."""
    strategy = self._distribute_strategy
    if iterator is None or not _multi_worker(strategy):
        _ORIGINAL_BUILD(self, iterator=iterator, data_batch=data_batch)
    else:
        for _, _, it in iterator:
            batch = next(it)
            break
        # Only shapes and dtypes matter here; every replica's batch has the same ones.
        data_batch = keras.tree.map_structure(lambda v: strategy.experimental_local_results(v)[0], batch)
        _ORIGINAL_BUILD(self, data_batch=data_batch)


def fixed_reduce_per_replica(values, strategy, reduction):
    """`reduce_per_replica` whose multi-worker "mean" reduces across replicas only (axis=None)."""
    if reduction == "auto" and not isinstance(strategy, _trainer_module().tf.distribute.TPUStrategy):
        reduction = "mean"
    if reduction == "mean" and _multi_worker(strategy):
        return keras.tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
    return _ORIGINAL_REDUCE(values, strategy, reduction)


def fit_fix_needed() -> tuple[bool, str]:
    """Whether this Keras is the one the fix targets, and why not when it is not."""
    found = _compat.problems(PINNED)
    if found:
        return False, (
            f"keras_amp's multi-worker fit fix was written against Keras {_compat.TESTED_KERAS}x and is "
            f"not installed: {'; '.join(found)}. Check whether fit under MultiWorkerMirroredStrategy "
            "works without it (tests/distribute/test_trainer_fix.py) and update "
            "keras_amp.distribute.trainer_fix."
        )
    return True, ""


def install_fit_fix() -> bool:
    """Installs the multi-worker fit fix; returns whether it is installed (idempotent).

    Only for Keras 3.15.x with unchanged sources; otherwise warns (`AmpWarning`) and leaves Keras
    alone, since a fix written for other code could be wrong there.
    """
    global _installed
    with _lock:
        if _installed:
            return True
        needed, why = fit_fix_needed()
        if not needed:
            warnings.warn(why, AmpWarning, stacklevel=2)
            return False
        trainer = _trainer_module()
        trainer.TensorFlowTrainer._maybe_symbolic_build = fixed_maybe_symbolic_build
        # `_make_function` looks `reduce_per_replica` up in the module globals when it traces.
        trainer.reduce_per_replica = fixed_reduce_per_replica
        _installed = True
    logging.info("keras_amp: installed the Keras %s MultiWorkerMirroredStrategy fit fix", keras.__version__)
    return True


def uninstall_fit_fix() -> None:
    """Restores the original Keras functions (for tests)."""
    global _installed
    with _lock:
        if _ORIGINAL_BUILD is not None and _ORIGINAL_REDUCE is not None:
            trainer = _trainer_module()
            trainer.TensorFlowTrainer._maybe_symbolic_build = _ORIGINAL_BUILD
            trainer.reduce_per_replica = _ORIGINAL_REDUCE
        _installed = False


def fit_fix_installed() -> bool:
    """Whether `install_fit_fix()` is in effect."""
    return _installed and _trainer_module().reduce_per_replica is fixed_reduce_per_replica

"""Guards for keras_amp.distribute.trainer_fix: fail loudly when a Keras upgrade changes what it fixes."""

import sys
from pathlib import Path

import keras
import pytest

from keras_amp.distribute import trainer_fix

sys.path.insert(0, str(Path(__file__).parent / "distribute"))
from harness import COLLECTIVE_TIMEOUT, cluster  # noqa: E402


def test_keras_is_the_version_the_fit_fix_targets():
    assert keras.__version__.startswith(trainer_fix.TARGET_KERAS), (
        f"Keras {keras.__version__}: re-check whether MultiWorkerMirroredStrategy fit still needs "
        "keras_amp.distribute.trainer_fix (run tests/distribute), then update TARGET_KERAS."
    )


def test_patched_keras_sources_unchanged():
    found = trainer_fix.source_sha256()
    assert found == trainer_fix.ORIGINAL_SOURCE_SHA256, (
        "Keras changed the functions keras_amp.distribute.trainer_fix replaces; re-read "
        "keras/src/backend/tensorflow/trainer.py and update or drop the fix. "
        f"Received: {found}"
    )
    needed, why = trainer_fix.fit_fix_needed()
    assert needed, why


def test_install_is_idempotent_and_reversible():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.reduce_per_replica
    try:
        assert trainer_fix.install_fit_fix() and trainer_fix.install_fit_fix()
        assert tf_trainer.reduce_per_replica is trainer_fix.fixed_reduce_per_replica
        assert trainer_fix.fit_fix_installed()
    finally:
        trainer_fix.uninstall_fit_fix()
    assert tf_trainer.reduce_per_replica is original and not trainer_fix.fit_fix_installed()


def test_single_worker_paths_delegate_to_keras():
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()  # default strategy: not multi-worker
    values = {"loss": tf.constant(2.0)}
    assert trainer_fix.fixed_reduce_per_replica(values, strategy, "auto")["loss"].numpy() == 2.0


@pytest.mark.distributed
@pytest.mark.parametrize(
    "fix, error, text",
    [
        # Defect 1: the symbolic build reduces a nested PerReplica batch with the collective reducer.
        pytest.param("none", "ValueError", "PerReplica", id="stock-symbolic-build"),
        # Defect 2, reached once defect 1 is fixed: scalar logs reduced along axis 0.
        pytest.param("build", "ValueError", "Invalid reduction dimension 0", id="build-fix-only-reduce"),
    ],
)
def test_stock_keras_fit_still_crashes_under_multi_worker(fix, error, text):
    """If this starts passing fit, Keras fixed the defect: drop that half of trainer_fix."""
    workers, results = cluster("mwms_fit", "mixed_bfloat16", fix, COLLECTIVE_TIMEOUT)
    for w, r in zip(workers, results):
        assert w.returncode == 3 and r.get("error") == error and text in r["message"], w.tail()
        assert not r.get("fix_installed", False)

"""keras_amp.distribute.trainer_fix: what it fixes still needs fixing, and it only fixes.

The source digests of the Keras functions it replaces or reads are rows of keras_amp._compat.PINS
(checked in tests/test_keras_guards.py); here are the checks that are the fix's own: the runtime
install condition, install/uninstall, delegation, and that stock Keras still crashes.
"""

import keras
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer

from keras_amp import _compat
from keras_amp.distribute import trainer_fix
from keras_amp.policy import AmpWarning
from tests.distribute.harness import COLLECTIVE_TIMEOUT, cluster


def test_keras_is_the_version_the_fit_fix_targets():
    assert keras.__version__.startswith(_compat.TESTED_KERAS), (
        f"Keras {keras.__version__}: re-check whether MultiWorkerMirroredStrategy fit still needs "
        "keras_amp.distribute.trainer_fix (run tests/distribute), then update keras_amp._compat."
    )


def test_fit_fix_installs_on_this_keras():
    # The install-time check (keras_amp._compat's pins of the three functions) passes here.
    needed, why = trainer_fix.fit_fix_needed()
    assert needed, why


def test_install_is_idempotent_and_reversible():
    original = tf_trainer.reduce_per_replica
    try:
        assert trainer_fix.install_fit_fix() and trainer_fix.install_fit_fix()
        assert tf_trainer.reduce_per_replica is trainer_fix.fixed_reduce_per_replica
        assert trainer_fix.fit_fix_installed()
    finally:
        trainer_fix.uninstall_fit_fix()
    assert tf_trainer.reduce_per_replica is original and not trainer_fix.fit_fix_installed()


def test_single_worker_paths_delegate_to_keras():
    strategy = tf.distribute.get_strategy()  # default strategy: not multi-worker
    values = {"loss": tf.constant(2.0)}
    assert trainer_fix.fixed_reduce_per_replica(values, strategy, "auto")["loss"].numpy() == 2.0


def test_fix_only_fixes():
    """No verification hides in the patched build, and nothing marks the strategy (issue 9)."""
    import inspect

    source = inspect.getsource(trainer_fix)
    assert "verification" not in source and "verify(" not in source and "_keras_amp_" not in source


def test_unchanged_source_check_refuses_when_a_function_changed(monkeypatch):
    """Guard that the runtime check is real: a different digest means the fix stays out."""
    name = trainer_fix.IS_MULTI_WORKER
    monkeypatch.setitem(_compat.PIN_BY_NAME, name, _compat.Pin(name, "0" * 16, (_compat.FIT_FIX,)))
    trainer_fix.uninstall_fit_fix()  # install_fit_fix() returns early once installed
    needed, why = trainer_fix.fit_fix_needed()
    assert not needed and "_collective_all_reduce_multi_worker" in why
    with pytest.warns(AmpWarning, match="not installed"):
        assert not trainer_fix.install_fit_fix()
    assert tf_trainer.reduce_per_replica is not trainer_fix.fixed_reduce_per_replica


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

"""Every test leaves the globals as it found them: dtype policy, TF32, keras_amp state and op rules,
Keras session."""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_amp  # noqa: E402
from keras_amp import op_rules  # noqa: E402
from keras_amp import policy as amp_policy  # noqa: E402
from keras_amp.distribute import trainer_fix  # noqa: E402


@pytest.fixture(autouse=True)
def restore_globals():
    saved_policy = keras.config.dtype_policy()
    saved_tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    start = time.perf_counter()
    yield
    keras_amp.disable()
    assert amp_policy.config() is None
    op_rules.uninstall()  # a test may install rules directly, without enable()
    keras.config.set_dtype_policy(saved_policy)
    tf.config.experimental.enable_tensor_float_32_execution(saved_tf32)
    # A full garbage collection (clear_session's `free_memory`) scans TensorFlow's whole heap: a tenth of a
    # second or more, most of a quick test's time. After a test under a second, Python's own collections
    # suffice until the next longer test's full one.
    keras.backend.clear_session(free_memory=time.perf_counter() - start > 1.0)


@pytest.fixture
def no_op_rules():
    """The op rules uninstalled before and after the test (a test may install them directly)."""
    op_rules.uninstall()
    yield
    op_rules.uninstall()


@pytest.fixture
def stock_keras(no_op_rules):
    """Keras as it ships: no op rule and no fit fix installed (the fit fix restored afterwards)."""
    fit_fix = trainer_fix.fit_fix_installed()
    trainer_fix.uninstall_fit_fix()
    yield
    if fit_fix:
        trainer_fix.install_fit_fix()

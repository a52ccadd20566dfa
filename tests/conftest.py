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


# The modules that take longest, longest first (`make test --durations`, 2-core Zen 3). `make test` runs
# modules whole in two processes (`--dist loadscope`) and, with `--no-loadscope-reorder`, hands them out in
# this order: the long ones start first and the many short ones fill in behind them, so both processes end
# together. (xdist's own order, most tests first, started these last, and one process ran them alone.)
LONGEST_FIRST = (
    "corpus/test_census_applications.py",
    "test_examples.py",
    "test_examples_resume.py",
    "test_bench_smoke.py",
    "corpus/test_corpus.py",
    "corpus/test_census_vision.py",
    "distribute/test_distribute_multi_worker.py",
    "corpus/test_census_text_b.py",
    "corpus/test_census_text_a.py",
    "op_rules/test_dataflow_keras_hub.py",
    "test_multi_worker_example.py",
    "test_quickstart.py",
    "distribute/test_distribute_fault_tolerance.py",
    "distribute/test_distribute_mirrored.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests = os.path.dirname(os.path.abspath(__file__))

    def module_rank(item):
        return rank.get(os.path.relpath(str(item.path), tests).replace(os.sep, "/"), len(rank))

    items.sort(key=module_rank)  # stable: the rest keep pytest's order


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

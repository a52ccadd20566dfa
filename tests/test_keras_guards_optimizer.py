"""Guards: fail loudly if the Keras/TF internals keras_amp.LossScaleOptimizer relies on change.

The overrides in keras_amp/optimizers/loss_scale_optimizer.py were written against Keras 3.15.1
and TensorFlow 2.21. When one of these fails, re-read the stock method, port the change into
the override, then update the hash here.
"""


import keras
import pytest
import tensorflow as tf
from keras.src.optimizers import loss_scale_optimizer as stock_module
from tensorflow.python.ops import control_flow_util

from tests.keras_guard import source_digest

# sha256(inspect.getsource(...))[:16] of the stock methods, Keras 3.15.1.
STOCK_LSO = {
    "__init__": "1a88b249924ffaf5",
    "build": "93180a11e6397255",
    "apply": "1cc61fb4c21edb7a",
    "_tf_apply": "e702c4db1a0622e3",
    "_common_apply": "4bb166c7e69089d7",
    "_stateful_handle_finite_grads": "6e4577e03d1ef28d",
    "_stateful_handle_non_finite_grads": "62cf46621318f165",
    "stateless_apply": "848e03d5e2276572",
    "scale_loss": "2c14009a46386fdd",
    "check_finite": "b0ce693a4ff0133b",
    "get_config": "25a7f3660ecf49f7",
    "from_config": "3f6c367ccaafff32",
}
BASE_OPTIMIZER = {
    "load_own_variables": "a6e0c5e7e88c4d33",
    "save_own_variables": "5c789905e2679bf5",
    "build": "e9d310fddad51ed1",
}


_hash = source_digest


def test_versions():
    assert keras.__version__.startswith("3.15"), keras.__version__
    assert tf.__version__.startswith("2.21"), tf.__version__


@pytest.mark.parametrize("name", sorted(STOCK_LSO))
def test_stock_loss_scale_optimizer_method_unchanged(name):
    assert _hash(getattr(stock_module.LossScaleOptimizer, name)) == STOCK_LSO[name], name


@pytest.mark.parametrize("name", sorted(BASE_OPTIMIZER))
def test_base_optimizer_method_unchanged(name):
    assert _hash(getattr(keras.optimizers.Optimizer, name)) == BASE_OPTIMIZER[name], name


def test_stock_variable_layout_is_what_load_own_variables_maps():
    # Our load_own_variables maps a stock store by position: iteration, learning_rate,
    # step_counter, dynamic_scale, then the inner optimizer's variables.
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    opt.build([keras.Variable([1.0])])
    names = [v.name for v in opt._variables]
    assert names == ["iteration", "learning_rate", "step_counter", "dynamic_scale"]


def test_tf_internals_used():
    assert _hash(control_flow_util.GraphOrParentsInXlaContext) == "144a23c08793ec3d"
    assert callable(tf.__internal__.distribute.strategy_supports_no_merge_call)


def test_compile_auto_wraps_only_non_loss_scale_optimizers():
    # compile() keeps ours because it is an instance of the stock class.
    keras.config.set_dtype_policy("mixed_float16")
    from keras_amp.optimizers import LossScaleOptimizer

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt

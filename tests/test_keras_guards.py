"""Guards: fail loudly when the Keras/TensorFlow internals keras_amp relies on change.

One table, `GUARDS`: every private (or overridden) Keras/TF function keras_amp depends on, with
the digest of its source in the pinned versions (`tests/keras_guard.py::source_digest`) and
the keras_amp module that depends on it. When a row fails: re-read the named function, port the
change into the dependent module, then update the digest here. Behaviour that a digest cannot
pin (variable layouts, compile's auto-wrapping) is guarded by the tests below the table.

Add a row as one tuple: `Guard("<where it is defined>.<qualname>", <the object>, "<digest>",
"<keras_amp module>")`.
"""

import importlib
from typing import Any, NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.optimizers import base_optimizer
from keras.src.optimizers import loss_scale_optimizer as stock_lso
from keras.src.utils import tracking
from tensorflow.python.distribute import merge_call_interim
from tensorflow.python.ops import control_flow_util

from tests.keras_guard import source_digest

KERAS_VERSION = "3.15"
TF_VERSION = "2.21"


class Guard(NamedTuple):
    """One pinned dependency: qualified name, the object, its source digest, who depends on it."""

    name: str
    obj: Any
    digest: str
    module: str


_LSO = "keras_amp.optimizers.loss_scale_optimizer"
_STOCK = stock_lso.LossScaleOptimizer
_BASE = base_optimizer.BaseOptimizer

GUARDS = [
    # Stock LossScaleOptimizer: overridden (build, apply, _tf_apply, _common_apply,
    # stateless_apply), re-implemented (the two handlers), or relied on as is.
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.__init__", _STOCK.__init__, "1a88b249924ffaf5", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.build", _STOCK.build, "93180a11e6397255", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.apply", _STOCK.apply, "1cc61fb4c21edb7a", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._tf_apply", _STOCK._tf_apply, "e702c4db1a0622e3", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._common_apply", _STOCK._common_apply, "4bb166c7e69089d7", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._stateful_handle_finite_grads",
          _STOCK._stateful_handle_finite_grads, "6e4577e03d1ef28d", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._stateful_handle_non_finite_grads",
          _STOCK._stateful_handle_non_finite_grads, "62cf46621318f165", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.stateless_apply", _STOCK.stateless_apply, "848e03d5e2276572", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.scale_loss", _STOCK.scale_loss, "2c14009a46386fdd", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.check_finite", _STOCK.check_finite, "b0ce693a4ff0133b", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.get_config", _STOCK.get_config, "25a7f3660ecf49f7", _LSO),
    Guard("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.from_config", _STOCK.from_config, "3f6c367ccaafff32", _LSO),
    # Base optimizer: load_own_variables is overridden (stock-store mapping); the others are read.
    Guard("keras.src.optimizers.base_optimizer.BaseOptimizer.load_own_variables", _BASE.load_own_variables, "a6e0c5e7e88c4d33", _LSO),
    Guard("keras.src.optimizers.base_optimizer.BaseOptimizer.save_own_variables", _BASE.save_own_variables, "5c789905e2679bf5", _LSO),
    Guard("keras.src.optimizers.base_optimizer.BaseOptimizer.build", _BASE.build, "e9d310fddad51ed1", _LSO),
    Guard("keras.src.optimizers.base_optimizer.BaseOptimizer._overwrite_variable_with_gradient",
          _BASE._overwrite_variable_with_gradient, "f6fba7ddf9a6a95e", _LSO),
    Guard("keras.src.utils.tracking.no_automatic_dependency_tracking", tracking.no_automatic_dependency_tracking,
          "b69f1af066ac13e0", _LSO),
    # TensorFlow.
    Guard("tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext",
          control_flow_util.GraphOrParentsInXlaContext, "144a23c08793ec3d", _LSO),
    Guard("tensorflow.python.distribute.merge_call_interim.strategy_supports_no_merge_call",
          merge_call_interim.strategy_supports_no_merge_call, "2eac4f168b29d6a3", _LSO),
]


def _resolve(qualified_name: str) -> Any:
    """The object a dotted name points to: the longest importable module, then attributes."""
    parts = qualified_name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(qualified_name)


def _function(obj: Any) -> Any:
    return getattr(obj, "__func__", obj)  # classmethods


def test_versions_are_the_ones_the_table_was_written_against():
    assert keras.__version__.startswith(KERAS_VERSION), keras.__version__
    assert tf.__version__.startswith(TF_VERSION), tf.__version__


def test_table_is_well_formed():
    names = [g.name for g in GUARDS]
    assert len(names) == len(set(names)), "duplicate rows"
    for guard in GUARDS:
        assert len(guard.digest) == 16 and set(guard.digest) <= set("0123456789abcdef"), guard
        importlib.import_module(guard.module)  # the dependent module exists


@pytest.mark.parametrize("guard", GUARDS, ids=[g.name for g in GUARDS])
def test_guarded_source_unchanged(guard):
    # The name is where the object is defined: a row cannot silently guard something else.
    assert _function(_resolve(guard.name)) is _function(guard.obj), guard.name
    found = source_digest(guard.obj)
    assert found == guard.digest, (
        f"{guard.name} changed (digest {found}, pinned {guard.digest}): re-read it, port the change "
        f"into {guard.module}, then update the row."
    )


def test_tf_internal_route_to_no_merge_call_is_the_guarded_function():
    # The optimizer calls it through tf.__internal__; the row pins the function behind that route.
    assert tf.__internal__.distribute.strategy_supports_no_merge_call is merge_call_interim.strategy_supports_no_merge_call


def test_stock_variable_layout_is_what_load_own_variables_maps():
    # keras_amp's load_own_variables maps a stock store by position: iteration, learning_rate,
    # step_counter, dynamic_scale, then the inner optimizer's variables.
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    opt.build([keras.Variable([1.0])])
    assert [v.name for v in opt._variables] == ["iteration", "learning_rate", "step_counter", "dynamic_scale"]
    assert opt._iterations is opt._variables[0]  # total_steps reads `_iterations`


def test_overwrite_with_gradient_is_a_variable_attribute():
    # _apply_unscaled leaves such gradients unscaled, as stock does: they are values, not gradients.
    variable = keras.Variable(np.zeros(2, "float32"))
    variable.overwrite_with_gradient = True
    assert keras.optimizers.SGD()._overwrite_variable_with_gradient(variable) is True


def test_compile_auto_wraps_only_non_loss_scale_optimizers():
    # compile() keeps ours because it is an instance of the stock class.
    from keras_amp.optimizers import LossScaleOptimizer

    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt

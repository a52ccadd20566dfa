"""Guards: fail loudly when the Keras/TensorFlow internals keras_amp relies on change.

The table is `keras_amp._compat.PINS`: every private (or overridden) Keras/TF object keras_amp
depends on, one row per object, with the digest of its source in the pinned versions and every
keras_amp feature that stands on it. At import, keras_amp turns a feature off (with a warning)
where a row does not hold; here the same rows fail loudly. When one fails: re-read the named
object, port the change into the modules of that feature, then update the digest.

Where keras_amp may replace the object at run time (the op rules while `keras_amp.enable()` is on,
the multi-worker fit fix once installed), `_compat.ORIGINALS` holds the object as Keras defines it.
Behaviour a digest cannot pin (variable layouts, compile's auto-wrapping) is guarded by the tests
below and, for the recipes and the model graph, in tests/test_keras_guards_recipes.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp import _compat, op_rules
from keras_amp.distribute import trainer_fix

KERAS_VERSION = "3.15"
TF_VERSION = "2.21"
PINS = _compat.PINS
FEATURES = {value for name, value in vars(_compat).items() if name.isupper() and isinstance(value, str)
            and name not in ("TESTED_KERAS", "TESTED_TENSORFLOW", "OP_DEF")}


def test_versions_are_the_ones_the_table_was_written_against():
    assert keras.__version__.startswith(KERAS_VERSION), keras.__version__
    assert tf.__version__.startswith(TF_VERSION), tf.__version__
    assert keras.__version__.startswith(_compat.TESTED_KERAS) and tf.__version__.startswith(_compat.TESTED_TENSORFLOW)


def test_table_is_well_formed():
    names = [p.name for p in PINS]
    assert len(names) == len(set(names)), "duplicate rows"
    objects = [id(getattr(_compat.ORIGINALS[p.name], "__func__", _compat.ORIGINALS[p.name])) for p in PINS]
    assert len(objects) == len(set(objects)), "one row per object: list every feature in it"
    for pin in PINS:
        assert pin.digest is None or (len(pin.digest) == 16 and set(pin.digest) <= set("0123456789abcdef")), pin
        assert isinstance(pin.features, tuple) and pin.features and set(pin.features) <= FEATURES, pin
        assert len(pin.features) == len(set(pin.features)), pin


def test_every_feature_is_on_here():
    # The verdict at import: on the tested versions every row holds.
    assert _compat.off_features() == {}
    assert set(_compat.VERDICT) == FEATURES  # every feature stands on some row


@pytest.mark.parametrize("pin", PINS, ids=[p.name for p in PINS])
def test_guarded_source_unchanged(pin, stock_keras):
    # The name is where the object is defined: a row cannot silently guard something else.
    found = _compat.ORIGINALS.get(pin.name)
    assert found is not None, f"{pin.name} is missing"
    assert _compat.lookup(pin.name) is found, f"{pin.name} is not what Keras defines there now"
    if pin.digest is not None:
        digest = _compat.digest(found)
        assert digest == pin.digest, (
            f"{pin.name} changed (digest {digest}, pinned {pin.digest}): re-read it, port the change "
            f"into the code of {', '.join(pin.features)}, then update the row."
        )


def test_every_op_rule_target_and_fit_fix_function_is_pinned():
    for rule in op_rules.RULES:
        for name in rule.targets + tuple(n for t in rule.targets for n in op_rules.table.RELIED_ON.get(t, ())):
            assert name in _compat.PIN_BY_NAME, (rule.op, name)
            assert {_compat.OP_RULES, _compat.OP_ATTENTION, _compat.OP_LEAN, _compat.OP_MATMUL, _compat.OP_DROPOUT,
                    _compat.OP_CONV} & set(_compat.PIN_BY_NAME[name].features), name
    for name in trainer_fix.PINNED:
        assert _compat.FIT_FIX in _compat.PIN_BY_NAME[name].features, name


def test_tf_internal_route_to_no_merge_call_is_the_guarded_function():
    # The optimizer calls it through tf.__internal__; the row pins the function behind that route.
    assert tf.__internal__.distribute.strategy_supports_no_merge_call is _compat.original(
        "tensorflow.python.distribute.merge_call_interim.strategy_supports_no_merge_call")


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

"""keras_amp.recipe_roles: the role a recipe gives one layer, the reason a kept deny-list layer
gives, and the dtype vocabulary the recipes plan with. Whole plans are tests/test_recipes.py's."""

import keras
import numpy as np
import pytest

import keras_amp
from keras_amp import op_rules, recipe_roles, recipes
from tests.helpers import Scaler

# This CPU has no fast float16; enable() says so. The numerics, not the speed, are under test here.
pytestmark = pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning")
KEPT = "kept in {policy}, the policy of 'outer', whose own code may not take a float32 output"


class Heads(keras.Model):
    """Deny-list layers called from a subclassed model's own code."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, name="dense")
        self.exp = keras.layers.Dense(8, activation="exponential", name="exp")
        self.probs = keras.layers.Softmax(name="probs")

    def call(self, x):
        h = self.dense(x)
        return self.probs(h + self.exp(h))


def test_a_kept_deny_list_layer_says_only_what_its_ops_compute():
    keras_amp.enable("mixed_float16")
    model = Heads(name="heads")
    model(np.ones((2, 8), "float32"))
    reasons = {e.path: e.reason for e in recipes.plan_recipe(model, "transformer").layers}
    kept = "kept in mixed_float16, the policy of 'heads', whose own code may not take a float32 output"
    assert reasons["probs"] == f"deny list: softmax; {kept}; its softmax runs in float32 (op table: softmax)"
    # No op rule computes exp in float32: the reason says so, and claims no float32.
    assert reasons["exp"] == (
        f"deny list: exp; {kept}; its exp/log-type activation runs in float16 (op table: exp runs in compute dtype)"
    )
    op_rules.uninstall()
    assert {e.path: e.reason for e in recipes.plan_recipe(model, "transformer").layers}["probs"].endswith(
        "its softmax runs in float16 (op table: softmax runs in compute dtype: its keras_amp rule is not installed)"
    )


class _Exp(keras.layers.Layer):
    """exp in the layer's own code, through no activation: no op-table row names it."""

    def call(self, x):
        return keras.ops.exp(x)


def _traced_scaler():
    scaler = Scaler(name="scaler")
    inp = keras.Input((8,))
    keras.Model(inp, scaler(inp))  # a graph call: its ops can be traced
    return scaler


@pytest.mark.parametrize(
    "kind, make, ending",
    [
        pytest.param("normalization", lambda: keras.layers.GroupNormalization(groups=1),
                     "its statistics run in float32 (Keras computes them in float32)", id="keras-norm"),
        pytest.param("normalization", keras.layers.UnitNormalization,
                     "its statistics run in float32 (op table: normalize)", id="unit-norm"),
        pytest.param("normalization", _traced_scaler,
                     "its statistics run in bfloat16 (its traced ops)", id="traced-rms"),
        pytest.param("loss", lambda: keras.layers.Dense(2, activity_regularizer="l2"),
                     "its activity-regularizer penalty runs in bfloat16 (op table: sum runs in compute dtype)",
                     id="activity-regularizer"),
        pytest.param("exp", _Exp,
                     "no op rule covers it: its exp/log-type activation runs in bfloat16 unless its own code upcasts",
                     id="no-rule"),
    ],
)
def test_kept_deny_reason_follows_the_ops_under_a_16bit_policy(kind, make, ending):
    keras_amp.enable("mixed_bfloat16")
    reason = recipe_roles.kept_deny_reason(kind, make(), keras.layers.Dense(2, name="outer"), "mixed_bfloat16")
    assert reason == f"deny list: {kind}; {KEPT.format(policy='mixed_bfloat16')}; {ending}"


@pytest.mark.parametrize("kind, what", [("softmax", "its softmax runs"), ("normalization", "its statistics run"),
                                        ("exp", "its exp/log-type activation runs")])
def test_kept_deny_reason_under_a_float32_parent_is_float32_whatever_the_ops(kind, what):
    keras_amp.enable("mixed_bfloat16")
    reason = recipe_roles.kept_deny_reason(kind, _Exp(), keras.layers.Dense(2, name="outer"), "float32")
    assert reason == f"deny list: {kind}; {KEPT.format(policy='float32')}; {what} in float32"


def test_deny_reason_names_the_kind():
    assert recipe_roles.deny_reason("softmax") == "deny list: softmax"
    assert recipe_roles.NORM_DENIED == "deny list: normalization"


@pytest.mark.parametrize("first, last, expected", [(True, False, "cnn: first layer"), (False, True, "cnn: last layer"),
                                                   (True, True, "cnn: first layer"), (False, False, None)],
                         ids=["first", "last", "only", "middle"])
def test_cnn_role_is_the_first_and_last_layer(first, last, expected):
    assert recipe_roles.role("cnn", keras.layers.Dense(2), None, first, last) == expected


def test_rnn_roles_are_the_recurrences_and_their_cells():
    lstm = keras.layers.LSTM(4)
    generic = keras.layers.RNN(keras.layers.GRUCell(4))
    assert recipe_roles.role("rnn", lstm, None, False, False) == recipe_roles.RNN_ROLE
    assert recipe_roles.role("rnn", generic, None, True, True) == recipe_roles.RNN_ROLE  # not a cnn position rule
    assert recipe_roles.role("rnn", lstm.cell, lstm, False, False) == recipe_roles.RNN_CELL_ROLE
    assert recipe_roles.role("rnn", keras.layers.GRUCell(4), lstm, False, False) is None  # not its cell
    assert recipe_roles.role("rnn", keras.layers.Bidirectional(keras.layers.GRU(4)), None, False, False) == (
        recipe_roles.RNN_ROLE)
    assert recipe_roles.role("rnn", keras.layers.Dense(2), None, True, True) is None
    assert recipe_roles.role("transformer", lstm, None, True, True) is None


def test_a_bidirectional_over_float32_islands_has_no_rnn_role():
    both_islands = keras.layers.Bidirectional(keras_amp.layers.LSTM(4))
    assert recipe_roles.role("rnn", both_islands, None, False, False) is None


@pytest.mark.parametrize("compute", ["mixed_float16", "mixed_bfloat16"])
def test_role_policy_rnn_keeps_16bit_matmuls_cnn_is_float32(compute):
    assert recipe_roles.role_policy(recipe_roles.RNN_ROLE, compute) == f"matmul16_from_{compute}"
    assert recipe_roles.role_policy(recipe_roles.RNN_CELL_ROLE, compute) == f"matmul16_from_{compute}"
    assert recipe_roles.role_policy("cnn: last layer", compute) == "float32"


class _BrokenConfig(keras.layers.RNN):
    def get_config(self):
        raise NotImplementedError


def test_saves_its_cell_generic_rnn_yes_lstm_no_unknown_assumed_yes():
    assert recipe_roles.saves_its_cell(keras.layers.RNN(keras.layers.LSTMCell(4))) is True
    assert recipe_roles.saves_its_cell(keras.layers.LSTM(4)) is False  # rebuilds its cell from its dtype
    assert recipe_roles.saves_its_cell(_BrokenConfig(keras.layers.LSTMCell(4))) is True


@pytest.mark.parametrize("dtype, expected", [("float16", True), ("bfloat16", True), ("float32", False),
                                             ("float64", False), ("int8", False)])
def test_is_16bit_dtype(dtype, expected):
    assert recipe_roles.is_16bit_dtype(dtype) is expected

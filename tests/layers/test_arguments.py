"""Layer arguments checked at construction, not at build: what the rows cannot show.

The bad-argument rows (a TypeError/ValueError naming the argument at construction) are in
tests/test_bad_input.py. Here: stock Keras accepts some of them at construction (the guard),
canonical values reach the stock constructor, and `initial_state` is counted at call.
"""

import math

import keras
import numpy as np
import pytest

from keras_amp import layers as amp_layers

@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (keras.layers.LayerNormalization, {"epsilon": -1.0}),
        (keras.layers.BatchNormalization, {"momentum": 2.0}),
        (keras.layers.LSTM, {"units": 3, "dropout": 2.0}),
        (keras.layers.Softmax, {"axis": 1.5}),
    ],
    ids=["LayerNormalization-epsilon", "BatchNormalization-momentum", "LSTM-dropout", "Softmax-axis"],
)
def test_stock_accepts_these_at_construction(cls, kwargs):
    # Guard: these rows are checked earlier than stock Keras checks them (if it does).
    cls(**kwargs)


def test_canonical_values_reach_the_stock_constructor():
    # Integral numpy values are accepted and stored as Python numbers.
    layer = amp_layers.RMSNormalization(axis=np.int64(-1), epsilon=np.float32(1e-5))
    assert type(layer.axis) is int and layer.axis == -1
    lstm = amp_layers.LSTM(np.int64(3), dropout=np.float64(0.25))
    assert type(lstm.units) is int and lstm.cell.dropout == 0.25
    assert lstm.use_cudnn is False  # "auto" -> the generic loop, where the float32 cell runs


@pytest.mark.parametrize("cls, states", [(amp_layers.LSTM, 3), (amp_layers.LSTM, 1), (amp_layers.GRU, 2)], ids=["LSTM-3", "LSTM-1", "GRU-2"])
def test_initial_state_count(cls, states):
    x = np.ones((2, 3, 4), "float32")
    h = np.zeros((2, 5), "float32")
    with pytest.raises(ValueError, match="initial_state"):
        cls(5)(x, initial_state=[h] * states)

"""Bad layer arguments: a TypeError/ValueError naming the argument at construction, not at build.

Each row is (callable, kwargs, exception class, argument name). Stock Keras accepts most of
these at construction and fails later (at build, at call, or with NaN outputs) or never; a
guard row shows that for a few.
"""

import math

import keras
import numpy as np
import pytest

from keras_amp import layers as amp_layers

MHA = dict(num_heads=2, key_dim=4)

BAD_ARGUMENTS = [
    (amp_layers.LayerNormalization, {"epsilon": -1.0}, ValueError, "epsilon"),
    (amp_layers.LayerNormalization, {"epsilon": math.nan}, ValueError, "epsilon"),
    (amp_layers.LayerNormalization, {"epsilon": "x"}, TypeError, "epsilon"),
    (amp_layers.LayerNormalization, {"axis": [1.5]}, TypeError, "axis"),
    (amp_layers.LayerNormalization, {"center": "no"}, TypeError, "center"),
    (amp_layers.LayerNormalization, {"rms_scaling": "yes"}, TypeError, "rms_scaling"),
    (amp_layers.BatchNormalization, {"axis": "x"}, TypeError, "axis"),
    (amp_layers.BatchNormalization, {"axis": 1.5}, TypeError, "axis"),
    (amp_layers.BatchNormalization, {"momentum": 2.0}, ValueError, "momentum"),
    (amp_layers.BatchNormalization, {"epsilon": -1.0}, ValueError, "epsilon"),
    (amp_layers.BatchNormalization, {"scale": None}, TypeError, "scale"),
    (amp_layers.BatchNormalization, {"synchronized": "no"}, TypeError, "synchronized"),
    (amp_layers.GroupNormalization, {"axis": "x"}, TypeError, "axis"),
    (amp_layers.GroupNormalization, {"epsilon": -1.0}, ValueError, "epsilon"),
    (amp_layers.RMSNormalization, {"axis": "x"}, TypeError, "axis"),
    (amp_layers.RMSNormalization, {"axis": [0.5]}, TypeError, "axis"),
    (amp_layers.RMSNormalization, {"epsilon": -1.0}, ValueError, "epsilon"),
    (amp_layers.Softmax, {"axis": "x"}, TypeError, "axis"),
    (amp_layers.Softmax, {"axis": 1.5}, TypeError, "axis"),
    (amp_layers.Softmax, {"output_dtype": "bogus"}, ValueError, "output_dtype"),
    (amp_layers.Softmax, {"output_dtype": 3}, TypeError, "output_dtype"),
    (amp_layers.MultiHeadAttention, {**MHA, "dropout": 2.0}, ValueError, "dropout"),
    (amp_layers.MultiHeadAttention, {**MHA, "dropout": "x"}, TypeError, "dropout"),
    (amp_layers.MultiHeadAttention, {**MHA, "use_bias": "no"}, TypeError, "use_bias"),
    (amp_layers.MultiHeadAttention, {**MHA, "attention_axes": [1.5]}, TypeError, "attention_axes"),
    (amp_layers.MultiHeadAttention, {**MHA, "flash_attention": True}, ValueError, "flash_attention"),
    (amp_layers.LSTM, {"units": "3"}, TypeError, "units"),
    (amp_layers.LSTM, {"units": 3.0}, TypeError, "units"),
    (amp_layers.LSTM, {"units": 0}, ValueError, "units"),
    (amp_layers.LSTM, {"units": 3, "dropout": 2.0}, ValueError, "dropout"),
    (amp_layers.LSTM, {"units": 3, "recurrent_dropout": -1.0}, ValueError, "recurrent_dropout"),
    (amp_layers.LSTM, {"units": 3, "return_sequences": "no"}, TypeError, "return_sequences"),
    (amp_layers.LSTM, {"units": 3, "unit_forget_bias": 1}, TypeError, "unit_forget_bias"),
    (amp_layers.LSTM, {"units": 3, "use_cudnn": True}, ValueError, "use_cudnn"),
    (amp_layers.LSTM, {"units": 3, "use_cudnn": "x"}, ValueError, "use_cudnn"),
    (amp_layers.GRU, {"units": "3"}, TypeError, "units"),
    (amp_layers.GRU, {"units": 3, "dropout": 2.0}, ValueError, "dropout"),
    (amp_layers.GRU, {"units": 3, "reset_after": "no"}, TypeError, "reset_after"),
    (amp_layers.GRU, {"units": 3, "stateful": None}, TypeError, "stateful"),
    (amp_layers.LSTMCell, {"units": "3"}, TypeError, "units"),
    (amp_layers.LSTMCell, {"units": 3, "dropout": 2.0}, ValueError, "dropout"),
    (amp_layers.GRUCell, {"units": 3, "recurrent_dropout": 1.5}, ValueError, "recurrent_dropout"),
    (amp_layers.Float32, {"layer": "dense"}, TypeError, "layer"),
    (amp_layers.Float32, {"layer": keras.layers.Dense(2), "output_dtype": "bogus"}, ValueError, "output_dtype"),
    (amp_layers.Float32, {"layer": keras.layers.Dense(2), "output_dtype": "int8"}, ValueError, "output_dtype"),
    (amp_layers.OutputHead, {"units": 3, "dtype": "mixed_float16"}, ValueError, "dtype"),
]


def _id(row):
    cls, kwargs, _, name = row
    return f"{cls.__name__}-{name}={kwargs[name]!r}"


@pytest.mark.parametrize("row", BAD_ARGUMENTS, ids=[_id(r) for r in BAD_ARGUMENTS])
def test_bad_argument_raises_at_construction(row):
    cls, kwargs, error, name = row
    with pytest.raises(error, match=f"`?{name}`?"):
        cls(**kwargs)


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

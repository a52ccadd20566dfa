"""What a recipe does to one layer: its role, and the normalisation layers between 16-bit layers.

`keras_amp.recipes` plans every layer (parent defaults, roles, the deny list, user rules); this
module holds the two recipe-specific decisions it calls: the role a recipe gives a layer ("cnn":
the first and last layers float32; "rnn": recurrences and their cells float32 with 16-bit matmuls)
and, after the plan, stock BatchNormalization / LayerNormalization between 16-bit layers, which keep
the compute dtype (float32 inside either way).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from keras_amp import model_graph
from keras_amp.op_rules.matmul import matmul16_name, policy_from_name
from keras_amp.op_rules.table import LOW_PRECISION

FLOAT32 = "float32"

RNN_ROLE = "rnn: recurrence (gates, nonlinearities and carried state float32, matmuls 16-bit)"
RNN_CELL_ROLE = "rnn: cell (gates, nonlinearities and carried state float32, matmuls 16-bit)"
RNN_CELL_INSIDE = "rnn: cell, float32; its matmuls 16-bit under its RNN's policy"


def role(recipe: str, layer: Any, parent: Any, first: bool, last: bool) -> str | None:
    """The recipe's role for `layer`, or None."""
    if recipe == "cnn" and first:
        return "cnn: first layer"
    if recipe == "cnn" and last:
        return "cnn: last layer"
    if recipe == "rnn":
        if isinstance(layer, keras.layers.Bidirectional):
            inner = (layer.forward_layer, layer.backward_layer)
            if not all(model_graph.is_island(i) for i in inner):
                return RNN_ROLE
        elif isinstance(layer, keras.layers.RNN):
            return RNN_ROLE
        elif isinstance(parent, keras.layers.RNN) and layer is parent.cell:
            return RNN_CELL_ROLE
    return None


def role_policy(role: str, compute: str) -> str:
    # cnn roles: float32; rnn roles: float32 with the compute dtype's 16-bit matmuls.
    return matmul16_name(compute) if role.startswith("rnn:") else FLOAT32


def saves_its_cell(rnn: Any) -> bool:
    """Whether `rnn`'s config holds its cell's config (generic RNN) rather than rebuilding it."""
    try:
        return "cell" in rnn.get_config()
    except Exception:  # a third-party RNN whose get_config fails: assume the cell is saved
        return True


def is_16bit(dtype: str) -> bool:
    return dtype in LOW_PRECISION


# Stock normalisation layers that compute in float32 inside (Keras 3.15.1: BatchNormalization
# casts its input up; LayerNormalization computes in at least float32 and rounds its result to its
# input's dtype). Guarded in tests/test_keras_guards_recipes.py.
_FLOAT32_INSIDE = (keras.layers.BatchNormalization, keras.layers.LayerNormalization)


def deny_reason(kind: str) -> str:
    """The plan's reason for a layer the deny list made float32 (`model_graph.op_kind` `kind`)."""
    return f"deny list: {kind}"


NORM_DENIED = deny_reason("normalization")
NORM_BETWEEN_16BIT = "deny list: normalization, float32 inside; between 16-bit layers: compute dtype"


def normalization_between_16bit_layers(model, out, planned, compute) -> None:
    """Stock BatchNormalization / LayerNormalization the deny list made float32 keep the compute
    policy where every layer around them is 16-bit.

    There the float32 policy computes the same numbers: their statistics and normalisation are
    float32 either way, a 16-bit input is cast up exactly, and the float32 output is rounded by the
    next layer (LayerNormalization rounds it to its input's dtype itself). It would only cost a
    float32 output and float32 gradients through the layer. Next to a model input or output, or
    to a float32 layer or island, they stay float32: a float32 input is then not rounded first.
    """
    candidates = [i for i, (layer, e) in enumerate(out) if type(layer) in _FLOAT32_INSIDE and e.reason == NORM_DENIED]
    if not candidates or not is_16bit(policy_from_name(compute).compute_dtype):
        return

    def dtype_of(layer):
        if model_graph.is_island(layer):
            return FLOAT32
        policy = planned.get(id(layer), (layer.dtype_policy.name,))[0]
        return policy_from_name(policy).compute_dtype

    feeding = model_graph.neighbour_dtypes(model, dtype_of, upstream=True)
    fed = model_graph.neighbour_dtypes(model, dtype_of, upstream=False)
    for i in candidates:
        layer, entry = out[i]
        around = (feeding.get(id(layer)), fed.get(id(layer)))
        if all(dtypes and all(is_16bit(d) for d in dtypes) for dtypes in around):
            planned[id(layer)] = (compute, NORM_BETWEEN_16BIT)
            out[i] = (layer, dataclasses.replace(entry, policy=compute, reason=NORM_BETWEEN_16BIT))

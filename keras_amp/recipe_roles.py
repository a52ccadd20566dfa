"""What a recipe does to one layer: its role, a kept deny-list layer's reason, norms between 16-bit layers.

`keras_amp.recipes` plans every layer (parent defaults, roles, the deny list, user rules); this
module holds the recipe-specific decisions it calls: the role a recipe gives a layer ("cnn":
the first and last layers float32; "rnn": recurrences and their cells float32 with 16-bit matmuls),
the reason a deny-list layer kept in its parent's policy gives (what the op table says its ops then
compute in, nothing more) and, after the plan, stock BatchNormalization / LayerNormalization
between 16-bit layers, which keep the compute dtype (float32 inside either way).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from keras_amp import layer_kinds, model_graph, op_rules
from keras_amp.matmul16_policy import matmul16_name, policy_from_name
from keras_amp.dtypes import LOW_PRECISION

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


def is_16bit_dtype(dtype: str) -> bool:
    return dtype in LOW_PRECISION


# Stock normalisation layers that compute in float32 inside (Keras 3.15.1: BatchNormalization
# casts its input up; LayerNormalization computes in at least float32 and rounds its result to its
# input's dtype). Guarded in tests/test_keras_guards_recipes.py.
_FLOAT32_INSIDE = (keras.layers.BatchNormalization, keras.layers.LayerNormalization)


def deny_reason(kind: str) -> str:
    """The plan's reason for a layer the deny list made float32 (`layer_kinds.op_kind` `kind`)."""
    return f"deny list: {kind}"


# Stock normalisation layers whose statistics Keras 3.15.1 computes in float32 under any policy
# (BatchNormalization and GroupNormalization cast up for their moments, LayerNormalization and
# RMSNormalization compute in at least float32); guarded in tests/test_keras_guards_recipes.py.
_FLOAT32_STATISTICS = (
    keras.layers.BatchNormalization,
    keras.layers.GroupNormalization,
    keras.layers.LayerNormalization,
    keras.layers.RMSNormalization,
)
# The op-table row (`op_rules.RULES`, `Rule.op`) through which the other deny-list layers Keras
# defines compute their sensitive op (Keras 3.15.1 sources): by type, or by activation identity.
_LAYER_OPS = ((keras.layers.Softmax, "softmax"), (keras.layers.UnitNormalization, "normalize"))
_ACTIVATION_OPS = (
    (keras.activations.softmax, "softmax"),
    (keras.activations.log_softmax, "log_softmax"),
    (keras.activations.exponential, "exp"),
    (keras.activations.softplus, "softplus"),
    (keras.activations.log_sigmoid, "log_sigmoid"),
)
_WHAT = {"softmax": "its softmax runs", "exp": "its exp/log-type activation runs",
         "normalization": "its statistics run", "loss": "its activity-regularizer penalty runs"}


def _table_op(layer: Any, kind: str) -> str | None:
    """The op-table op through which `layer` computes its deny-list `kind`, or None if unknown."""
    if kind == "loss":
        return "sum"  # Keras's regularizers reduce with ops.sum
    activation = getattr(layer, "activation", None)
    found = [op for f, op in _ACTIVATION_OPS if activation is f]
    found += [op for t, op in _LAYER_OPS if isinstance(layer, t)]
    return found[0] if found else None


def _runs_in(op: str) -> str | None:
    """What the op table says `op` runs in under the 16-bit policy in force, or None without a row."""
    for rule in op_rules.RULES:
        if op not in (name.strip() for name in rule.op.split(";")[0].split(",")):
            continue
        if rule.by == "keras_amp" and not op_rules.rule_installed(rule.op):
            return "compute dtype: its keras_amp rule is not installed"
        return rule.runs_in
    return None


def kept_deny_reason(kind: str, layer: Any, parent: Any, policy: str) -> str:
    """The reason for a deny-list layer kept in its parent's `policy`: says only what then computes in what.

    Its parent's own code may not take a float32 output, so the policy stays; whether the hazard
    is then computed in float32 follows from the layer's traced ops
    (`layer_kinds.normalization_dtype`) or from the op table's row for the op it computes.
    """
    dtype = policy_from_name(policy).compute_dtype
    head = (f"deny list: {kind}; kept in {policy}, the policy of {parent.name!r}, whose own code may not "
            "take a float32 output")
    what = _WHAT.get(kind, "it runs")
    if not is_16bit_dtype(dtype):
        return f"{head}; {what} in {dtype}"
    traced = layer_kinds.normalization_dtype(layer) if kind == "normalization" else None
    if traced is not None:
        return f"{head}; {what} in {traced} (its traced ops)"
    if kind == "normalization" and isinstance(layer, _FLOAT32_STATISTICS):
        return f"{head}; {what} in float32 (Keras computes them in float32)"
    op = _table_op(layer, kind)
    runs_in = _runs_in(op) if op else None
    if runs_in == FLOAT32:
        return f"{head}; {what} in float32 (op table: {op})"
    if runs_in is not None:
        return f"{head}; {what} in {dtype} (op table: {op} runs in {runs_in})"
    return f"{head}; no op rule covers it: {what} in {dtype} unless its own code upcasts"


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
    if not candidates or not is_16bit_dtype(policy_from_name(compute).compute_dtype):
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
        if all(dtypes and all(is_16bit_dtype(d) for d in dtypes) for dtypes in around):
            planned[id(layer)] = (compute, NORM_BETWEEN_16BIT)
            out[i] = (layer, dataclasses.replace(entry, policy=compute, reason=NORM_BETWEEN_16BIT))

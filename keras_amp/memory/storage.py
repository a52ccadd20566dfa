"""A Keras variable's storage dtype, changed in place, and the bytes a model's state takes.

A Keras 3 variable on TensorFlow holds its value in a `tf.Variable` (`_value`) of its dtype
(`_dtype`). `set_storage` replaces that `tf.Variable` with one of another dtype, under the same
name, trainability, aggregation, synchronisation and distribution strategy. The Keras variable
object stays the same one, so layers, optimizers and checkpoints that track it keep working; but
a traced function that captured the old `tf.Variable` reads the old one, so callers retrace
(`keras_amp.memory.prepare` does).
"""

from __future__ import annotations

import contextlib
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_amp import _compat, validation
from keras_amp.dtypes import LOW_PRECISION
from keras_amp.numerics import bits


STORAGE_DTYPES = ("float32", "bfloat16", "float16")


def _check_variable(variable):
    return validation.check_type("variable", variable, keras.Variable, "a keras.Variable")


def storage_dtype(variable) -> str:
    """The dtype a Keras variable stores (not the dtype an autocast scope reads it in)."""
    _check_variable(variable)
    return keras.backend.standardize_dtype(variable._dtype)


def _strategy_scope(tf_variable):
    strategy = getattr(tf_variable, "_distribute_strategy", None)
    if strategy is None or not isinstance(tf_variable, tf.distribute.DistributedValues):
        return contextlib.nullcontext()
    return strategy.scope()


def set_storage(variable, dtype: str, value=None):
    """Stores Keras `variable` as `dtype` from now on, holding `value` (default: its value, cast).
    Returns the `tf.Variable` it stored before (`put_back` takes it).

    Call outside any traced function. Raises `keras_amp._compat.FeatureOff` on an untested Keras.
    """
    _check_variable(variable)
    validation.check_choice("dtype", dtype, STORAGE_DTYPES)
    _compat.require(_compat.MEMORY)
    old = variable._value
    if old is None:
        raise ValueError(f"Variable {variable.path} is not initialized yet; build the layer first.")
    if tf.inside_function():
        raise RuntimeError("keras_amp.memory.set_storage must be called outside a tf.function.")
    new_value = tf.cast(old.read_value() if value is None else value, dtype)
    if new_value.shape != old.shape:
        raise ValueError(f"`value` must have the variable's shape {tuple(old.shape)}. "
                         f"Received: value with shape {tuple(new_value.shape)}")
    with _strategy_scope(old), tf.init_scope():
        replacement = tf.Variable(
            new_value, dtype=dtype, trainable=old.trainable, name=variable.name,
            aggregation=old.aggregation, synchronization=old.synchronization)
    variable._value = replacement
    variable._dtype = dtype
    return old


def put_back(variable, tf_variable) -> None:
    """Makes `tf_variable`, a storage `set_storage` replaced (it returns it), `variable`'s storage again:
    the same `tf.Variable`, so functions traced with it, and optimizer slots keyed by it, hold again."""
    _check_variable(variable)
    variable._value = tf_variable
    variable._dtype = keras.backend.standardize_dtype(tf_variable.dtype)


def variable_bytes(variables) -> int:
    """Exact bytes of `variables` (each counted once)."""
    if isinstance(variables, (str, bytes)) or not hasattr(variables, "__iter__"):
        raise TypeError(f"`variables` must be an iterable of variables. Received: variables={variables!r}")
    seen, total = set(), 0
    for v in variables:
        if not isinstance(v, (keras.Variable, tf.Variable)):
            raise TypeError(f"`variables` must hold keras.Variable or tf.Variable objects. Received: {v!r}")
        if id(v) in seen:
            continue
        seen.add(id(v))
        dtype = storage_dtype(v) if isinstance(v, keras.Variable) else v.dtype
        total += int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(dtype)
                                                  if dtype != "bfloat16" else np.uint16).itemsize
    return total


def state_bytes(model, optimizer=None) -> dict[str, int]:
    """Bytes of `model`'s weights (trainable, frozen, other) and `optimizer`'s variables, exact."""
    validation.check_type("model", model, keras.layers.Layer, "a keras.Model or keras.layers.Layer")
    validation.check_type("optimizer", optimizer, (keras.optimizers.Optimizer, type(None)),
                          "a keras.optimizers.Optimizer or None")
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    out = {
        "trainable": variable_bytes(model.trainable_variables),
        "non_trainable": variable_bytes(model.non_trainable_variables),
        "optimizer": variable_bytes(optimizer.variables) if optimizer is not None else 0,
    }
    out["total"] = sum(out.values())
    return out


def is_16bit_storage(variable) -> bool:
    return storage_dtype(variable) in LOW_PRECISION


def mark_lean(variable, kind: str, compensation, owner=None) -> None:
    """Records on `variable` that its float32 master is its 16-bit value joined with `compensation`
    (`LeanAdam`'s kinds: "split", "kahan"; a tensor or variable; None for "stochastic", "none"), and,
    weakly, the `owner` optimizer that keeps it (None before it is built).

    The record goes with the weight, not with the optimizer: a model recompiled with another
    optimizer hands the master on (`keras_amp.memory.prepare`) even after the first is gone.
    """
    variable._keras_amp_lean = (kind, compensation)
    variable._keras_amp_lean_owner = None if owner is None else weakref.ref(owner)


def lean_owner(variable):
    """The optimizer `mark_lean` recorded for `variable` while it is alive and still keeps it, else None."""
    ref = getattr(variable, "_keras_amp_lean_owner", None)
    owner = ref() if ref is not None else None
    return owner if owner is not None and owner.keeps_16bit(variable) else None


def lean_master(variable):
    """`variable`'s float32 master where `mark_lean` recorded one (as a float32 tensor), else None."""
    if not is_marked_lean(variable):
        return None
    entry = variable._keras_amp_lean
    value = tf.convert_to_tensor(variable._value)
    if value.dtype == tf.float32:  # inside `float32_weights`: the master itself
        return value
    kind, low = entry
    if kind == "split":
        return bits.join(value, tf.convert_to_tensor(low))
    if kind == "kahan":
        return bits.kahan_join(value, tf.convert_to_tensor(low))
    return tf.cast(value, tf.float32)


def is_marked_lean(variable) -> bool:
    """Whether `mark_lean` recorded a master for `variable` (no computation)."""
    return getattr(variable, "_keras_amp_lean", None) is not None


def unmark_lean(variable) -> None:
    variable._keras_amp_lean = None
    variable._keras_amp_lean_owner = None

"""A float32 view of a model whose weights are stored in 16 bits, for float32 checkpoints.

Inside `float32_weights(model)` every weight stored in 16 bits is float32: a lean weight holds
its float32 master (the 16-bit weight joined with the compensation `LeanAdam` keeps), a frozen
weight its 16-bit value. `model.save(...)` / `model.save_weights(...)` there write a checkpoint
a float32 model loads. On exit each weight gets its own 16-bit storage back, the same
`tf.Variable` with the same bits where nothing assigned it inside (else the value assigned, stored
as the optimizer stores it). So the steps traced before keep working, in a callback during `fit`
too, and `model` may be a part of the model being trained (its backbone); a step traced inside is
dropped on exit, as it read the float32 copies.
"""

from __future__ import annotations

import contextlib
import os

import keras
import tensorflow as tf

from keras_amp import validation
from keras_amp.memory import storage
from keras_amp.memory.frozen import _check_model, _lean_optimizer, owned_weights, traced_by
from keras_amp.numerics import bits

_STEPS = ("train_function", "test_function", "predict_function")


@contextlib.contextmanager
def float32_weights(model, optimizer=None):
    """Context manager: `model`'s 16-bit-stored weights are float32 inside it (see module doc).

    `optimizer`: the `LeanAdam` (or a LossScaleOptimizer around one) that trains `model`'s lean
    weights, or None: `model.optimizer`, else the LeanAdam that made each weight lean.
    """
    _check_model(model)
    validation.check_type("optimizer", optimizer, (keras.optimizers.Optimizer, type(None)),
                          "a keras.optimizers.Optimizer or None")
    lean = _lean_optimizer(optimizer if optimizer is not None else getattr(model, "optimizer", None))
    changed = []
    for _, v, _ in owned_weights(model):
        if storage.is_16bit_storage(v):
            # A lean weight's master, or a frozen weight's 16-bit value (None: its value, cast).
            changed.append((v, storage.set_storage(v, "float32", storage.lean_master(v))))
            v._keras_amp_float32_view = True  # `prepare` (a step traced inside) leaves it as it is
    models = {id(model): model}
    for v, _ in changed:
        models.update((id(m), m) for m in traced_by(v))
    steps = {(id(m), name): getattr(m, name, None) for m in models.values() for name in _STEPS}
    try:
        yield model
    finally:
        for v, original in changed:
            v._keras_amp_float32_view = False
            _put_back(v, original, lean)
        for m in models.values():
            for name in _STEPS:
                if getattr(m, name, None) is not steps[(id(m), name)]:
                    setattr(m, name, None)  # traced inside, on the float32 copies


def _put_back(variable, original, lean) -> None:
    inside = tf.convert_to_tensor(variable._value)
    storage.put_back(variable, original)
    if storage.is_marked_lean(variable):
        trainer = lean if lean is not None and lean.keeps_16bit(variable) else storage.lean_owner(variable)
        if trainer is not None and not bits.same_bits(inside, storage.lean_master(variable)):
            trainer.store_master(variable, inside)  # assigned inside: stored as training stores it
        # A weight made lean by an optimizer gone since: its 16-bit value and compensation as they were.
    elif not bits.same_bits(inside, tf.cast(original.read_value(), tf.float32)):
        variable.assign(tf.cast(inside, original.dtype))


def save_float32_weights(model, filepath: str, optimizer=None) -> None:
    """`model.save_weights(filepath)` with every weight in float32 (`float32_weights`)."""
    validation.check_type("filepath", filepath, (str, os.PathLike), "a path ending in .weights.h5")
    with float32_weights(model, optimizer):
        model.save_weights(filepath)

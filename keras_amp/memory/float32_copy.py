"""A float32 view of a model whose weights are stored in 16 bits, for float32 checkpoints.

Inside `float32_weights(model)` every weight stored in 16 bits is float32: a lean weight holds
its float32 master (the 16-bit weight joined with the compensation `LeanAdam` keeps), a frozen
weight its 16-bit value. `model.save(...)` / `model.save_weights(...)` there write a checkpoint
a float32 model loads. On exit the 16-bit storage comes back exactly (as it was where a master is
unchanged, else the masters split again), and the model traces its functions again at its next call.
"""

from __future__ import annotations

import contextlib
import os

import keras

from keras_amp import validation
from keras_amp.memory import storage
from keras_amp.memory.frozen import _check_model, _lean_optimizer, forget_traced, owned_weights


@contextlib.contextmanager
def float32_weights(model, optimizer=None):
    """Context manager: `model`'s 16-bit-stored weights are float32 inside it (see module doc)."""
    _check_model(model)
    validation.check_type("optimizer", optimizer, (keras.optimizers.Optimizer, type(None)),
                          "a keras.optimizers.Optimizer or None")
    lean = _lean_optimizer(optimizer if optimizer is not None else getattr(model, "optimizer", None))
    masters = lean.master_weights() if lean is not None else {}
    changed = []
    for _, v, _ in owned_weights(model):
        dtype = storage.storage_dtype(v)
        if storage.is_16bit_storage(v):
            master = masters.get(id(v))
            index = lean.variable_index(v) if master is not None else None
            # A weight made lean under an optimizer the model no longer trains with: its recorded
            # master, and its 16-bit value back as it was (the compensation is left as it is).
            before = None if master is not None or not storage.is_marked_lean(v) else v._value.read_value()
            pair = lean.stored_pair(v, index) if index is not None else None  # as stored, for the exit
            storage.set_storage(v, "float32", master if before is None else storage.lean_master(v))
            changed.append((v, dtype, index, before, pair))
    try:
        yield model
    finally:
        for v, dtype, index, before, pair in changed:
            if index is not None:
                lean.restore_lean(v, index, pair)
            else:
                storage.set_storage(v, dtype, before)
        if changed:
            forget_traced(model)


def save_float32_weights(model, filepath: str, optimizer=None) -> None:
    """`model.save_weights(filepath)` with every weight in float32 (`float32_weights`)."""
    validation.check_type("filepath", filepath, (str, os.PathLike), "a path ending in .weights.h5")
    with float32_weights(model, optimizer):
        model.save_weights(filepath)

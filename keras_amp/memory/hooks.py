"""`fit`/`evaluate`/`predict` call `keras_amp.memory.prepare` before they build or trace.

Installed by `keras_amp.enable()` (`sync`, one of its followers), removed by `disable()`. The
replacements call `prepare(model)` and then the original Keras method; when `prepare` changed a
variable's storage, the function is traced again (the old trace holds the old variables).
`Trainer._symbolic_build` is where `fit` builds the optimizer under a distribution strategy, so
`prepare` runs before it too (when the model is built).
"""

from __future__ import annotations

import threading

from keras_amp import _compat
from keras_amp.memory.frozen import prepare

_TRAINER = "keras.src.backend.tensorflow.trainer.TensorFlowTrainer"
MAKE = tuple(f"{_TRAINER}.make_{kind}_function" for kind in ("train", "test", "predict"))
BUILD = "keras.src.trainers.trainer.Trainer._symbolic_build"
_lock = threading.Lock()
_installed = False


def _all_built(model) -> bool:
    return model.built and all(layer.built for layer in model._flatten_layers())


def _with_prepare(original):
    def make_function(self, force=False):
        if _all_built(self) and prepare(self).changed:
            force = True
        return original(self, force=force)

    make_function.__name__ = original.__name__
    make_function.__doc__ = original.__doc__
    make_function._keras_amp_original = original
    return make_function


def _symbolic_build(self, iterator=None, data_batch=None):
    if _all_built(self):
        prepare(self)
    return _compat.original(BUILD)(self, iterator=iterator, data_batch=data_batch)


def _targets():
    trainer = _compat.lookup(_TRAINER)
    base = _compat.lookup(BUILD.rsplit(".", 1)[0])
    return trainer, base


def install() -> bool:
    """Installs the hooks (idempotent); False when the MEMORY feature is off here."""
    global _installed
    with _lock:
        if _installed:
            return True
        if not _compat.warn_off(_compat.MEMORY):
            return False
        trainer, base = _targets()
        for name in MAKE:
            setattr(trainer, name.rsplit(".", 1)[1], _with_prepare(_compat.original(name)))
        base._symbolic_build = _symbolic_build
        _installed = True
    return True


def uninstall() -> None:
    global _installed
    with _lock:
        if not _installed:
            return
        trainer, base = _targets()
        for name in MAKE:
            setattr(trainer, name.rsplit(".", 1)[1], _compat.original(name))
        base._symbolic_build = _compat.original(BUILD)
        _installed = False


def installed() -> bool:
    return _installed


def sync(config) -> None:
    """`keras_amp.enable()`'s follower: hooks in while enabled, out when disabled."""
    if config is None:
        uninstall()
    else:
        install()

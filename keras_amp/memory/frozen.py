"""Where a model's weights are stored: frozen weights in the dtype they are read in, lean weights.

Under mixed precision a layer reads every float32 weight through a cast to its compute dtype. A
frozen weight (a weight created trainable whose `trainable` was turned off: `layer.trainable =
False`, `backbone.enable_lora(rank)`) is never updated, so its float32 value buys nothing: each
step casts the same float32 value to the same 16-bit value. `prepare` stores it in that 16-bit
value instead (half the bytes), so the forward pass and the gradients are bit for bit those of the
float32-stored run. Kept in float32:

- weights of layers that compute in float32 (float32 islands, float32 models), and weights that
  a layer reads in float32 although it computes in 16 bits (found in a trace of the forward
  pass, `keras_amp.memory.reads`: keras-hub's untied reverse embeddings, for one);
- weights created non-trainable (BatchNormalization's moving statistics and other state a layer
  updates itself) and weights that opt out of autocasting (`autocast=False`, read as stored);
- everything when `keras_amp.enable(frozen_weights="float32")`, or keras_amp is not enabled.

A weight made trainable again goes back to float32 storage (from its 16-bit value; a warning
says so). `fit`, `evaluate` and `predict` call `prepare` (when keras_amp is enabled) before
they trace; a custom training loop calls it after building the model and before its first step.

What `save()` writes for a stored-16-bit frozen weight is its 16-bit value (what training used).
`restore_frozen_float32(model, weights_path)` puts the float32 values back, for example before
merging LoRA adapters into the kernels.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import warnings
import weakref

import keras

from keras_amp import _compat, model_graph, validation
from keras_amp import policy as amp_policy
from keras_amp.dtypes import LOW_PRECISION
from keras_amp.memory import reads, storage


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `prepare` changed: variable paths stored in 16 bits, back in float32 (made trainable again, or
    lean under an optimizer the model no longer trains with), made lean."""

    frozen_16bit: tuple[str, ...] = ()
    back_to_float32: tuple[str, ...] = ()
    lean: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.frozen_16bit or self.back_to_float32 or self.lean)


def owned_weights(model):
    """(owning layer, variable, created trainable) for every variable of `model`, each once."""
    layers = [model] + [layer for _, layer in model_graph.walk(model) if model_graph.is_layer(layer)]
    seen = set()
    for layer in layers:
        for created_trainable, variables in ((True, layer._trainable_variables),
                                             (False, layer._non_trainable_variables)):
            for v in variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    yield layer, v, created_trainable


def read_dtype(layer, variable) -> str:
    """The dtype `layer` reads `variable` in: its compute dtype for an autocast float variable."""
    stored = storage.storage_dtype(variable)
    if variable._autocast and "float" in stored:
        return keras.backend.standardize_dtype(layer.compute_dtype)
    return stored


def _frozen_mode() -> str:
    config = amp_policy.config()
    if config is None or not getattr(config, "enabled", True):
        return "float32"
    return config.frozen_weights


def _lean_optimizer(optimizer):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return inner if hasattr(inner, "adopt_lean") else None


def prepare(model, optimizer=None, *, frozen_weights: str | None = None) -> Prepared:
    """Stores `model`'s frozen weights (and, for a `LeanAdam`, its trainable weights) in 16 bits.

    Args:
        model: A built `keras.Model` or layer.
        optimizer: The optimizer that will train it, or None (`model.optimizer` when compiled).
            A `keras_amp.optimizers.LeanAdam` (or a LossScaleOptimizer around one) adopts the
            trainable weights of 16-bit layers: they are stored in 16 bits from here on, with the
            compensation it keeps. It must not have been built yet.
        frozen_weights: "compute", "float32" or None (default: `keras_amp.config()`'s; "float32"
            when keras_amp is not enabled).

    Returns:
        `Prepared`, naming what changed. When anything did, the model's cached train/test/predict
        functions are dropped so that the next call traces with the new variables.
    """
    _check_model(model)
    if not model.built:  # its weights do not exist yet: nothing could be stored, and nothing would say so
        raise ValueError(f"`model` must be built before prepare: call it on a batch or model.build(input_shape) "
                         f"first. Received: model={model.name!r}, not built")
    mode = _frozen_mode() if frozen_weights is None else frozen_weights
    if mode not in amp_policy.FROZEN_WEIGHTS:
        raise ValueError(f"`frozen_weights` must be one of {amp_policy.FROZEN_WEIGHTS} or None. "
                         f"Received: frozen_weights={frozen_weights!r}")
    validation.check_type("optimizer", optimizer, (keras.optimizers.Optimizer, type(None)),
                          "a keras.optimizers.Optimizer or None")
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    lean = _lean_optimizer(optimizer)
    if not _compat.warn_off(_compat.MEMORY):
        if lean is not None:
            _compat.require(_compat.MEMORY)
        return Prepared()
    frozen, thawed, handed, targets, candidates, owned = [], [], [], [], [], []
    for layer, v, created_trainable in owned_weights(model):
        if not created_trainable or getattr(v, "_keras_amp_float32_view", False):
            continue  # inside `float32_weights`: its 16-bit storage comes back on exit
        owned.append(v)
        reads_in = read_dtype(layer, v)
        stored = storage.storage_dtype(v)
        was_frozen_by_us = getattr(v, "_keras_amp_frozen_16bit", False)
        if not v.trainable:
            if (mode == "compute" and stored == "float32" and reads_in in LOW_PRECISION
                    and not getattr(v, "_keras_amp_read_in_float32", False)):
                candidates.append((v, reads_in))
        elif was_frozen_by_us:
            storage.set_storage(v, "float32")
            v._keras_amp_frozen_16bit = False
            thawed.append(v.path)
            if lean is not None and not lean.built and reads_in in LOW_PRECISION:
                targets.append((v, reads_in))  # trained by a LeanAdam from here on: lean from the start
        elif storage.is_marked_lean(v) and not (lean is not None and lean.keeps_16bit(v)):
            # Made lean by another optimizer (the model was compiled again): its float32 master goes
            # to this one, or back into float32 storage for one that is not a LeanAdam.
            storage.set_storage(v, "float32", storage.lean_master(v))
            storage.unmark_lean(v)
            if lean is not None and reads_in in LOW_PRECISION:
                targets.append((v, reads_in))
            else:
                handed.append(v.path)
        elif (lean is not None and stored == "float32" and reads_in in LOW_PRECISION
              and not _trains_as_stored(lean, v)):
            targets.append((v, reads_in))
    if candidates:
        verdict = reads.reads_16bit(model, [v for v, _ in candidates], [d for _, d in candidates])
        for v, dtype in candidates:
            if verdict is None or verdict[id(v)]:
                storage.set_storage(v, dtype)
                v._keras_amp_frozen_16bit = True
                frozen.append(v.path)
            else:
                v._keras_amp_read_in_float32 = True  # found once; not traced again
    if thawed:
        warnings.warn(
            f"keras_amp: {len(thawed)} weights made trainable again go back to float32 storage from "
            f"their 16-bit values ({', '.join(thawed[:3])}{', ...' if len(thawed) > 3 else ''}); "
            "call keras_amp.memory.restore_frozen_float32(model, weights_path) first to train from "
            "the float32 values.", amp_policy.AmpWarning, stacklevel=3)
    lean_paths = lean.adopt_lean(targets) if lean is not None and targets else ()
    result = Prepared(tuple(frozen), tuple(thawed + handed), tuple(lean_paths))
    _note_traced_by(model, [v for v in owned if storage.is_16bit_storage(v)])
    if result.changed:
        forget_traced(model)
        gc.collect()  # the replaced float32 tf.Variables are freed now, not at the next collection
    return result


def _trains_as_stored(lean, variable) -> bool:
    """Whether built `lean` already trains `variable` as it is stored (float32: it was built before
    `prepare` saw the weight, as Keras's Adam); such a weight stays as it is rather than refused."""
    if not lean.built:
        return False
    try:
        lean.variable_index(variable)
    except KeyError:
        return False
    return True


def _note_traced_by(model, variables) -> None:
    """Records, weakly, on each of `variables` (stored in 16 bits) that `model` traces its steps with it:
    a later change of its storage through a sub-model (a backbone) drops `model`'s steps too."""
    for v in variables:
        models = getattr(v, "_keras_amp_traced_by", None)
        if models is None:
            models = v._keras_amp_traced_by = weakref.WeakSet()
        models.add(model)


def traced_by(variable) -> list:
    """The models `prepare` saw trace their steps with `variable` (alive ones)."""
    return list(getattr(variable, "_keras_amp_traced_by", ()))


def forget_traced(model, variables=()) -> None:
    """Drops the cached train/test/predict functions (they hold old variables) of `model` and of every
    model `prepare` saw trace with one of `variables` (a model around `model`, whose steps hold them too)."""
    models = {id(model): model}
    for v in variables:
        models.update((id(m), m) for m in traced_by(v))
    for m in models.values():
        for attr in ("train_function", "test_function", "predict_function"):
            if getattr(m, attr, None) is not None:
                setattr(m, attr, None)


def _check_model(model):
    return validation.check_type("model", model, keras.layers.Layer, "a keras.Model or keras.layers.Layer")


def is_frozen_16bit(variable) -> bool:
    """Whether `prepare` stores `variable` in 16 bits because it is frozen (no walk of a model)."""
    return bool(getattr(variable, "_keras_amp_frozen_16bit", False))


def frozen_16bit(model) -> list:
    """The variables `prepare` stores in 16 bits because they are frozen."""
    _check_model(model)
    return [v for _, v, _ in owned_weights(model) if getattr(v, "_keras_amp_frozen_16bit", False)]


def restore_frozen_float32(model, weights_path: str | None = None) -> list[str]:
    """Puts frozen weights stored in 16 bits back into float32 storage; returns their paths.

    Args:
        model: The model `prepare` changed, or a model around it.
        weights_path: Path of a `.weights.h5` (or `.keras`) file with float32 weights, or None. The
            file holds the weights of `model`, or of one model inside it (a keras-hub preset's
            `model.weights.h5` holds the backbone's, not the task's): the pretrained ones, e.g.
            saved before `enable_lora`. With a path the frozen weights of the model the file holds
            get their float32 values back from it, and every other weight (LoRA adapters, trained
            weights, statistics, frozen weights outside that model) keeps the value it has now.
            Without one they get their 16-bit values, in float32. A file that fits neither `model`
            nor exactly one model inside it raises Keras's `ValueError` and changes nothing.
    """
    _check_model(model)
    if weights_path is not None:
        validation.check_type("weights_path", weights_path, (str, os.PathLike), "a path or None")
        if not os.path.exists(weights_path):
            raise FileNotFoundError(f"`weights_path` does not exist. Received: weights_path={weights_path!r}")
    said = []
    try:
        with warnings.catch_warnings(record=True) as said:  # Keras's, about the parts that do not fit
            warnings.simplefilter("always")
            return _restore(model, weights_path)
    except ValueError as error:
        fits = _inner_models_fitting(model, weights_path) if weights_path is not None else []
        if len(fits) > 1:
            raise ValueError(
                f"`weights_path` holds the weights of {len(fits)} models inside {model.name!r} "
                f"({', '.join(repr(path) for path, _ in fits)}): call restore_frozen_float32 on the one "
                f"it is for. Received: weights_path={weights_path!r}") from error
        if not fits:
            raise
        said = []  # the file is for a model inside: Keras's warnings about loading it into `model` are moot
    finally:
        for w in said:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    restored = _restore(fits[0][1], weights_path)
    forget_traced(model)
    return restored


def _restore(model, weights_path):
    variables = frozen_16bit(model)
    stored = [(storage.storage_dtype(v), v._value.read_value()) for v in variables]
    keep = {id(v) for v in variables}
    others = [v for v in model.variables if id(v) not in keep] if weights_path is not None else []
    values = [v.numpy() for v in others]
    for v in variables:
        storage.set_storage(v, "float32")
        v._keras_amp_frozen_16bit = False
    try:
        if weights_path is not None:
            model.load_weights(weights_path)
    except BaseException:
        # A file that does not fit: the model as it was (Keras loads what matches before it raises),
        # so that a second call with the right file still finds the frozen weights.
        for v, (dtype, value) in zip(variables, stored):
            storage.set_storage(v, dtype, value)
            v._keras_amp_frozen_16bit = True
        raise
    finally:
        for v, value in zip(others, values):  # every other weight keeps the value it has now
            v.assign(value)
        forget_traced(model, variables)
    return [v.path for v in variables]


def _inner_models_fitting(model, weights_path) -> list[tuple[str, keras.Model]]:
    """(path, model) of each model inside `model` that loads the file at `weights_path`: Keras's own
    matching, by a trial load; every weight gets its value back after each trial."""
    inner = [(path, layer) for path, layer in model_graph.walk(model) if isinstance(layer, keras.Model)]
    if not inner:
        return []
    values = [(v, v.numpy()) for v in model.variables]
    fits = []
    for path, layer in inner:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Keras warns for each part of a file that does not fit
                layer.load_weights(weights_path)
            fits.append((path, layer))
        except (ValueError, TypeError, KeyError):
            pass
        finally:
            for v, value in values:
                v.assign(value)
    return fits

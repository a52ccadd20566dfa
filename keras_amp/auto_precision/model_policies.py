"""Per-layer policies of a built model, read and set in place (shared by search, fallback, schedule),
and the store that keeps the callbacks' precision decisions in the model's checkpoints."""

from __future__ import annotations

import contextlib
import json
import weakref
from typing import Any, Iterator, Protocol

import keras
import numpy as np

from keras_amp import _compat, layer_policies, model_graph
from keras_amp.matmul16_policy import Matmul16DTypePolicy

FLOAT32 = "float32"


def layers_by_path(model: keras.Model, *, tree: model_graph.LayerTree | None = None) -> dict[str, keras.layers.Layer]:
    """Every layer below `model` by its `model_graph.walk` path ("block/dense"), in model order.

    `tree`: the model's `model_graph.layer_tree`, read once by a caller that asks again and again
    (layers do not change when their policies do); None walks the model. The functions below take
    `tree` the same way.
    """
    return dict(model_graph.walk(model, tree=tree))


def policy_names(model: keras.Model, *, tree: model_graph.LayerTree | None = None) -> dict[str, str]:
    """path -> dtype policy name for every layer, read now."""
    return {path: layer.dtype_policy.name for path, layer in layers_by_path(model, tree=tree).items()}


def set_policies(model: keras.Model, policies: dict[str, str], *,
                 tree: model_graph.LayerTree | None = None) -> None:
    """Sets each named layer's dtype policy in place and drops the model's traced functions.

    Variables are untouched (mixed and float32 policies both keep float32 variables), so
    weights and optimizer state carry over; the next `fit`/`evaluate`/`predict` traces anew.
    `layer_policies.set_in_place` sets them: all or nothing, a quantized layer keeps its
    quantization (or the change is refused naming it), `Normalization` statistics are refreshed.
    """
    layers = layers_by_path(model, tree=tree)
    unknown = sorted(set(policies) - set(layers))
    if unknown:
        raise ValueError(
            f"Unknown layer path(s) for model {model.name!r}: {unknown}. "
            f"Allowed: the paths of its layers, e.g. {list(layers)[:5]}"
        )
    # The one in-place setter: all or nothing, quantization kept, Normalization refreshed.
    layer_policies.set_in_place((path, layers[path], name) for path, name in policies.items())
    reset_functions(model)


def float32_policies(model: keras.Model, paths, *, tree: model_graph.LayerTree | None = None) -> dict[str, str]:
    """{path: "float32"} for `paths`, for every layer below one of them (a layer computes in float32
    only when the layers it calls do: an LSTM's cell computes its gates, a wrapper's layer its
    output), and for every layer above one whose policy is a `Matmul16DTypePolicy`: that policy's
    matmuls reach the layers inside it (an RNN's float32 cell), so a layer there is only float32
    once the whole recurrence is."""
    layers = layers_by_path(model, tree=tree)
    out = {}
    for path in paths:
        out[path] = FLOAT32
        for other, layer in layers.items():
            below, above = other.startswith(path + "/"), path.startswith(other + "/")
            if below or (above and isinstance(layer.dtype_policy, Matmul16DTypePolicy)):
                out[other] = FLOAT32
    return out


def decision_unit(layers: dict[str, keras.layers.Layer], path: str) -> str:
    """The path a precision decision about `path` is made at: the outermost `keras.layers.RNN` above
    it, else `path` itself. An RNN layer casts its input to its own compute dtype before its cell
    sees it, and LSTM, GRU and SimpleRNN rebuild their cell from their own config: a cell's own
    policy neither makes the recurrence float32 nor survives `keras.saving.load_model`."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        above = "/".join(parts[:i])
        if isinstance(layers.get(above), keras.layers.RNN):
            return above
    return path


def unit_members(layers: dict[str, keras.layers.Layer], unit: str) -> list[str]:
    """The paths whose policy a decision at `unit` sets: `unit` with every layer below it, as
    `float32_policies` sets them. A layer calling others mixes their results with its own inputs
    (keras-hub's `x + residual`), which raw TensorFlow ops take only in one dtype: the layer alone
    in 16 bits with float32 layers inside it does not run, nor float32 with 16-bit ones inside."""
    return [p for p in layers if p == unit or p.startswith(unit + "/")]


def own_members(layers: dict[str, keras.layers.Layer], unit: str) -> list[str]:
    """The members of `unit` whose work is its own: those it is the `decision_unit` of (an RNN
    with its cell; a layer calling others, alone: they are decided apart)."""
    return [p for p in unit_members(layers, unit) if decision_unit(layers, p) == unit]


def reset_functions(model: keras.Model) -> None:
    """Forgets traced train/test/predict functions so the next call retraces with the new policies."""
    for attr in ("train_function", "test_function", "predict_function"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)


@contextlib.contextmanager
def temporary_policies(model: keras.Model, *, tree: model_graph.LayerTree | None = None) -> Iterator[None]:
    """Restores every layer's policy (and drops traced functions) on exit."""
    saved = policy_names(model, tree=tree)
    try:
        yield
    finally:
        set_policies(model, saved, tree=tree)


def global_step(optimizer: Any) -> int:
    """Training steps run so far, read from the optimizer (so it is checkpointed with it).

    keras_amp's LossScaleOptimizer counts every step, applied or skipped, in `total_steps`;
    any other optimizer's `iterations` counts applied steps (a stock LossScaleOptimizer leaves
    skipped steps out).
    """
    if not optimizer.built:
        return 0  # fit builds the optimizer at its first step: no step has run yet
    counter = getattr(optimizer, "total_steps", None)
    if counter is None:
        counter = optimizer.iterations
    return int(keras.ops.convert_to_numpy(counter))


class Checkpointed(Protocol):
    """A callback whose decisions `DecisionStore` saves and restores."""

    def checkpoint_state(self) -> dict: ...

    def restore_state(self, state: dict) -> None: ...


STORE_ATTR = "_keras_amp_decisions"
# Off (`_compat.AUTO_PRECISION`): a plain object the saving walk skips; `decision_store` warns.
_SAVEABLE = _compat.original("keras.src.saving.keras_saveable.KerasSaveable") or object


class DecisionStore(_SAVEABLE):
    """The precision decisions of keras_amp's callbacks, saved with the model's weights.

    It hangs on the model as a plain attribute (`decision_store(model)`), outside Keras's
    tracking, so it adds nothing to `model.weights`; Keras's saving walk visits every attribute,
    so `save_weights`, `.keras` files, `BackupAndRestore` and `ModelCheckpoint` write it beside
    the layers and the optimizer, and `load_weights` reads it back into the same model. Each
    registered callback's state is one uint8 array holding JSON: decisions name layers and carry
    evidence strings, which no numeric variable holds. The host writes it at save time and
    reads it at load time, so nothing of it runs inside the step or differs between replicas.
    """

    def __init__(self):
        self._owners: dict[str, Checkpointed] = {}
        self._unclaimed: dict[str, dict] = {}  # loaded before its callback registered

    def _obj_type(self):
        # Keras's saving walk accepts only its own kinds here; it uses the kind to skip the base
        # class's attributes. A bare Operation's are the fewest, and ours hold no saveables.
        return "Operation"

    def register(self, owner: Checkpointed, key: str | None = None) -> str:
        """Saves `owner`'s state from now on; restores state loaded for its name; returns the name.

        The name is `key` (default: the owner's class name), with `_1`, `_2`, ... for the next
        owners of the same key: callbacks of one key are told apart by their order only, so an
        owner whose state depends on its arguments puts them in its key.
        """
        for name, known in self._owners.items():
            if known is owner:
                return name
        base = key or type(owner).__name__
        name, i = base, 1
        while name in self._owners:
            name, i = f"{base}_{i}", i + 1
        self._owners[name] = owner
        if name in self._unclaimed:
            owner.restore_state(self._unclaimed.pop(name))
        return name

    def save_own_variables(self, store):
        states = dict(self._unclaimed)  # a save must not drop what a load brought in
        states.update({name: owner.checkpoint_state() for name, owner in self._owners.items()})
        for name, state in sorted(states.items()):
            store[name] = np.frombuffer(json.dumps(state, sort_keys=True).encode("utf-8"), np.uint8)

    def load_own_variables(self, store):
        # A checkpoint written without a callback's state (older, or trained without it) leaves
        # that callback as it is.
        for name in list(store.keys()):
            state = json.loads(np.asarray(store[name], np.uint8).tobytes().decode("utf-8"))
            if name in self._owners:
                self._owners[name].restore_state(state)
            else:
                self._unclaimed[name] = state


class _DecisionsInFile(_SAVEABLE):
    """What a model without a `DecisionStore` shows the saving walk under `STORE_ATTR`.

    `keras.saving.load_model` builds a new model, which has no store yet when the walk loads the
    file: this reads the file's decisions into a store attached then, kept for the callbacks that
    register later. It saves nothing (no `save_own_variables`): a model that never had decisions
    adds nothing to its files. The model is held through a weak reference, which the walk skips
    (the model itself would be walked again under this path).
    """

    def __init__(self, model: keras.Model):
        self._model = weakref.ref(model)

    def _obj_type(self):
        return "Operation"

    def load_own_variables(self, store):
        model = self._model()
        if model is not None and list(store.keys()):
            decision_store(model).load_own_variables(store)


class _Decisions:
    """The class attribute `install_file_decisions` puts on `keras.Model`: a model's own store (an
    instance attribute, which comes first), else a `_DecisionsInFile` for it."""

    def __get__(self, model, owner=None):
        return self if model is None else _DecisionsInFile(model)


def install_file_decisions() -> None:
    """Puts `_Decisions` on `keras.Model` (idempotent), so that a model loaded from a file
    (`keras.saving.load_model`, a `.keras` `ModelCheckpoint`) brings its callbacks' decisions with it.

    Done when this module is imported, unlike the policy's hooks (`keras_amp.enable()`): a restarted
    run loads its model before it makes callbacks, and maybe without `enable()`. It saves nothing
    and reads only this store's entry, so stock models and files are as they were.
    """
    if _compat.is_on(_compat.AUTO_PRECISION) and not isinstance(keras.Model.__dict__.get(STORE_ATTR), _Decisions):
        setattr(keras.Model, STORE_ATTR, _Decisions())


def decision_store(model: keras.Model) -> DecisionStore:
    """The model's `DecisionStore`, attached on first use."""
    store = model.__dict__.get(STORE_ATTR)  # the instance's own, not the class attribute
    if store is None:
        _compat.warn_off(_compat.AUTO_PRECISION)  # then the decisions are not checkpointed
        store = DecisionStore()
        # object.__setattr__: Keras's tracking would add it to the model's layers and lock
        # checks; the saving walk finds plain attributes too.
        object.__setattr__(model, STORE_ATTR, store)
    return store


def reapply_float32(model: keras.Model, paths, *, tree: model_graph.LayerTree | None = None) -> tuple[str, ...]:
    """Sets `paths` (and their Matmul16 recurrences) back to float32 where a rebuilt model lost it.

    Rebuilds the train function when anything changed (callers run inside `fit`); returns the
    paths whose policy changed.
    """
    tree = model_graph.layer_tree(model, tree)
    layers = layers_by_path(model, tree=tree)
    wanted = float32_policies(model, [p for p in paths if p in layers], tree=tree)
    changed = tuple(p for p in wanted if layers[p].dtype_policy.name != FLOAT32)
    if changed:
        set_policies(model, {p: FLOAT32 for p in changed}, tree=tree)
        model.make_train_function(force=True)
    return changed


install_file_decisions()

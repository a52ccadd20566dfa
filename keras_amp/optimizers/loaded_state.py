"""Saved `LossScaleOptimizer` state: a store assigned into a built optimizer (ours, stock Keras's, or
another layout left to Keras), read before build (`peek`) while `load_weights` holds it for the build,
and a loaded scale or step count brought in line with the optimizer. It reads the private members
`loss_scale_optimizer`'s docstring lists (`_variables`, `_iterations`), pinned there."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from keras import ops

from keras_amp.optimizers import tiers

# Stock Keras 3.15.1 optimizer layout: iteration, learning_rate, step_counter, dynamic_scale.
STOCK_OWN_VARIABLES = 4
# Ours: stock's four, then overflow_count, consecutive_overflows, overflows_at_min_scale.
OWN_VARIABLES = 7
COUNTERS = ("overflow_count", "consecutive_overflows", "overflows_at_min_scale")


def assign(optimizer, store) -> bool:
    """Assigns `store` to the built `optimizer` where it is keras_amp's layout or stock Keras's;
    False for any other store (Keras's own loading decides then).

    The store holds the optimizer's own variables, then the inner optimizer's: one that builds later
    (LeanAdam) loads its own entry then, ours load now. Stock's store lacks our three counters: they
    start at 0.
    """
    own, inner = list(optimizer._variables), optimizer.inner_optimizer
    if not inner.built and len(store.keys()) >= len(own):
        for i, variable in enumerate(own):
            variable.assign(store[str(i)])
        return True
    if len(store.keys()) == len(optimizer.variables) - (len(own) - STOCK_OWN_VARIABLES):
        for i, variable in enumerate(own[:STOCK_OWN_VARIABLES] + list(inner.variables)):
            variable.assign(store[str(i)])
        # Stock never advances its own `iteration` (slot 0): every step it saw was applied.
        optimizer._iterations.assign(inner.iterations)
        logging.info("LossScaleOptimizer %r: loaded stock Keras LossScaleOptimizer state; "
                     "overflow counters start at 0.", optimizer.name)
        return True
    return False


def _int_scalar(store, key) -> bool:
    return key in store and np.shape(store[key]) == () and np.issubdtype(np.asarray(store[key]).dtype, np.integer)


def peek(store) -> dict | None:
    """What a store held for the build will set, read from the store (a dict of arrays): `loss_scale`,
    `total_steps`, the counters, `iterations` (the inner optimizer's) and `inner_start` (where the inner
    optimizer's entries begin). None for a store that is neither ours nor stock's, or was saved unbuilt.

    The layouts differ from entry 4 on: ours holds three int counters there, stock the inner optimizer's
    `iteration` (int) then its learning rate or first slot (float) or nothing.
    """
    if not store or "3" not in store or np.shape(store["3"]) != () or _int_scalar(store, "3"):
        return None
    if all(_int_scalar(store, str(i)) for i in range(STOCK_OWN_VARIABLES, OWN_VARIABLES)):
        start, counters, total = OWN_VARIABLES, [int(store[str(i)]) for i in range(4, 7)], int(store["0"])
    elif _int_scalar(store, "4"):
        start, counters, total = STOCK_OWN_VARIABLES, [0, 0, 0], int(store["4"])
    else:
        return None
    iterations = int(store[str(start)]) if _int_scalar(store, str(start)) else total - counters[0]
    return dict(zip(COUNTERS, counters), loss_scale=float(store["3"]), total_steps=total,
                iterations=iterations, inner_start=start)


def hold(optimizer, store) -> None:
    """`load_weights` into a model whose optimizer is not built yet (a fresh model, the usual resume): the
    store waits for `build` (Keras's would skip it with a warning, and the scale and counters restart)."""
    optimizer._deferred_state = {key: np.asarray(store[key]) for key in store.keys()}
    assign_before_build(optimizer, optimizer._deferred_state)
    hold_inner_load(optimizer)


def save_held(optimizer, store) -> bool:
    """Writes a held store again (saved before build, it is the state); False where none is held."""
    if optimizer.built or optimizer._deferred_state is None:
        return False
    for key, value in optimizer._deferred_state.items():
        store[key] = value
    return True


def scale_before_build(optimizer) -> float:
    """The first step's scale: a held store's (as the build brings it within bounds), else `initial_scale`;
    ValueError under tier="auto" without `initial_scale` (the variables decide it)."""
    loaded = peek(optimizer._deferred_state)
    if loaded is not None:
        return bounded(optimizer, loaded["loss_scale"])
    if optimizer.initial_scale is None:
        choices = ", ".join(f"{name} {v.initial_scale:g}" for name, v in tiers.TIERS.items())
        raise ValueError(
            f"`scale` of a tier='auto' LossScaleOptimizer is chosen at build, by parameter count ({choices}): "
            "build it first (`optimizer.build(model.trainable_variables)`; `fit` does), or call "
            f"`optimizer.initial_scale_for(model.trainable_variables)`. Received: tier='auto', built=False")
    return float(optimizer.initial_scale)


def built_variable(name: str, attr: str, doc: str) -> property:
    """A read-only property `name` returning variable `attr`, which exists once the optimizer is built;
    before, while a store is held, the value it holds (a constant)."""

    def get(optimizer):
        loaded = None if optimizer.built else peek(optimizer._deferred_state)
        if loaded is not None:
            return tf.constant(loaded[name], dtype="int64")
        if not optimizer.built:
            raise ValueError(f"`{name}` exists once the optimizer is built; call "
                             "`optimizer.build(model.trainable_variables)` or train first. Received: built=False")
        if attr == "_iterations" and tf.executing_eagerly():
            repair_total_steps(optimizer)
        return getattr(optimizer, attr)

    return property(get, doc=doc)


def assign_before_build(optimizer, store) -> None:
    """Assigns the variables that exist before build (the step counts, the inner optimizer's learning
    rate) from a held store, so `iterations`, `learning_rate` and `total_steps` read the loaded values
    until the build assigns the rest."""
    loaded = peek(store)
    if loaded is None:
        return
    optimizer._iterations.assign(loaded["total_steps"])
    inner = optimizer.inner_optimizer
    if inner.built:
        return
    for i, variable in enumerate(inner.variables):  # before build: a prefix of the built list
        entry = store.get(str(loaded["inner_start"] + i))
        if entry is None or np.shape(entry) != tuple(variable.shape) or (
                np.issubdtype(np.asarray(entry).dtype, np.integer) != ("int" in str(variable.dtype))):
            return
        variable.assign(entry)


def hold_inner_load(optimizer) -> None:
    """Keeps Keras from warning falsely about the unbuilt inner optimizer while `optimizer` holds a store.

    Keras's loading visits the inner optimizer after `optimizer` with its own entry: the same state
    `optimizer`'s store holds and its build assigns. Keras's `load_own_variables` then warns "Skipping
    variable loading for optimizer ..." (before build its variable count differs) though nothing is lost.
    This instance attribute skips that load quietly, only in that case; `release_inner_load` removes it at
    build. An inner optimizer with its own `load_own_variables` (LeanAdam) is left alone.
    """
    inner = optimizer.inner_optimizer
    base = keras.optimizers.Optimizer.load_own_variables
    if inner.built or type(inner).load_own_variables is not base or "load_own_variables" in vars(inner):
        return

    def load_own_variables(store):
        loaded = peek(optimizer._deferred_state)
        held = loaded is not None and len(optimizer._deferred_state) >= loaded["inner_start"] + len(store.keys())
        if held and not inner.built and len(store.keys()) != len(inner.variables):
            return  # assigned from the outer optimizer's store at its build
        base(inner, store)

    object.__setattr__(inner, "load_own_variables", load_own_variables)  # untracked, an instance attribute


def release_inner_load(optimizer) -> None:
    vars(optimizer.inner_optimizer).pop("load_own_variables", None)


def bounded(optimizer, scale: float) -> float:
    """`scale` brought within the optimizer's bounds (those known: tier="auto" knows its own at build)."""
    low, high = optimizer.min_scale, optimizer.max_scale
    if not optimizer.dynamic or low is None or high is None or low <= scale <= high:
        return scale
    return low if not scale > low else high  # NaN -> the floor


def clamp_scale(optimizer) -> None:
    """A stock save can hold 0.0 or inf (stock has no floor or ceiling): with 0 every gradient is 0,
    counts as finite and 0/0 writes NaN; with inf every step is skipped. Brings it in bounds."""
    scale = optimizer.scale
    clamped = bounded(optimizer, scale)
    if clamped is scale:  # in bounds, or a static scale
        return
    optimizer.dynamic_scale.assign(clamped)
    logging.warning("LossScaleOptimizer %r: loaded loss scale %g is outside [min_scale, max_scale] "
                    "= [%g, %g]; set to %g.", optimizer.name, scale, optimizer.min_scale, optimizer.max_scale,
                    clamped)


def steps_floor(optimizer):
    """`iterations + overflow_count`, the least `total_steps` can be (the step's tensor, read before it)."""
    return tf.add(tf.convert_to_tensor(optimizer.inner_optimizer.iterations),
                  tf.convert_to_tensor(optimizer._overflow_count))


def repair_total_steps(optimizer) -> None:
    """Raises `total_steps` to `iterations + overflow_count` where it is below (eagerly).

    Only a stock Keras checkpoint (`tf.train.Checkpoint`) leaves it there: it has no counters, and its
    own `iteration`, restored into our `total_steps`, never advances. Ours always has
    `total_steps >= iterations + overflow_count` (the inner optimizer counts at most the applied steps).
    """
    floor = sum(int(ops.convert_to_numpy(v)) for v in (optimizer.inner_optimizer.iterations,
                                                         optimizer._overflow_count))
    if int(ops.convert_to_numpy(optimizer._iterations)) < floor:
        optimizer._iterations.assign(floor)
        logging.info("LossScaleOptimizer %r: restored stock Keras LossScaleOptimizer state; total_steps set "
                     "to iterations + overflow_count = %d.", optimizer.name, floor)

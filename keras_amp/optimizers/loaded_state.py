"""A store of saved `LossScaleOptimizer` state assigned into a built one: ours, stock Keras's, or
another layout left to Keras; and a loaded scale brought within the optimizer's bounds. It reads the
private members `loss_scale_optimizer`'s docstring lists (`_variables`, `_iterations`), pinned there."""

from __future__ import annotations

from absl import logging

# Stock Keras 3.15.1 optimizer layout: iteration, learning_rate, step_counter, dynamic_scale.
STOCK_OWN_VARIABLES = 4


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


def clamp_scale(optimizer) -> None:
    """A stock save can hold 0.0 or inf (stock has no floor or ceiling): with 0 every gradient is 0,
    counts as finite and 0/0 writes NaN; with inf every step is skipped. Brings it in bounds."""
    scale = optimizer.scale
    if not optimizer.dynamic or optimizer.min_scale <= scale <= optimizer.max_scale:
        return
    clamped = optimizer.min_scale if not scale > optimizer.min_scale else optimizer.max_scale  # NaN -> min
    optimizer.dynamic_scale.assign(clamped)
    logging.warning("LossScaleOptimizer %r: loaded loss scale %g is outside [min_scale, max_scale] "
                    "= [%g, %g]; set to %g.", optimizer.name, scale, optimizer.min_scale, optimizer.max_scale,
                    clamped)

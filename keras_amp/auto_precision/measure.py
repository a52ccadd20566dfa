"""What `search_precision` measures: the loss, outputs and gradients of one precision configuration
on the search's batches, and their relative errors against the all-float32 model.

The loss is weighted and reduced as `fit` computes it: a loss function or name is wrapped as `compile`
wraps it (`keras_amp.losses.as_compiled`), a `keras.losses.Loss` whose
"sum_over_batch_size" reduction takes the batch's sample weights; a `keras.losses.Loss` keeps its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_amp import losses
from keras_amp.diagnostics import user_site

DATA_FORMS = "a tf.data.Dataset of (x, y[, sample_weight]) batches, one such tuple, or a list of them"


@dataclasses.dataclass(frozen=True)
class Errors:
    """Relative errors against the all-float32 model (inf when non-finite), the largest over the batches."""

    loss: float  # |loss - ref| / |ref|
    output: float  # ||outputs - ref|| / ||ref||, all outputs flattened into one vector
    gradient: float  # ||gradients - ref|| / ||ref||, all trainable weights' gradients in one vector

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in (self.loss, self.output, self.gradient))


NOT_VIABLE = Errors(math.inf, math.inf, math.inf)


def batches_of(data: Any, batches: int) -> list[tuple]:
    """The first `batches` (x, y[, sample_weight]) batches of `data`, checked."""
    if isinstance(data, tf.data.Dataset):
        out = [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in data.take(batches)]
    elif isinstance(data, (tuple, list)) and data and isinstance(data[0], (tuple, list)):
        out = [tuple(b) for b in list(data)[:batches]]  # a list of (x, y) batches
    elif isinstance(data, (tuple, list)) and 2 <= len(data) <= 3:
        out = [tuple(data)]  # one (x, y[, sample_weight]) batch
    else:
        raise TypeError(f"`data` must be {DATA_FORMS}. Received: data of type {type(data).__name__}")
    if not out:
        raise ValueError("`data` must yield at least one batch. Received: an empty `data`")
    for i, batch in enumerate(out):
        if len(batch) < 2:
            raise ValueError("`data` must yield (x, y) batches: the loss needs the targets. "
                             f"Received: batch {i} of x alone. Allowed: {DATA_FORMS}")
        if len(batch) > 3 or batch[1] is None:
            what = f"{len(batch)} elements" if len(batch) > 3 else "y=None"
            raise ValueError(f"`data` must yield (x, y[, sample_weight]) batches with targets y. Received: batch {i} "
                             f"with {what}. Allowed: {DATA_FORMS}")
    return out


def loss_of(model: keras.Model, loss: Any) -> keras.losses.Loss:
    """`loss`, else the model's compiled loss, as a `keras.losses.Loss` that takes sample weights."""
    chosen = loss if loss is not None else getattr(model, "loss", None)
    if chosen is None:
        raise ValueError(
            "search_precision needs a loss: compile the model with one `loss`, or pass `loss=`. "
            f"Received: loss=None and model {model.name!r} has no compiled loss"
        )
    if keras.tree.is_nested(chosen):  # a compiled dict of losses is TensorFlow's tracking wrapper of one
        kind = "dict" if hasattr(chosen, "keys") else "list"
        raise TypeError(
            f"search_precision takes one loss for the whole output. Received: loss, a {kind} of losses "
            f"({len(chosen)} of them); pass `loss=` a single loss or callable(y_true, y_pred)"
        )
    return losses.as_compiled(chosen)


def run(model: keras.Model, batches: list[tuple], loss: keras.losses.Loss) -> list[tuple]:
    """(loss, outputs, gradients) per batch, eagerly (so current policies apply), inference mode."""
    results = []
    variables = model.trainable_variables
    for batch in batches:
        x, y, w = keras.utils.unpack_x_y_sample_weight(batch)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=False)
            # The loss as `fit` calls it, on the output itself (its Keras mask included); it computes in float32.
            value = keras.ops.mean(keras.ops.cast(loss(y, y_pred, sample_weight=w), "float32"))
            y_pred32 = keras.tree.map_structure(lambda t: keras.ops.cast(t, "float32"), y_pred)
        grads = tape.gradient(value, variables)
        grads = [np.zeros(v.shape, np.float32) if g is None
                 else keras.ops.convert_to_numpy(keras.ops.cast(g, "float32")) for g, v in zip(grads, variables)]
        outs = [keras.ops.convert_to_numpy(t).astype(np.float64) for t in keras.tree.flatten(y_pred32)]
        results.append((float(value), outs, grads))
    return results


def reference(model: keras.Model, batches: list[tuple], loss: keras.losses.Loss) -> list[tuple]:
    """`run` of the model as it is set now (all float32), whose errors on the input name `data`."""
    try:
        ref = run(model, batches, loss)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
        shapes = [keras.tree.map_structure(lambda t: tuple(np.shape(t)), b) for b in batches]
        raise ValueError(
            f"`data` must yield (x, y[, sample_weight]) batches that model {model.name!r} and the loss take: "
            f"{user_site.one_line(e)}. Received: batch shapes {shapes}") from e
    if not all(math.isfinite(r[0]) for r in ref):
        raise ValueError("The all-float32 model gives a non-finite loss on `data`: nothing to compare against.")
    return ref


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    if not np.all(np.isfinite(a)):
        return math.inf
    denom = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / (denom if denom > 0 else 1.0)


def errors(measured: list[tuple], ref: list[tuple]) -> Errors:
    """The largest relative loss, output and gradient errors over the batches."""
    loss = output = gradient = 0.0
    for (l, outs, grads), (rl, routs, rgrads) in zip(measured, ref):
        loss = max(loss, abs(l - rl) / max(abs(rl), 1e-12) if math.isfinite(l) else math.inf)
        output = max(output, _relative(np.concatenate([o.ravel() for o in outs]),
                                       np.concatenate([o.ravel() for o in routs])))
        g = np.concatenate([x.ravel().astype(np.float64) for x in grads]) if grads else np.zeros(1)
        rg = np.concatenate([x.ravel().astype(np.float64) for x in rgrads]) if rgrads else np.zeros(1)
        gradient = max(gradient, _relative(g, rg))
    return Errors(loss=loss, output=output, gradient=gradient)

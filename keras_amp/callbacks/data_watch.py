"""`DataWatch`: counts, inside each training step, the batches whose inputs or labels hold NaN/inf.

`LossScaleMonitor` installs it for the length of a `fit`: it wraps the model's `train_step` (a
public override point) so that every step also reduces each floating-point input and label to
"all finite?", and keeps the counts in variables read at the monitor's log points, never inside
the step. Under a LossScaleOptimizer a non-finite batch overflows at every scale and looks like
a scale problem; these counts let the diagnosis name the data first.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

# Arrays watched per batch (inputs and labels, flattened); further ones share the last slot.
MAX_ARRAYS = 16


def _floating_leaves(data: Any) -> list[tuple[str, Any]]:
    """(name, tensor) for each dense floating-point input and label of a batch."""
    x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
    leaves = []
    for part, value in (("inputs", x), ("labels", y)):
        if value is None:
            continue
        for path, leaf in keras.tree.flatten_with_path(value):
            if tf.is_tensor(leaf) and not isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor)) \
                    and leaf.dtype.is_floating:
                leaves.append((part + "".join(f"[{k!r}]" for k in path), leaf))
    return leaves


class DataWatch:
    """Per-step NaN/inf counts of a model's training batches, in variables.

    `steps` counts the steps run since `reset()`, `bad[i]` the batches in which array `names[i]`
    held NaN/inf, `first_bad` the index of the first such step (-1: none). Across replicas the
    flags are summed, so every replica writes the same values.

    Args:
        model: The `keras.Model` whose `fit` is watched.
    """

    def __init__(self, model: keras.Model):
        self.model = model
        self.names: list[str] = []
        self._original = None
        self._had_own = False
        with model.distribute_strategy.scope():
            kw = dict(trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.steps = tf.Variable(tf.constant(0, tf.int64), name="data_watch_steps", **kw)
            self.bad = tf.Variable(tf.zeros([MAX_ARRAYS], tf.int64), name="data_watch_bad", **kw)
            self.first_bad = tf.Variable(tf.constant(-1, tf.int64), name="data_watch_first_bad", **kw)

    def _count(self, data) -> None:
        leaves = _floating_leaves(data)
        if not leaves:
            return
        names = [n for n, _ in leaves][:MAX_ARRAYS]
        if len(leaves) > MAX_ARRAYS:
            names[-1] = "further arrays"
        self.names = names
        flags = [tf.reduce_any(tf.logical_not(tf.math.is_finite(t))) for _, t in leaves]
        slots = [tf.cast(f, tf.int64) for f in flags[:MAX_ARRAYS - 1]]
        rest = flags[MAX_ARRAYS - 1:]
        if rest:
            slots.append(tf.cast(tf.reduce_any(tf.stack(rest)), tf.int64))
        vector = tf.pad(tf.stack(slots), [[0, MAX_ARRAYS - len(slots)]])
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            # Every replica writes the same counts (an array bad on any replica counts once).
            vector = tf.minimum(context.all_reduce(tf.distribute.ReduceOp.SUM, vector), 1)
        any_bad = tf.reduce_any(vector > 0)
        step = self.steps.read_value()
        self.first_bad.assign(tf.where(any_bad & (self.first_bad < 0), step, self.first_bad))
        self.bad.assign_add(vector)
        self.steps.assign_add(1)

    def install(self) -> None:
        """Wraps the model's `train_step` and rebuilds its train function (one retrace)."""
        if self._original is not None:
            return
        model = self.model
        self._had_own = "train_step" in vars(model)
        original = model.train_step
        watch = self

        def train_step(data):
            watch._count(data)
            return original(data)

        self._original = original
        model.train_step = train_step
        model.make_train_function(force=True)

    def remove(self) -> None:
        """Puts the model's own `train_step` back; its next `fit` rebuilds the train function."""
        if self._original is None:
            return
        if self._had_own:
            self.model.train_step = self._original
        else:
            del self.model.train_step
        self._original = None
        self.model.train_function = None

    def reset(self) -> None:
        self.steps.assign(0)
        self.bad.assign(tf.zeros([MAX_ARRAYS], tf.int64))
        self.first_bad.assign(-1)

    def read(self) -> tuple[int, np.ndarray, int]:
        """(steps, bad counts per array, first bad step): one host read."""
        return int(self.steps.numpy()), self.bad.numpy(), int(self.first_bad.numpy())

    def describe(self, steps_per_epoch: int | None = None) -> str:
        """Which batches held NaN/inf, or "" when none did."""
        steps, bad, first = self.read()
        if first < 0:
            return ""
        arrays = [f"{name} ({int(c)} batch{'es' if c > 1 else ''})" for name, c in zip(self.names, bad) if c]
        where = f"step {first + 1} of this fit"
        if steps_per_epoch:
            where += f" (epoch {first // steps_per_epoch + 1}, batch {first % steps_per_epoch})"
        return f"the training batch of {where}: {', '.join(arrays)}"

"""`Float32Fallback`: a layer that keeps overflowing (or underflowing) moves to float32, alone.

At log points (every `check_every` training batches) the callback reads the loss and the
LossScaleOptimizer's `overflow_count` variable; nothing is read inside the step. After
`patience` consecutive checks with an overflow (a skipped step or a non-finite loss), it runs
`keras_amp.diagnostics.find_overflow` on the probe batches, takes the layer that *produced* the
first non-finite value (forward, else backward), sets that layer, and only that layer, to
float32 in place, rebuilds the train function, and logs the decision with the evidence. The
layer's policy is part of its config, so a `.keras` reload of a Sequential or functional model
trains the same way (a subclassed model rebuilds its sublayers from code: re-apply
`decisions` there). After `max_layers` moves, or when the locator names no layer it can move,
it stops acting and logs the diagnosis instead.

The decisions and the detector's position (step count, overflow streak, last overflow count)
are saved with the model's weights (`model_policies.DecisionStore`), so a run restored by
`BackupAndRestore` or from a `ModelCheckpoint` (`load_weights`, or `keras.saving.load_model` of a
`.keras` file) sets the moved layers to float32 again at
`on_train_begin`/`on_epoch_begin` instead of relearning them with another skipped step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from keras_amp import model_graph, validation
from keras_amp.auto_precision import model_policies
from keras_amp.diagnostics.overflow import find_overflow

FLOAT32 = "float32"


@dataclasses.dataclass(frozen=True)
class FallbackDecision:
    """One move to float32: the layer, the batch after which it happened, and the evidence."""

    layer: str
    step: int
    reason: str
    evidence: str


def _probe_batches(probe: Any, limit: int) -> list[tuple]:
    if isinstance(probe, tf.data.Dataset):
        return [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in probe.take(limit)]
    if isinstance(probe, (tuple, list)) and 1 <= len(probe) <= 3 and not isinstance(probe[0], (tuple, list)):
        return [tuple(probe)]
    if isinstance(probe, (tuple, list)) and probe and all(isinstance(b, (tuple, list)) for b in probe):
        return [tuple(b) for b in list(probe)[:limit]]
    raise TypeError(
        "`probe` must be one (x, y) batch, a list of them, or a tf.data.Dataset of them. "
        f"Received: probe of type {type(probe).__name__}"
    )


class Float32Fallback(keras.callbacks.Callback):
    """Moves a layer that repeatedly overflows (or underflows) to float32, and only that layer.

    Args:
        probe: One (x, y) batch, a list of them, or a `tf.data.Dataset`: what the locator runs
            on (callbacks do not see the training batch; use batches from the training data).
        max_layers: Int, default 2. The most layers moved; then the diagnosis is logged instead.
        patience: Int, default 2. Consecutive checks with an overflow before acting.
        check_every: Int, default 1. Training batches between checks (each check reads two
            scalars from the device).
        underflow_threshold: Float in (0, 1] or None (default: off). At each epoch end, a layer
            losing at least this fraction of its gradient elements to zero/subnormals on the
            probe also moves to float32.
        probe_batches: Int, default 4. How many probe batches the locator may try.

    The decisions are saved with the model's weights and set again after a restore: a model
    loaded from a file (`keras.saving.load_model`) or given `load_weights` brings them to this
    callback when `fit` starts. List this callback before `BackupAndRestore`/`ModelCheckpoint` so
    an epoch-end (underflow) move is in that epoch's checkpoint.
    """

    def __init__(self, probe: Any, *, max_layers: int = 2, patience: int = 2, check_every: int = 1,
                 underflow_threshold: float | None = None, probe_batches: int = 4):
        super().__init__()
        self.max_layers = validation.check_int("max_layers", max_layers, min_value=1)
        self.patience = validation.check_int("patience", patience, min_value=1)
        self.check_every = validation.check_int("check_every", check_every, min_value=1)
        if underflow_threshold is not None:
            underflow_threshold = validation.check_float(
                "underflow_threshold", underflow_threshold, min_value=0.0, min_inclusive=False, max_value=1.0)
        self.underflow_threshold = underflow_threshold
        probe_batches = validation.check_int("probe_batches", probe_batches, min_value=1)
        self._probe = _probe_batches(probe, probe_batches)
        self.decisions: list[FallbackDecision] = []
        self.gave_up: str | None = None
        self._step = 0
        self._streak = 0
        self._last_overflows: int | None = None  # None until training (or a checkpoint) sets it
        self._loss_blocked = False

    def set_model(self, model):
        super().set_model(model)
        model_policies.decision_store(model).register(self)

    def checkpoint_state(self) -> dict:
        """Decisions and detector position, for the model's checkpoint."""
        return {
            "decisions": [dataclasses.asdict(d) for d in self.decisions],
            "gave_up": self.gave_up,
            "step": self._step,
            "streak": self._streak,
            "last_overflows": self._last_overflows,
            "loss_blocked": self._loss_blocked,
        }

    def restore_state(self, state: dict) -> None:
        """Takes decisions and detector position from a checkpoint; the hooks set the policies again."""
        self.decisions = [FallbackDecision(**d) for d in state["decisions"]]
        self.gave_up = state["gave_up"]
        self._step = int(state["step"])
        self._streak = int(state["streak"])
        self._last_overflows = None if state["last_overflows"] is None else int(state["last_overflows"])
        self._loss_blocked = bool(state["loss_blocked"])

    def _reapply(self) -> None:
        if not self.decisions:
            return  # nothing decided: no walk of the model
        changed = model_policies.reapply_float32(self.model, [d.layer for d in self.decisions])
        if changed:
            logging.warning("Float32Fallback: restored %s -> float32 (decided before the restart)", ", ".join(changed))

    def _overflow_count(self) -> int | None:
        """keras_amp's LossScaleOptimizer's skipped-step count; None without one."""
        optimizer = self.model.optimizer
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or not hasattr(type(optimizer), "overflow_count"):
            return None
        if not optimizer.built:
            return 0  # fit builds the optimizer at its first step: nothing has overflowed yet
        return int(keras.ops.convert_to_numpy(optimizer.overflow_count))

    def on_train_begin(self, logs=None):
        self._reapply()
        # The streak and the last count are training state, kept across fit() calls and
        # checkpoints; only a fresh callback starts counting from the optimizer's value.
        if self._last_overflows is None:
            self._last_overflows = self._overflow_count() or 0

    def on_epoch_begin(self, epoch, logs=None):
        self._reapply()  # also here: a BackupAndRestore listed after this callback restores later
        self._loss_blocked = False

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self.gave_up is not None or self._step % self.check_every:
            return
        overflows = self._overflow_count()
        if overflows is not None:  # a skipped step is the overflow signal
            event = overflows > (self._last_overflows or 0)
            self._last_overflows = overflows
        else:
            # The logged loss is the epoch's running mean: once non-finite it stays so until the
            # epoch ends, so after a move it says nothing new before the next epoch.
            loss = (logs or {}).get("loss")
            event = not self._loss_blocked and loss is not None and not math.isfinite(float(loss))
        self._streak = self._streak + 1 if event else 0
        if self._streak >= self.patience:
            self._streak = 0
            self._locate_and_move()

    def on_epoch_end(self, epoch, logs=None):
        if self.underflow_threshold is None or self.gave_up is not None:
            return
        tree = model_graph.layer_tree(self.model)  # the one walk: the probe and the moves read it
        for x, y, *_ in (b + (None,) if len(b) == 1 else b for b in self._probe):
            report = find_overflow(self.model, x, y, tree=tree)
            for stats in report.underflowing(self.underflow_threshold):
                fraction = stats.gradients.underflow_fraction
                self._move(stats.path, f"{fraction:.0%} of its gradient elements underflow to zero or subnormals",
                           f"find_overflow: {stats.path} underflow fraction {fraction:.3f} at scale {report.loss_scale:g}",
                           tree)
            break

    def _locate_and_move(self) -> None:
        tree = model_graph.layer_tree(self.model)  # the one walk: each probe and the move read it
        for batch in self._probe:
            x, y = batch[0], (batch[1] if len(batch) > 1 else None)
            report = find_overflow(self.model, x, y, tree=tree)
            producer = report.forward or report.backward
            if producer is not None:
                self._move(producer.layer, f"it produced the first non-finite value ({producer.phase} pass)",
                           f"find_overflow: {producer.phase} producer {producer.op_type} op {producer.op!r} "
                           f"in layer {producer.layer!r} at loss scale {report.loss_scale:g}", tree)
                return
        self._give_up(
            "overflows repeat but find_overflow reproduces none on the probe batches: the probe may not "
            "contain the offending inputs, or the overflow is in the loss/optimizer; see LossScaleMonitor's "
            "diagnosis (lower the initial scale 2x, check the input pipeline)"
        )

    def _move(self, path: str, reason: str, evidence: str, tree: model_graph.LayerTree) -> None:
        layers = model_policies.layers_by_path(self.model, tree=tree)
        layer = layers.get(path)
        wanted = {} if layer is None else model_policies.float32_policies(self.model, [path], tree=tree)
        if all(layers[p].dtype_policy.name == FLOAT32 for p in wanted):
            self._give_up(f"the locator names {path!r}, which is already float32 or not a layer this model can "
                          f"move; evidence: {evidence}")
            return
        if len(self.decisions) >= self.max_layers:
            self._give_up(f"{len(self.decisions)} layer(s) already moved to float32 (max_layers={self.max_layers}); "
                          f"next candidate {path!r}: {evidence}")
            return
        model_policies.set_policies(self.model, wanted, tree=tree)
        self.model.make_train_function(force=True)
        self._loss_blocked = True
        decision = FallbackDecision(path, self._step, reason, evidence)
        self.decisions.append(decision)
        logging.warning("Float32Fallback: layer %r -> float32 after step %d: %s. Evidence: %s",
                        path, self._step, reason, evidence)

    def _give_up(self, why: str) -> None:
        self.gave_up = why
        logging.warning("Float32Fallback stops moving layers: %s", why)

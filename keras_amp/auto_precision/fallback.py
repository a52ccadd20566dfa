"""`Float32Fallback`: a layer that keeps overflowing (or underflowing) moves to float32, alone.

At log points (every `check_every` training batches) the callback reads the loss and the
LossScaleOptimizer's `overflow_count` variable; nothing is read inside the step. After
`patience` consecutive checks with an overflow (a skipped step or a non-finite loss), it runs
`keras_amp.diagnostics.find_overflow` on the probe batches, takes the layer that *produced* the
first non-finite value (forward, else backward), sets that layer, and only that layer, to
float32 in place, rebuilds the train function, and logs the decision with the evidence. The
layer's policy is part of its config, so a `.keras` reload of a Sequential or functional model
trains the same way (a subclassed model rebuilds its sublayers from code: re-apply
`decisions` there).

Skipped steps are also how a dynamic loss scale calibrates: it backs off from a scale too high for
the gradients. The forward pass does not depend on the scale, the backward pass does, so a backward
overflow that the probe no longer shows at the scaler's floor (`min_scale`) is left to the scaler:
skipped steps do not count until it has applied a step or reached that floor. A locator run that
finds no layer to move is a miss: the next run waits for `patience * 2**misses` overflowing checks;
after `locate_tries` misses in a row, or `max_layers` moves, it stops acting and logs the diagnosis.

The decisions and the detector's position (step count, overflow streak, last overflow count,
misses, calibration) are the model's: saved with its weights (`model_policies.DecisionStore`), and
continued by a new callback in a later `fit` of the same model, so a run restored by
`BackupAndRestore` or from a `ModelCheckpoint` (`load_weights`, or `keras.saving.load_model` of a
`.keras` file) sets the moved layers to float32 again at `on_train_begin`/`on_epoch_begin` instead
of relearning them with another skipped step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from keras_amp import model_graph, validation
from keras_amp.auto_precision import model_policies
from keras_amp.diagnostics.overflow import find_overflow

FLOAT32 = "float32"
# Orders `set_model` and `on_train_begin` calls: Keras sets the model of every callback of a
# `fit` before any of them begins, so a state begun after a callback's `set_model` is in use in its fit.
_CLOCK = itertools.count()
# DecisionStore -> the Float32Fallbacks it saves through, one per slot: objects holding only the
# model's state, so a new callback continues a slot without the store changing owners.
_KEEPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class FallbackDecision:
    """One move to float32: the layer, the batch after which it happened, and the evidence."""

    layer: str
    step: int
    reason: str
    evidence: str


@dataclasses.dataclass
class _State:
    """A model's fallback state; the fields before `user` are its checkpoint."""

    decisions: list = dataclasses.field(default_factory=list)
    gave_up: str | None = None
    step: int = 0
    streak: int = 0
    last_overflows: int | None = None  # None until training (or a checkpoint) sets it
    loss_blocked: bool = False
    misses: int = 0  # locator runs in a row that moved nothing
    calibrating_from: int | None = None  # applied steps when the scaler was found calibrating
    user: Any = None  # weak reference to the callback training with it, and when it began
    began: int = -1
    legacy: bool = False  # loaded from a checkpoint written before `misses` existed

    def saved(self) -> dict:
        return {"decisions": [dataclasses.asdict(d) for d in self.decisions], "gave_up": self.gave_up,
                "step": self.step, "streak": self.streak, "last_overflows": self.last_overflows,
                "loss_blocked": self.loss_blocked, "misses": self.misses, "calibrating_from": self.calibrating_from}

    def load(self, state: dict) -> None:
        self.decisions = [FallbackDecision(**d) for d in state["decisions"]]
        self.gave_up = state["gave_up"]
        self.step, self.streak = int(state["step"]), int(state["streak"])
        self.last_overflows = None if state["last_overflows"] is None else int(state["last_overflows"])
        self.loss_blocked = bool(state["loss_blocked"])
        self.misses = int(state.get("misses", 0))
        self.calibrating_from = state.get("calibrating_from")
        self.legacy = "misses" not in state


def _new_keeper(state: _State) -> Float32Fallback:
    # A Float32Fallback holding only `state`: the store names a slot after its owner's class, and
    # files already name this one's slot "Float32Fallback".
    keeper = object.__new__(Float32Fallback)
    keeper._state = state
    return keeper


def _shapes(value: Any) -> list[tuple]:
    return [tuple(getattr(leaf, "shape", None) or np.shape(leaf)) for leaf in keras.tree.flatten(value)]


def _probe_batches(probe: Any, limit: int) -> list[tuple]:
    if isinstance(probe, tf.data.Dataset):
        batches = [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in probe.take(limit)]
    elif isinstance(probe, (tuple, list)) and 1 <= len(probe) <= 3 and not isinstance(probe[0], (tuple, list)):
        batches = [tuple(probe)]
    elif isinstance(probe, (tuple, list)) and probe and all(isinstance(b, (tuple, list)) for b in probe):
        batches = [tuple(b) for b in list(probe)[:limit]]
    else:
        raise TypeError(
            "`probe` must be one (x, y) batch, a list of them, or a tf.data.Dataset of them. "
            f"Received: probe of type {type(probe).__name__}"
        )
    if not batches:
        raise ValueError("`probe` must hold at least one batch. Received: an empty probe. Allowed: one (x, y) "
                         "batch, a list of them, or a tf.data.Dataset of them")
    for i, batch in enumerate(batches):
        if not 1 <= len(batch) <= 3 or batch[0] is None:
            raise ValueError(f"Each `probe` batch must be (x,), (x, y) or (x, y, sample_weight) with x given. "
                             f"Received: probe batch {i} with {len(batch)} item(s), x={batch[0]!r:.60}")
        shapes = [s for part in batch if part is not None for s in _shapes(part)]
        if any(not s or s[0] == 0 for s in shapes) or len({s[0] for s in shapes if s[0] is not None}) > 1:
            raise ValueError(
                "`probe` must hold batches: every array of x, y and sample weights has the batch axis first, "
                "of one size >= 1 (a tf.data.Dataset must be batched: `.batch(n)`). "
                f"Received: probe batch {i} with shapes {shapes}")
    return batches


def _check_probe_fits(model: keras.Model, batches: list[tuple]) -> None:
    """ValueError for a batch whose x the model's one Input cannot take (functional and Sequential
    models with an Input; others show their inputs only when called)."""
    try:
        inputs = model.inputs
    except AttributeError:
        return
    if not inputs or len(inputs) != 1:
        return
    ref = tuple(inputs[0].shape)
    for i, batch in enumerate(batches):
        shapes = _shapes(batch[0])
        if len(shapes) != 1:
            continue
        shape = shapes[0]
        # Keras's functional call takes x at the Input's rank, or one off where that extra axis is 1.
        if not (len(shape) == len(ref) or len(shape) == len(ref) + 1 and shape[-1] == 1
                or len(shape) == len(ref) - 1 and ref[-1] == 1):
            raise ValueError(
                f"`probe` batches must fit model {model.name!r}: its input has shape {ref} (the batch axis "
                f"first; a tf.data.Dataset must be batched). Received: probe batch {i} with x shape {shape}")


class Float32Fallback(keras.callbacks.Callback):
    """Moves a layer that repeatedly overflows (or underflows) to float32, and only that layer.

    Args:
        probe: One (x, y) batch, a list of them, or a batched `tf.data.Dataset`: what the locator
            runs on (callbacks do not see the training batch; use batches from the training data).
        max_layers: Int, default 2. The most layers moved; then the diagnosis is logged instead.
        patience: Int, default 2. Consecutive checks with an overflow before acting; after a
            locator run that moved nothing, `patience * 2**misses`. Skipped steps while the loss
            scale calibrates (backs off from a scale the probe's gradients do not fit) do not count.
        check_every: Int, default 1. Training batches between checks (each check reads two
            scalars from the device, two more while the scale calibrates).
        underflow_threshold: Float in (0, 1] or None (default: off). At each epoch end, a layer
            losing at least this fraction of its gradient elements to zero/subnormals on the
            probe also moves to float32.
        probe_batches: Int, default 4. How many probe batches the locator may try.

    `locate_tries` (class attribute, 3): locator runs in a row that find no layer to move before
    the callback stops acting. The decisions are the model's: saved with its weights and set
    again after a restore (a model loaded from a file or given `load_weights` brings them to
    this callback when `fit` starts), and a new callback in a later `fit` continues them. List
    this callback before `BackupAndRestore`/`ModelCheckpoint` so an epoch-end (underflow) move
    is in that epoch's checkpoint.
    """

    locate_tries = 3

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
        self._state = _State()
        self._keeper = None  # the keeper whose state this callback continues, once `fit` began
        self._set_at = -1

    decisions = property(lambda self: self._state.decisions, doc="The `FallbackDecision`s, in order.")
    gave_up = property(lambda self: self._state.gave_up, doc="Why it stopped acting, or None.")

    def set_model(self, model):
        super().set_model(model)
        self._set_at = next(_CLOCK)
        _check_probe_fits(model, self._probe)

    def checkpoint_state(self) -> dict:
        """Decisions and detector position, for the model's checkpoint."""
        return self._state.saved()

    def restore_state(self, state: dict) -> None:
        """Takes decisions and detector position from a checkpoint; the hooks set the policies again."""
        self._state.load(state)

    def _claim(self) -> None:
        """Continues the model's state that no other Float32Fallback of this `fit` uses, else a new slot."""
        store = model_policies.decision_store(self.model)
        keepers = _KEEPERS.setdefault(store, [])

        def free(keeper):
            user = keeper._state.user and keeper._state.user()
            return user is None or user is self or keeper._state.began < self._set_at

        keeper = next((k for k in [self._keeper] + keepers if k in keepers and free(k)), None)
        if keeper is None:
            keeper = _new_keeper(self._state if self._keeper is None else _State())
            keepers.append(keeper)
            store.register(keeper)  # takes the slot's state from a checkpoint loaded before
        self._keeper, self._state = keeper, keeper._state
        self._state.user, self._state.began = weakref.ref(self), next(_CLOCK)

    def _reopen_legacy(self) -> None:
        state = self._state
        if state.legacy and state.gave_up is not None and len(state.decisions) < self.max_layers:
            # Written before misses were counted: below `max_layers`, that stop was one locator run.
            logging.warning("Float32Fallback: acting again after a checkpoint's stop (%s); %d more locator "
                            "run(s) may find nothing before it stops", state.gave_up, self.locate_tries - 1)
            state.gave_up, state.misses = None, 1
        state.legacy = False

    def _reapply(self) -> None:
        if not self.decisions:
            return  # nothing decided: no walk of the model
        changed = model_policies.reapply_float32(self.model, [d.layer for d in self.decisions])
        if changed:
            logging.warning("Float32Fallback: restored %s -> float32 (decided before the restart)", ", ".join(changed))

    def _scaler(self):
        """keras_amp's LossScaleOptimizer (its counters are the overflow signal); None without one."""
        optimizer = self.model.optimizer
        amp = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and hasattr(type(optimizer), "overflow_count")
        return optimizer if amp else None

    def _read(self, name: str) -> int:
        optimizer = self._scaler()
        if not optimizer.built:
            return 0  # fit builds the optimizer at its first step: nothing has run yet
        return int(keras.ops.convert_to_numpy(getattr(optimizer, name)))

    def _floor_scale(self) -> float | None:
        """The lowest scale the scaler backs off to by itself (stock Keras's has no floor: 1); None where
        it does not back off (no scaler, a static scale)."""
        optimizer = self.model.optimizer
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or not getattr(optimizer, "dynamic", True):
            return None
        return float(getattr(optimizer, "min_scale", None) or 1.0)

    def on_train_begin(self, logs=None):
        self._claim()
        self._reopen_legacy()
        self._reapply()
        # The streak and the last count are training state, kept across fit() calls and
        # checkpoints; only a fresh state starts counting from the optimizer's value.
        if self._state.last_overflows is None:
            self._state.last_overflows = self._read("overflow_count") if self._scaler() else 0

    def on_epoch_begin(self, epoch, logs=None):
        self._reopen_legacy()
        self._reapply()  # also here: a BackupAndRestore listed after this callback restores later
        self._state.loss_blocked = False

    def on_train_batch_end(self, batch, logs=None):
        state = self._state
        state.step += 1
        if state.gave_up is not None or state.step % self.check_every:
            return
        if self._scaler() is not None:  # a skipped step is the overflow signal
            overflows = self._read("overflow_count")
            event = overflows > (state.last_overflows or 0)
            state.last_overflows = overflows
            if state.calibrating_from is not None:
                floor, scale = self._floor_scale(), float(keras.ops.convert_to_numpy(self._scaler().dynamic_scale))
                if self._read("iterations") > state.calibrating_from or floor is None or scale <= floor:
                    state.calibrating_from = None  # a step applied, or the floor reached: skips count again
                else:
                    event = False  # the scaler still backs off
        else:
            # The logged loss is the epoch's running mean: once non-finite it stays so until the
            # epoch ends, so after a move it says nothing new before the next epoch.
            loss = (logs or {}).get("loss")
            event = not state.loss_blocked and loss is not None and not math.isfinite(float(loss))
        state.streak = state.streak + 1 if event else 0
        if state.streak >= self.patience * 2**state.misses:
            state.streak = 0
            self._locate_and_move()

    def on_epoch_end(self, epoch, logs=None):
        if self.underflow_threshold is None or self.gave_up is not None:
            return
        tree = model_graph.layer_tree(self.model)  # the one walk: the probe and the moves read it
        x, y = self._probe_xy()[0]
        report = find_overflow(self.model, x, y, tree=tree)
        for stats in report.underflowing(self.underflow_threshold):
            if self.gave_up is not None:
                break
            fraction = stats.gradients.underflow_fraction
            evidence = f"find_overflow: {stats.path} underflow fraction {fraction:.3f} at scale {report.loss_scale:g}"
            if not self._move(stats.path, f"{fraction:.0%} of its gradient elements underflow to zero or "
                              "subnormals", evidence, tree):
                logging.info("Float32Fallback: %r underflows but cannot move (%s)", stats.path, evidence)

    def _probe_xy(self) -> list[tuple]:
        return [(b[0], b[1] if len(b) > 1 else None) for b in self._probe]

    def _locate_and_move(self) -> None:
        tree = model_graph.layer_tree(self.model)  # the one walk: each probe and the move read it
        calibrating = None
        for x, y in self._probe_xy():
            report = find_overflow(self.model, x, y, tree=tree)
            floor = self._floor_scale()
            scaled_only = report.forward is None and report.backward is not None
            if scaled_only and floor is not None and floor < report.loss_scale:
                # Only the backward pass scales: where the scaler's own back-off ends it, the scaler's business.
                low = find_overflow(self.model, x, y, loss_scale=floor, tree=tree)
                if low.ok:
                    calibrating = calibrating or (report, floor)
                    continue
                report = low
            producer = report.forward or report.backward
            if producer is None:
                continue
            evidence = (f"find_overflow: {producer.phase} producer {producer.op_type} op {producer.op!r} "
                        f"in layer {producer.layer!r} at loss scale {report.loss_scale:g}")
            if not self._move(producer.layer, f"it produced the first non-finite value ({producer.phase} pass)",
                              evidence, tree):
                self._miss(f"the locator names {producer.layer!r}, which is already float32 or not a layer this "
                           f"model can move; evidence: {evidence}")
            return
        if calibrating is not None and self._scaler() is not None:
            report, floor = calibrating
            self._state.calibrating_from = self._read("iterations")
            logging.info("Float32Fallback: the loss scale is calibrating, not a layer: the probe's backward "
                         "overflow at scale %g (%s) is gone at the scaler's floor %g; skipped steps count again "
                         "after an applied step", report.loss_scale, report.backward.layer, floor)
            return
        self._miss(
            "overflows repeat but find_overflow reproduces none on the probe batches" +
            (" in the forward pass" if calibrating else "") + ": the probe may not contain the offending inputs, "
            "or the overflow is in the loss/optimizer; see LossScaleMonitor's diagnosis (lower the initial scale "
            "2x, check the input pipeline)"
        )

    def _move(self, path: str, reason: str, evidence: str, tree: model_graph.LayerTree) -> bool:
        """Moves `path` to float32; False (nothing done) when it is not a 16-bit layer of the model."""
        layers = model_policies.layers_by_path(self.model, tree=tree)
        layer = layers.get(path)
        wanted = {} if layer is None else model_policies.float32_policies(self.model, [path], tree=tree)
        if all(layers[p].dtype_policy.name == FLOAT32 for p in wanted):
            return False
        state = self._state
        if len(state.decisions) >= self.max_layers:
            self._give_up(f"{len(state.decisions)} layer(s) already moved to float32 (max_layers={self.max_layers}); "
                          f"next candidate {path!r}: {evidence}")
            return True
        model_policies.set_policies(self.model, wanted, tree=tree)
        self.model.make_train_function(force=True)
        state.loss_blocked, state.misses = True, 0
        state.decisions.append(FallbackDecision(path, state.step, reason, evidence))
        logging.warning("Float32Fallback: layer %r -> float32 after step %d: %s. Evidence: %s",
                        path, state.step, reason, evidence)
        return True

    def _miss(self, why: str) -> None:
        state = self._state
        state.misses += 1
        if state.misses >= self.locate_tries:
            self._give_up(f"{why} ({state.misses} locator runs in a row found no layer to move)")
            return
        logging.warning("Float32Fallback: no layer moved (miss %d; it stops at %d in a row): %s. The next locator "
                        "run waits for %d consecutive checks with an overflow", state.misses, self.locate_tries, why,
                        self.patience * 2**state.misses)

    def _give_up(self, why: str) -> None:
        self._state.gave_up = why
        logging.warning("Float32Fallback stops moving layers: %s", why)

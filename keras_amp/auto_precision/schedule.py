"""`ProgressivePrecision`: raise named layers to float32 at scheduled epochs or steps.

The source document's "progressive precision": train fast in 16 bits, then give the layers that
matter most float32 for the final stretch. Each change sets the layers' policies in place
(variables and optimizer state are untouched: mixed policies already keep float32 variables),
rebuilds the train function once, and is logged and kept in `changes`.

A change is due once training has reached its point (epoch >= scheduled, global step >=
scheduled), not only at that exact point, so a run resumed later, or a `fit()` that starts
past it, still applies it. The global step is read from the optimizer (checkpointed with it),
once per epoch. The changes applied are kept in the model's checkpoints (`model_policies.DecisionStore`)
and set again when training resumes, also for a change whose point the resumed run never reaches
again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Iterable, Mapping

import keras
from absl import logging

from keras_amp import model_graph, validation
from keras_amp.auto_precision import model_policies
from keras_amp.auto_precision.search import SearchResult

FLOAT32 = "float32"
UNITS = ("epoch", "step")


@dataclasses.dataclass(frozen=True)
class PrecisionChange:
    """One applied change: at which epoch/step (0-based), which layers went to float32."""

    unit: str
    at: int
    layers: tuple[str, ...]


class ProgressivePrecision(keras.callbacks.Callback):
    """Raises layers to float32 at scheduled points of training.

    A change applies before the first epoch (or step) at or past its key; with
    `steps_per_execution=k`, before the k steps that reach it. Every name is checked against the
    model when training begins. The global step is
    the number of training steps the optimizer has run across every `fit()`: keras_amp's
    LossScaleOptimizer's `total_steps` (skipped steps included), else `iterations` (a stock
    LossScaleOptimizer leaves skipped steps out). Applied changes are saved with the model's
    weights (`save_weights`, `.keras`, `BackupAndRestore`, `ModelCheckpoint`) and set again at
    `on_train_begin`/`on_epoch_begin` after a restore (`load_weights`, or a model from
    `keras.saving.load_model`), each callback's under its unit and schedule (callbacks listed in
    another order get their own).

    Args:
        schedule: Mapping of int (0-based epoch or global step at which the change applies,
            before that epoch/step runs) to an iterable of layer-path regexes (matched in full
            against each layer's path or name).
        unit: String. "epoch" (default) or "step" (global training steps across `fit()` calls).

    Example:
        >>> result = keras_amp.search_precision(model, ds)
        >>> schedule = ProgressivePrecision.from_search(result, at=8)  # its float32 layers from epoch 8
        >>> model.fit(ds, epochs=10, callbacks=[schedule])
    """

    def __init__(self, schedule: Mapping[int, Iterable[str]], *, unit: str = "epoch"):
        super().__init__()
        self.unit = validation.check_choice("unit", unit, UNITS)
        validation.check_type("schedule", schedule, Mapping, "a mapping of int -> iterable of layer-path regexes")
        if not schedule:
            raise ValueError("`schedule` must name at least one change. Received: schedule={}")
        self.schedule: dict[int, tuple[re.Pattern, ...]] = {}
        for at, paths in schedule.items():
            at = validation.check_int("schedule key", at, min_value=0)
            if isinstance(paths, str) or not isinstance(paths, Iterable):
                why = " (a list, not one string)" if isinstance(paths, str) else ""
                raise TypeError(
                    f"Each `schedule` value must be an iterable of layer-path regexes{why}. "
                    f"Received: schedule[{at}]={paths!r}"
                )
            patterns = []
            for p in paths:
                validation.check_type(f"schedule[{at}] entry", p, str, "a layer-path regex string")
                try:
                    patterns.append(re.compile(p))
                except re.error as e:
                    raise ValueError(f"`schedule[{at}]` entry is not a valid regex ({e}). Received: {p!r}") from e
            if not patterns:
                raise ValueError(f"`schedule[{at}]` must name at least one layer. Received: schedule[{at}]={paths!r}")
            self.schedule[at] = tuple(patterns)
        self.changes: list[PrecisionChange] = []
        self._applied: set[int] = set()
        self._epoch_start_step = 0
        self._steps_per_call = 1

    @classmethod
    def from_search(cls, result: SearchResult, *, at: int, top: int | None = None,
                    unit: str = "epoch") -> "ProgressivePrecision":
        """Raises the layers the search keeps in float32 at `at`, after training them in 16 bits until then.

        Only the search's float32 layers (`result.float32_layers`), most sensitive first; `top`
        (Int or None, default None: all of them) takes the first `top`. Apply the schedule to the
        model as the search measured it, not after `result.apply(model)` (then they are float32
        from the start). A search that kept no layer in float32 leaves nothing to raise: a
        ValueError says so.
        """
        validation.check_type("result", result, SearchResult, "a keras_amp SearchResult")
        at = validation.check_int("at", at, min_value=0)
        if top is not None:
            top = validation.check_int("top", top, min_value=1)
        # result.layers is in the search's order: worst first (loss, then gradient, then output error).
        # The chosen layers only: a layer float32 with a chosen block above it comes with the block.
        chosen = set(result.float32_layers)
        kept = [d.path for d in result.layers if d.path in chosen]
        if not kept:
            raise ValueError(
                f"`result` keeps no layer in float32 (every one of its {len(result.layers)} candidates is within "
                f"tolerance={result.tolerance:g} in 16 bits): nothing to raise. Received: result.float32_layers=(). "
                "Allowed: a result with float32 layers, or name the layers: ProgressivePrecision({at: [...]})")
        return cls({at: [re.escape(p) for p in kept[:top]]}, unit=unit)

    def set_model(self, model):
        super().set_model(model)
        model_policies.decision_store(model).register(self, self._key())

    def _key(self) -> str:
        """The checkpoint's name for this callback's state: its unit and schedule, so that a restart
        with the callbacks in another order gives each its own state."""
        schedule = sorted((at, [r.pattern for r in patterns]) for at, patterns in self.schedule.items())
        digest = hashlib.sha1(json.dumps([self.unit, schedule]).encode("utf-8")).hexdigest()[:12]
        return f"ProgressivePrecision_{self.unit}_{digest}"

    def checkpoint_state(self) -> dict:
        """The applied changes, for the model's checkpoint."""
        return {"unit": self.unit, "applied": sorted(self._applied),
                "changes": [[c.unit, c.at, list(c.layers)] for c in self.changes]}

    def restore_state(self, state: dict) -> None:
        """Takes the applied changes from a checkpoint; the hooks set their policies again."""
        applied = {int(at) for at in state["applied"]}
        if state.get("unit") != self.unit or not applied <= set(self.schedule):
            logging.warning("ProgressivePrecision: the checkpoint's state %s is another schedule's (unit %r, "
                            "points %s): not restored", state, self.unit, sorted(self.schedule))
            return
        self._applied = applied
        self.changes = [PrecisionChange(u, int(at), tuple(layers)) for u, at, layers in state["changes"]]

    def _hits(self, at: int, layers: dict) -> list[str]:
        patterns = self.schedule[at]
        missing = [r.pattern for r in patterns if not any(r.fullmatch(p) or r.fullmatch(layers[p].name) for p in layers)]
        if missing:
            raise ValueError(
                f"ProgressivePrecision: schedule[{at}] names no layer of model {self.model.name!r}: {missing}. "
                f"Layer paths: {list(layers)[:8]}{' ...' if len(layers) > 8 else ''}"
            )
        return [p for p, l in layers.items() if any(r.fullmatch(p) or r.fullmatch(l.name) for r in patterns)]

    def _reapply(self, tree: model_graph.LayerTree | None = None) -> None:
        """Sets the policies of changes applied before a restart again (a rebuilt model lost them)."""
        if not self._applied:
            return
        tree = model_graph.layer_tree(self.model, tree)  # the one walk of this call
        layers = model_policies.layers_by_path(self.model, tree=tree)
        paths = [p for at in sorted(self._applied) for p in self._hits(at, layers)]
        changed = model_policies.reapply_float32(self.model, paths, tree=tree)
        if changed:
            logging.info("ProgressivePrecision: restored %s -> float32 (applied before the restart)", ", ".join(changed))

    def _apply_due(self, now: int) -> None:
        due = [at for at in sorted(self.schedule) if at <= now and at not in self._applied]
        if not due:
            return
        tree = model_graph.layer_tree(self.model)  # the one walk of this call
        layers = model_policies.layers_by_path(self.model, tree=tree)
        # With the Matmul16DTypePolicy recurrence a named layer sits in or contains (its matmuls).
        wanted = {at: model_policies.float32_policies(self.model, self._hits(at, layers), tree=tree) for at in due}
        todo: dict[str, str] = {}
        for at in due:
            changed = tuple(p for p in wanted[at] if layers[p].dtype_policy.name != FLOAT32 and p not in todo)
            todo.update({p: FLOAT32 for p in changed})
            self._applied.add(at)
            if changed:
                self.changes.append(PrecisionChange(self.unit, at, changed))
                logging.info("ProgressivePrecision: %s %d (now %d): %s -> float32", self.unit, at, now, ", ".join(changed))
        if todo:
            model_policies.set_policies(self.model, todo, tree=tree)
            self.model.make_train_function(force=True)  # one retrace for every change due now

    def on_train_begin(self, logs=None):
        self._steps_per_call = max(int(getattr(self.model, "steps_per_execution", 1) or 1), 1)  # read once a fit
        tree = model_graph.layer_tree(self.model)  # the one walk of this call
        layers = model_policies.layers_by_path(self.model, tree=tree)
        for at in self.schedule:
            self._hits(at, layers)  # a name that matches no layer fails now, not when training reaches it
        self._reapply(tree)

    def on_epoch_begin(self, epoch, logs=None):
        self._reapply()  # also here: a BackupAndRestore listed after this callback restores later
        if self.unit == "epoch":
            self._apply_due(epoch)
        else:
            self._epoch_start_step = model_policies.global_step(self.model.optimizer)  # one read per epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.unit == "step":
            # With steps_per_execution=k the hook runs once per k steps: a change due inside the k
            # steps about to run applies before them (up to k - 1 steps early), not after or never.
            self._apply_due(self._epoch_start_step + batch + self._steps_per_call - 1)

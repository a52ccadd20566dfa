"""`ProgressivePrecision`: raise named layers to float32 at scheduled epochs or steps.

The source document's "progressive precision": train fast in 16 bits, then give the layers that
matter most float32 for the final stretch. Each change sets the layers' policies in place
(variables and optimizer state are untouched: mixed policies already keep float32 variables),
rebuilds the train function once, and is logged and kept in `changes`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Mapping

import keras
from absl import logging

from keras_amp import validation
from keras_amp.auto_precision import _policies
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

    Args:
        schedule: Mapping of int (0-based epoch or global step at which the change applies,
            before that epoch/step runs) to an iterable of layer-path regexes (matched in full
            against each layer's path or name).
        unit: String. "epoch" (default) or "step" (global training steps across epochs).

    Example:
        >>> result = keras_amp.search_precision(model, ds)
        >>> schedule = ProgressivePrecision.from_search(result, at=8, top=2)
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
                raise TypeError(
                    "Each `schedule` value must be an iterable of layer-path regexes (a list, not one "
                    f"string). Received: schedule[{at}]={paths!r}"
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
        self._step = 0

    @classmethod
    def from_search(cls, result: SearchResult, *, at: int, top: int = 1, unit: str = "epoch") -> "ProgressivePrecision":
        """Raises the `top` most sensitive layers the search left in 16 bits to float32 at `at`."""
        validation.check_type("result", result, SearchResult, "a keras_amp SearchResult")
        top = validation.check_int("top", top, min_value=1)
        left = [d for d in sorted(result.layers, key=lambda d: d.sensitivity.loss, reverse=True) if d.decision != FLOAT32]
        if not left:
            raise ValueError("The search already keeps every candidate layer in float32: nothing to raise.")
        return cls({at: [re.escape(d.path) for d in left[:top]]}, unit=unit)

    def _apply(self, at: int) -> None:
        patterns = self.schedule.get(at)
        if patterns is None:
            return
        layers = _policies.layers_by_path(self.model)
        hits = [p for p, l in layers.items() if any(r.fullmatch(p) or r.fullmatch(l.name) for r in patterns)]
        missing = [r.pattern for r in patterns if not any(r.fullmatch(p) or r.fullmatch(layers[p].name) for p in layers)]
        if missing:
            raise ValueError(
                f"ProgressivePrecision: schedule[{at}] names no layer of model {self.model.name!r}: {missing}. "
                f"Layer paths: {list(layers)[:8]}..."
            )
        # With the Matmul16DTypePolicy recurrence a named layer sits in or contains (its matmuls).
        wanted = _policies.float32_policies(self.model, hits)
        changed = tuple(p for p in wanted if layers[p].dtype_policy.name != FLOAT32)
        if not changed:
            return
        _policies.set_policies(self.model, {p: FLOAT32 for p in changed})
        self.model.make_train_function(force=True)
        self.changes.append(PrecisionChange(self.unit, at, changed))
        logging.info("ProgressivePrecision: %s %d: %s -> float32", self.unit, at, ", ".join(changed))

    def on_train_begin(self, logs=None):
        self._step = 0

    def on_epoch_begin(self, epoch, logs=None):
        if self.unit == "epoch":
            self._apply(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.unit == "step":
            self._apply(self._step)

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1

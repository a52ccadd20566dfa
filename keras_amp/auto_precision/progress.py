"""`search_precision`'s progress, shown as `fit` shows it: 0 silent, 1 a `keras.utils.Progbar`, 2 a line per pass."""

from __future__ import annotations

from typing import Any

import keras


class Progress:
    """Counts the search's forward/backward passes against a target that grows as the search learns it.

    Args:
        verbose: Int. 0, 1 or 2 (`search_precision` has checked it).
        candidates: Int. Candidate layers: the known passes are 2 + candidates.
        left_out: Int. 16-bit layers that are no candidates (said in the header line).
        batches: Int. Batches per pass (said in the header line).
    """

    def __init__(self, verbose: int, candidates: int, left_out: int, batches: int):
        self.verbose, self.passes, self.target = verbose, 0, 2 + candidates
        if verbose:
            print(f"search_precision: {candidates} candidate layer(s) ({left_out} without weights or floating-point "
                  f"work of their own left out); 2 + {candidates} passes to measure, then a prefix search and "
                  f"pruning if the model as it is misses the tolerance; {batches} batch(es) per pass", flush=True)
        self.bar = keras.utils.Progbar(self.target, unit_name="pass", stateful_metrics=["loss_error"]) if verbose == 1 else None

    def expect(self, more: int) -> None:
        self.expect_total(self.target + more)

    def expect_total(self, total: int) -> None:
        self.target = max(total, self.passes)
        if self.bar is not None:
            self.bar.target = self.target

    def step(self, what: str, errors: Any) -> None:
        self.passes += 1
        self.expect_total(self.target)
        values = [] if errors is None else [("loss_error", errors.loss)]
        if self.bar is not None:
            self.bar.update(self.passes, values=values, finalize=False)  # done() ends the bar
        elif self.verbose == 2:
            figures = "" if errors is None else (f": loss error {errors.loss:.3g}, gradient error "
                                                 f"{errors.gradient:.3g}, output error {errors.output:.3g}")
            print(f"search_precision: pass {self.passes}/{self.target}, {what}{figures}", flush=True)

    def done(self) -> None:
        self.expect_total(self.passes)
        if self.bar is not None:
            self.bar.update(self.passes, finalize=True)

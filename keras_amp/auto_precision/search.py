"""`search_precision()`: the smallest set of float32 layers that keeps a model within tolerance of float32.

Estimator ("demote one, then promote greedily"), on `batches` batches, inference mode:

    ref      = loss, outputs, gradients with every layer float32
    for each candidate layer L (a layer computing in 16 bits now):
        sens[L] = errors of the model with every layer float32 except L and the layers below it
                  (L alone in 16 bits)
    order    = candidates by sens (loss error, then gradient error, then output error), worst first,
               each after the candidates below it
    if the model as it is passes:          keep nothing in float32
    else: k  = the smallest prefix of `order` kept in float32 that passes (binary search)
          prune: drop each chosen layer, least sensitive first, if the model still passes
    passes(config) = loss and gradients finite, relative loss error <= tolerance and, when
                     given, relative gradient error <= gradient_tolerance

Candidates: the layers computing in 16 bits that cost something themselves, weights or
floating-point work of their own in one traced forward pass (`layer_cost`): Dropout at inference
and Activation("relu") compute nothing a float32 policy could change, and are left out. An RNN layer
and its cell are one candidate, the RNN (`model_policies.decision_unit`): the RNN casts the cell's input,
and a `.keras` file keeps only the RNN's policy. A layer calling others (a transformer block) is a
candidate for its own work (keras-hub's `x + residual`), and its decision moves every layer below it
(`model_policies.unit_members`), as `result.apply` and `apply_recipe` do: a raw TensorFlow op takes one
dtype, so the block in 16 bits with float32 layers inside it does not run. Layers inside it are
candidates of their own and come first in `order`: the block joins the prefix after them. A
configuration that still does not run (such a layer's result meeting its block's in a raw op) is not
viable: its errors are inf, the layer's reason says why, and with no evidence of its sensitivity it
comes last in `order`.

Forward/backward passes per batch: 1 (float32 reference) + 1 (as is) + N (one per candidate)
+ ceil(log2(N + 1)) (prefix search) + k (pruning), N candidates and k chosen layers. Demoting one
layer at a time measures each layer's own error without the others' noise; the prefix search then
accounts for interactions. The model's own policies are restored before returning: apply the
result with `keras_amp.apply_recipe(model, recipe, rules=result.rules)` or `result.apply(model)`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Iterable

import keras
import tensorflow as tf

from keras_amp import model_graph, validation
from keras_amp.dtypes import LOW_PRECISION as LOW
from keras_amp.auto_precision import measure, model_policies, layer_cost
from keras_amp.auto_precision.measure import Errors
from keras_amp.auto_precision.progress import Progress
from keras_amp.diagnostics import user_site

FLOAT32 = "float32"


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    """One candidate layer's sensitivity, cost share and decision.

    Args:
        path: String. The layer's path.
        layer_class: String. Its class name.
        sensitivity: `Errors` of the model with this layer (and the layers below it) alone in 16
            bits; inf where that does not run (the reason says so).
        cost_share: Float. Its share of the candidates' floating-point operations in one traced
            forward pass (multiply-adds for matmuls and convolutions; `layer_cost`), its own work:
            a layer calling candidates counts without them.
        decision: String. "float32" (chosen, or below a chosen layer) or the compute policy it keeps.
        reason: String. Why.
    """

    path: str
    layer_class: str
    sensitivity: Errors
    cost_share: float
    decision: str
    reason: str


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The outcome of `search_precision`.

    `rules` maps an exact-path regex to "float32" for every chosen layer: the form
    `apply_recipe(..., rules=...)` takes. `left_out` are the 16-bit layers that were no candidates:
    no weights and no floating-point work of their own.
    """

    rules: dict[str, str]
    float32_layers: tuple[str, ...]
    layers: tuple[LayerDecision, ...]
    errors_as_is: Errors
    errors_final: Errors
    tolerance: float
    passes_per_batch: int
    batches: int
    seconds: float
    left_out: tuple[str, ...] = ()

    def apply(self, model: keras.Model) -> keras.Model:
        """Sets the chosen layers of `model` to float32 in place; returns `model`."""
        tree = model_graph.layer_tree(model)
        model_policies.set_policies(model, model_policies.float32_policies(model, self.float32_layers, tree=tree),
                                    tree=tree)
        return model

    def __str__(self) -> str:
        lines = [
            f"search_precision: {len(self.float32_layers)} float32 layer(s) of {len(self.layers)} candidates "
            f"({len(self.left_out)} layer(s) without weights or floating-point work of their own left out), "
            f"{self.passes_per_batch} forward/backward passes x {self.batches} batch(es) in {self.seconds:.1f} s",
            f"  as is: loss error {self.errors_as_is.loss:.3g}, gradient error {self.errors_as_is.gradient:.3g}; "
            f"chosen: loss error {self.errors_final.loss:.3g}, gradient error {self.errors_final.gradient:.3g} "
            f"(tolerance {self.tolerance:g})",
        ]
        path = max([32, *(len(d.path) for d in self.layers)])  # columns as wide as the longest path
        cls = max([20, *(len(d.layer_class) for d in self.layers)])
        for d in self.layers:
            s = d.sensitivity
            lines.append(
                f"  {d.path:<{path}} {d.layer_class:<{cls}} loss {s.loss:9.3g} grad {s.gradient:9.3g} "
                f"out {s.output:9.3g} cost {d.cost_share:6.1%}  {d.decision:<15} {d.reason}"
            )
        return "\n".join(lines)


def _matches(path: str, patterns: Iterable[re.Pattern]) -> bool:
    return any(p.fullmatch(path) for p in patterns)


def _order(by_severity: list[str], members: dict[str, list[str]]) -> list[str]:
    """`by_severity`, each layer moved after the candidates below it: float32, it takes them along, so
    the prefix search tries the layers inside it first."""
    below = {p: {q for q in by_severity if q != p} & set(members[p]) for p in by_severity}
    out: list[str] = []
    placed: set[str] = set()
    waiting = list(by_severity)
    while waiting:
        ready = next(p for p in waiting if below[p] <= placed)  # the most severe whose layers are placed
        waiting.remove(ready)
        out.append(ready)
        placed.add(ready)
    return out


def _outermost(units: list[str], members: dict[str, list[str]]) -> list[str]:
    """`units` less those below another of them (float32 with it)."""
    return [u for u in units if not any(o != u and u in members[o] for o in units)]


def _check_something_to_search(model, sixteen, patterns, candidates, policy) -> None:
    if not sixteen:
        raise ValueError(
            f"search_precision needs layers computing in 16 bits: every layer of model {model.name!r} computes in "
            f"float32 (its dtype policy: {model.dtype_policy.name!r}), so there is nothing to search. Build it after "
            "`keras_amp.enable()`, convert it with `keras_amp.apply_recipe`, or pass `policy=` to measure it under "
            f"one. Received: model={model.name!r}, policy={policy!r}")
    if patterns is not None and not any(_matches(p, patterns) for p in sixteen):
        raise ValueError(
            f"`candidates` must match layers computing in 16 bits. Received: candidates={list(candidates)!r}, "
            f"matching only float32 layers. Allowed: regexes over the 16-bit layers, e.g. {sixteen[:5]}")


def search_precision(
    model: keras.Model,
    data: Any,
    *,
    policy: str | None = None,
    budget: int | None = None,
    tolerance: float = 0.01,
    gradient_tolerance: float | None = None,
    batches: int = 2,
    loss: Any = None,
    candidates: Iterable[str] | None = None,
    verbose: int | str = "auto",
) -> SearchResult:
    """Finds the smallest set of layers to keep in float32 (see the module docstring for the rule).

    Args:
        model: A built `keras.Model` (any kind), with its mixed policies set (after
            `keras_amp.enable()` and, optionally, a recipe).
        data: A `tf.data.Dataset` of (x, y[, sample_weight]) batches, one such tuple, or a list
            of them. Sample weights weigh the loss as `fit` does (`measure`).
        policy: String or None. A 16-bit policy to measure ("mixed_float16",
            "mixed_bfloat16"): every layer computing in 16 bits is set to it first; in a model
            computing wholly in float32 (built without `keras_amp.enable()`), every float32 layer.
            None: the model's own, which must have layers computing in 16 bits (else a ValueError).
        budget: Int or None. The most layers to keep in float32; None: no cap. When the cap
            is reached before the tolerance is met, the result says so in its reasons.
        tolerance: Float. Largest relative loss error against the all-float32 model.
        gradient_tolerance: Float or None. Largest relative gradient error; None: only finiteness.
        batches: Int. How many batches of `data` to measure on.
        loss: A loss (name, `keras.losses.Loss` or callable(y_true, y_pred)) or None for the
            model's compiled loss.
        candidates: Iterable of path regexes or None: the layers that may change (default:
            every layer computing in 16 bits that has weights or floating-point work of its own).
        verbose: "auto" (default, 1), 0, 1 or 2, as in `fit`. 0: silent; 1: a progress bar over
            the forward/backward passes; 2: one line per pass, naming what it measured.

    Returns:
        A `SearchResult`; the model's policies are as they were.
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    if not model.built:
        raise ValueError(f"`model` must be built. Received: model={model.name!r}, built=False")
    if policy is not None:
        validation.check_choice("policy", policy, ("mixed_float16", "mixed_bfloat16"))
    if budget is not None:
        budget = validation.check_int("budget", budget, min_value=0)
    tolerance = validation.check_float("tolerance", tolerance, min_value=0.0)
    if gradient_tolerance is not None:
        gradient_tolerance = validation.check_float("gradient_tolerance", gradient_tolerance, min_value=0.0)
    batches = validation.check_int("batches", batches, min_value=1)
    if isinstance(verbose, str) and verbose == "auto":
        verbose = 1
    elif isinstance(verbose, bool) or not isinstance(verbose, int):
        raise TypeError(f'`verbose` must be "auto", 0, 1 or 2, as in `fit`. Received: verbose={verbose!r} '
                        f"of type {type(verbose).__name__}")
    elif verbose not in (0, 1, 2):
        raise ValueError(f'`verbose` must be "auto", 0, 1 or 2, as in `fit`. Received: verbose={verbose!r}')
    patterns = None
    if candidates is not None:
        patterns = validation.check_regexes("candidates", candidates, model_policies.layers_by_path(model))
    data_batches = measure.batches_of(data, batches)
    loss_fn = measure.loss_of(model, loss)
    start = time.perf_counter()

    tree = model_graph.layer_tree(model)  # one walk: the search changes policies, never layers
    layers = model_policies.layers_by_path(model, tree=tree)
    with model_policies.temporary_policies(model, tree=tree):
        if policy is not None:
            sixteen_now = [p for p, l in layers.items() if l.compute_dtype in LOW]
            # A model built without keras_amp.enable(): measured as if built under `policy`.
            to_policy = sixteen_now or [p for p, l in layers.items() if l.compute_dtype == FLOAT32]
            model_policies.set_policies(model, {p: policy for p in to_policy}, tree=tree)
        current = model_policies.policy_names(model, tree=tree)
        sixteen = [p for p, l in layers.items() if l.compute_dtype in LOW]
        _check_something_to_search(model, sixteen, patterns, candidates, policy)
        sixteen = [p for p in sixteen if patterns is None or _matches(p, patterns)]
        model_policies.set_policies(model, {p: FLOAT32 for p in current}, tree=tree)
        ref = measure.reference(model, data_batches, loss_fn)  # first: its errors on the input name `data`
        model_policies.set_policies(model, current, tree=tree)
        x = keras.utils.unpack_x_y_sample_weight(data_batches[0])[0]
        flops = layer_cost.layer_flops(model, x, tree=tree)
        # A layer's decision moves every layer below it (`model_policies.unit_members`); an RNN's cell is
        # decided with its RNN (`model_policies.decision_unit`), whose own work it is.
        units = list(dict.fromkeys(model_policies.decision_unit(layers, p) for p in sixteen))
        members = {u: model_policies.unit_members(layers, u) for u in units}
        own = {u: model_policies.own_members(layers, u) for u in units}
        flops = {u: sum(flops.get(m, 0) for m in own[u]) for u in units}
        pool = [u for u in units if any(layer_cost.costs_something(layers[m], flops[u]) for m in own[u])]
        left_out = tuple(u for u in units if u not in pool)
        progress = Progress(verbose, len(pool), len(left_out), len(data_batches))
        failed: dict[str, str] = {}

        def measured(float32_paths: set, what: str, *, must_run: bool = False) -> Errors:
            model_policies.set_policies(model, {p: (FLOAT32 if p in float32_paths else current[p]) for p in current},
                                        tree=tree)
            try:
                errors = measure.errors(measure.run(model, data_batches, loss_fn), ref)
            except (tf.errors.InvalidArgumentError, TypeError, ValueError) as e:
                if must_run:
                    raise
                # A layer mixing float32 and 16-bit results in a raw op (ran as it is and all float32).
                errors, failed[what] = measure.NOT_VIABLE, user_site.one_line(e)
            progress.step(what, errors)
            return errors

        def with_float32(float32_units: Iterable[str], what: str) -> Errors:
            return measured(set(model_policies.float32_policies(model, float32_units, tree=tree)), what)

        def ok(errors: Errors) -> bool:
            return errors.finite and errors.loss <= tolerance and (
                gradient_tolerance is None or errors.gradient <= gradient_tolerance)

        progress.step("every layer float32 (the reference)", None)
        passes = 1
        as_is = measured(set(), "the model as it is", must_run=True)
        passes += 1
        sens, alone = {}, {}
        for path in pool:
            alone[path] = f"{path} alone in 16 bits"
            sens[path] = measured(set(current) - set(members[path]), alone[path])
            passes += 1

        def severity(p):  # a layer that does not run alone in 16 bits: no evidence, last
            s = sens[p]
            values = (s.loss, s.gradient, s.output)
            return (alone[p] not in failed, *(v if math.isfinite(v) else math.inf for v in values))

        order = _order(sorted(pool, key=severity, reverse=True), members)
        cap = len(order) if budget is None else min(budget, len(order))
        chosen: list[str] = []
        final = as_is
        capped = False
        if not ok(as_is):
            progress.expect(math.ceil(math.log2(cap + 1)))  # at most; pruning is added once known
            lo, hi, best = 1, cap, None
            while lo <= hi:  # smallest passing prefix, assuming more float32 never hurts
                mid = (lo + hi) // 2
                errors = with_float32(order[:mid], f"the {mid} most sensitive float32")
                passes += 1
                if ok(errors):
                    best, final, hi = mid, errors, mid - 1
                else:
                    lo = mid + 1
            if best is None:
                capped = True
                chosen = _outermost(order[:cap], members)
                progress.expect_total(passes + 1)
                final = with_float32(chosen, f"the {cap} most sensitive float32 (the budget)")
                passes += 1
            else:
                chosen = _outermost(order[:best], members)  # the rest are float32 with a layer above them
                progress.expect_total(passes + len(chosen) - 1)
                for path in reversed(list(chosen)):  # prune the least sensitive first
                    if len(chosen) == 1:
                        break
                    trial = [p for p in chosen if p != path]
                    errors = with_float32(trial, f"without {path} in float32 (pruning)")
                    passes += 1
                    if ok(errors):
                        chosen, final = trial, errors

    progress.done()
    sizes = {p: flops.get(p, 0) for p in pool}
    total = sum(sizes.values()) or 1
    decisions = []
    budget_short = capped and cap < len(order)  # else: every candidate float32, and still not met
    for path in order:
        above = next((c for c in chosen if c != path and path in members[c]), None)
        if path in chosen:
            reason = "kept float32: needed to meet the tolerance" if not capped else (
                f"kept float32 (one of the budget={budget} most sensitive); the tolerance is not met" if budget_short
                else "kept float32; the tolerance is not met even with every candidate in float32")
            decision = FLOAT32
        elif above is not None:
            reason, decision = f"float32 with {above}, a layer above it kept float32 with every layer below it", FLOAT32
        else:
            reason = ("16-bit is within tolerance together with the float32 layers" if not capped else
                      f"16-bit: past budget={budget}; the tolerance is not met")
            decision = current[path]
        if alone[path] in failed:
            reason += f"; alone in 16 bits (the layers around it float32) it does not run: {failed[alone[path]]}"
        decisions.append(LayerDecision(path, type(layers[path]).__name__, sens[path], sizes[path] / total, decision,
                                       reason))
    chosen_in_order = tuple(p for p in layers if p in chosen)
    return SearchResult(
        rules={re.escape(p): FLOAT32 for p in chosen_in_order},
        float32_layers=chosen_in_order,
        layers=tuple(decisions),
        errors_as_is=as_is,
        errors_final=final,
        tolerance=tolerance,
        passes_per_batch=passes,
        batches=len(data_batches),
        seconds=time.perf_counter() - start,
        left_out=left_out,
    )

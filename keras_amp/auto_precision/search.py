"""`search_precision()`: the smallest set of float32 layers that keeps a model within tolerance of float32.

Estimator ("demote one, then promote greedily"), on `batches` batches, inference mode:

    ref      = loss, outputs, gradients with every layer float32
    for each candidate layer L (a layer computing in 16 bits now):
        sens[L] = errors of the model with every layer float32 except L (L alone in 16 bits)
    order    = candidates by sens (loss error, then gradient error, then output error), worst first
    if the model as it is passes:          keep nothing in float32
    else: k  = the smallest prefix of `order` kept in float32 that passes (binary search)
          prune: drop each chosen layer, least sensitive first, if the model still passes
    passes(config) = loss and gradients finite, relative loss error <= tolerance and, when
                     given, relative gradient error <= gradient_tolerance

Candidates: the layers computing in 16 bits that cost something themselves, weights or
floating-point work of their own in one traced forward pass (`layer_cost`): Dropout at inference
and Activation("relu") compute nothing a float32 policy could change, and are left out. An RNN layer
and its cell are one candidate, the RNN (`model_policies.decision_unit`): the RNN casts the cell's input,
and a `.keras` file keeps only the RNN's policy.

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
from typing import Any, Callable, Iterable

import keras
import numpy as np
import tensorflow as tf

from keras_amp import model_graph, validation
from keras_amp.dtypes import LOW_PRECISION as LOW
from keras_amp.auto_precision import model_policies, layer_cost
from keras_amp.auto_precision.progress import Progress

FLOAT32 = "float32"


@dataclasses.dataclass(frozen=True)
class Errors:
    """Relative errors against the all-float32 model (inf when non-finite)."""

    loss: float
    output: float
    gradient: float

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in (self.loss, self.output, self.gradient))


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    """One candidate layer's sensitivity, cost share and decision.

    Args:
        path: String. The layer's path.
        layer_class: String. Its class name.
        sensitivity: `Errors` of the model with this layer alone in 16 bits.
        cost_share: Float. Its share of the candidates' floating-point operations in one traced
            forward pass (multiply-adds for matmuls and convolutions; `layer_cost`).
        decision: String. "float32" or the compute policy it keeps.
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
        for d in self.layers:
            s = d.sensitivity
            lines.append(
                f"  {d.path:<32} {d.layer_class:<20} loss {s.loss:9.3g} grad {s.gradient:9.3g} "
                f"out {s.output:9.3g} cost {d.cost_share:6.1%}  {d.decision:<15} {d.reason}"
            )
        return "\n".join(lines)


def _batches(data: Any, batches: int) -> list[tuple]:
    if isinstance(data, tf.data.Dataset):
        out = [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in data.take(batches)]
    elif isinstance(data, (tuple, list)) and data and isinstance(data[0], (tuple, list)):
        out = [tuple(b) for b in list(data)[:batches]]  # a list of (x, y) batches
    elif isinstance(data, (tuple, list)) and 2 <= len(data) <= 3:
        out = [tuple(data)]  # one (x, y[, sample_weight]) batch
    else:
        raise TypeError(
            "`data` must be a tf.data.Dataset of (x, y) batches, one (x, y) tuple, or a list of them. "
            f"Received: data of type {type(data).__name__}"
        )
    if not out:
        raise ValueError("`data` must yield at least one batch. Received: an empty `data`")
    if len(out[0]) < 2:
        raise ValueError("`data` must yield (x, y) batches: the loss needs the targets. Received: batches of x alone")
    return out


def _loss_fn(model: keras.Model, loss: Any) -> Callable:
    chosen = loss if loss is not None else getattr(model, "loss", None)
    if chosen is None:
        raise ValueError(
            "search_precision needs a loss: compile the model with one `loss`, or pass `loss=`. "
            f"Received: loss=None and model {model.name!r} has no compiled loss"
        )
    if isinstance(chosen, (dict, list, tuple)):
        raise TypeError(
            "search_precision takes one loss for the whole output. Received: loss of type "
            f"{type(chosen).__name__}; pass `loss=` a single loss or callable(y_true, y_pred)"
        )
    fn = keras.losses.get(chosen) if isinstance(chosen, str) else chosen
    validation.check_callable("loss", fn)
    return fn


def _run(model, batches, loss_fn) -> list[tuple[float, list[np.ndarray], list[np.ndarray]]]:
    """Loss, outputs and gradients per batch, eagerly (so current policies apply), inference mode."""
    results = []
    variables = model.trainable_variables
    for batch in batches:
        x, y, w = keras.utils.unpack_x_y_sample_weight(batch)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=False)
            y_pred32 = keras.tree.map_structure(lambda t: keras.ops.cast(t, "float32"), y_pred)
            value = loss_fn(y, y_pred32) if w is None else loss_fn(y, y_pred32, w)
            value = keras.ops.mean(keras.ops.cast(value, "float32"))
        grads = tape.gradient(value, variables)
        grads = [np.zeros(v.shape, np.float32) if g is None else keras.ops.convert_to_numpy(keras.ops.cast(g, "float32"))
                 for g, v in zip(grads, variables)]
        outs = [keras.ops.convert_to_numpy(t).astype(np.float64) for t in keras.tree.flatten(y_pred32)]
        results.append((float(value), outs, grads))
    return results


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    if not np.all(np.isfinite(a)):
        return math.inf
    denom = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / (denom if denom > 0 else 1.0)


def _errors(run, ref) -> Errors:
    loss = output = gradient = 0.0
    for (l, outs, grads), (rl, routs, rgrads) in zip(run, ref):
        loss = max(loss, abs(l - rl) / max(abs(rl), 1e-12) if math.isfinite(l) else math.inf)
        output = max(output, _relative(np.concatenate([o.ravel() for o in outs]),
                                       np.concatenate([o.ravel() for o in routs])))
        g = np.concatenate([x.ravel().astype(np.float64) for x in grads]) if grads else np.zeros(1)
        rg = np.concatenate([x.ravel().astype(np.float64) for x in rgrads]) if rgrads else np.zeros(1)
        gradient = max(gradient, _relative(g, rg))
    return Errors(loss=loss, output=output, gradient=gradient)


def _matches(path: str, patterns: Iterable[re.Pattern]) -> bool:
    return any(p.fullmatch(path) for p in patterns)


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
        data: A `tf.data.Dataset` of (x, y) batches, one (x, y) tuple, or a list of them.
        policy: String or None. A 16-bit policy to measure ("mixed_float16",
            "mixed_bfloat16"): every candidate layer is set to it first. None: the model's own.
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
    data_batches = _batches(data, batches)
    loss_fn = _loss_fn(model, loss)
    start = time.perf_counter()

    tree = model_graph.layer_tree(model)  # one walk: the search changes policies, never layers
    layers = model_policies.layers_by_path(model, tree=tree)
    with model_policies.temporary_policies(model, tree=tree):
        if policy is not None:
            to_policy = {p: policy for p, l in layers.items() if l.compute_dtype in LOW}
            model_policies.set_policies(model, to_policy, tree=tree)
        current = model_policies.policy_names(model, tree=tree)
        x = keras.utils.unpack_x_y_sample_weight(data_batches[0])[0]
        flops = layer_cost.layer_flops(model, x, tree=tree)
        sixteen = [p for p, l in layers.items() if l.compute_dtype in LOW and (patterns is None or _matches(p, patterns))]
        # An RNN's cell is decided with its RNN (`model_policies.decision_unit`): one candidate.
        units = list(dict.fromkeys(model_policies.decision_unit(layers, p) for p in sixteen))
        members = {u: model_policies.unit_members(layers, u) for u in units}
        flops = {u: sum(flops.get(m, 0) for m in members[u]) for u in units}
        pool = [u for u in units if any(layer_cost.costs_something(layers[m], flops[u]) for m in members[u])]
        left_out = tuple(u for u in units if u not in pool)
        all32 = {p: FLOAT32 for p in current}
        progress = Progress(verbose, len(pool), len(left_out), len(data_batches))

        def measure(float32_units: Iterable[str], what: str) -> Errors:
            chosen = {m for u in float32_units for m in members.get(u, [u])}
            policies = {p: (FLOAT32 if p in chosen else current[p]) for p in current}
            model_policies.set_policies(model, policies, tree=tree)
            errors = _errors(_run(model, data_batches, loss_fn), ref)
            progress.step(what, errors)
            return errors

        def ok(errors: Errors) -> bool:
            return errors.finite and errors.loss <= tolerance and (
                gradient_tolerance is None or errors.gradient <= gradient_tolerance)

        model_policies.set_policies(model, all32, tree=tree)
        ref = _run(model, data_batches, loss_fn)
        if not all(math.isfinite(r[0]) for r in ref):
            raise ValueError("The all-float32 model gives a non-finite loss on `data`: nothing to compare against.")
        progress.step("every layer float32 (the reference)", None)
        passes = 1
        as_is = measure([], "the model as it is")
        passes += 1
        sens = {}
        for path in pool:
            sens[path] = measure([p for p in current if p not in members[path]], f"{path} alone in 16 bits")
            passes += 1

        def severity(p):
            s = sens[p]
            return tuple(v if math.isfinite(v) else math.inf for v in (s.loss, s.gradient, s.output))

        order = sorted(pool, key=severity, reverse=True)
        cap = len(order) if budget is None else min(budget, len(order))
        chosen: list[str] = []
        final = as_is
        capped = False
        if not ok(as_is):
            progress.expect(math.ceil(math.log2(cap + 1)))  # at most; pruning is added once known
            lo, hi, best = 1, cap, None
            while lo <= hi:  # smallest passing prefix, assuming more float32 never hurts
                mid = (lo + hi) // 2
                errors = measure(order[:mid], f"the {mid} most sensitive float32")
                passes += 1
                if ok(errors):
                    best, final, hi = mid, errors, mid - 1
                else:
                    lo = mid + 1
            if best is None:
                capped = True
                chosen = order[:cap]
                progress.expect_total(passes + 1)
                final = measure(chosen, f"the {cap} most sensitive float32 (the budget)")
                passes += 1
            else:
                chosen = order[:best]
                progress.expect_total(passes + len(chosen) - 1)
                for path in reversed(list(chosen)):  # prune the least sensitive first
                    if len(chosen) == 1:
                        break
                    trial = [p for p in chosen if p != path]
                    errors = measure(trial, f"without {path} in float32 (pruning)")
                    passes += 1
                    if ok(errors):
                        chosen, final = trial, errors

    progress.done()
    sizes = {p: flops.get(p, 0) for p in pool}
    total = sum(sizes.values()) or 1
    decisions = []
    budget_short = capped and cap < len(order)  # else: every candidate float32, and still not met
    for path in order:
        if path in chosen:
            reason = "kept float32: needed to meet the tolerance" if not capped else (
                f"kept float32 (one of the budget={budget} most sensitive); the tolerance is not met" if budget_short
                else "kept float32; the tolerance is not met even with every candidate in float32")
            decision = FLOAT32
        else:
            reason = ("16-bit is within tolerance together with the float32 layers" if not capped else
                      f"16-bit: past budget={budget}; the tolerance is not met")
            decision = current[path]
        decisions.append(LayerDecision(path, type(layers[path]).__name__, sens[path], sizes[path] / total, decision, reason))
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

"""Pictures: a model's precision plan as a table-like figure (matplotlib, an optional extra).

    pip install "keras-amp[plot]"
    keras_amp.plot_precision_plan(model, "plan.png", recipe="cnn")

keras_amp never needs matplotlib: it is imported when a picture is drawn, and its absence is an
ImportError that names the extra. Figures are `matplotlib.figure.Figure`s on the Agg canvas (a
PNG renderer): no display, no pyplot state, so they work on a headless machine and leave the
user's pyplot backend alone. `new_figure()` and `save()` are what the examples and benchmarks
draw with.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from typing import Any, Mapping

import keras

from keras_amp import layer_kinds, model_graph, recipe_roles, recipes, validation
from keras_amp.matmul16_policy import Matmul16DTypePolicy, policy_from_name

EXTRA = 'pip install "keras-amp[plot]"'
# Row colours by what the layer computes in; the legend uses the same names.
COLOURS = {
    "float32": "#9ecae1",
    "float32, 16-bit matmuls": "#a1d99b",
    "bfloat16 / float16": "#fdae6b",
    "not floating point": "#d9d9d9",
}
_COLUMNS = ("layer", "class", "compute", "variables", "why")
_WHY_WIDTH = 72  # characters per line of the "why" column; longer reasons wrap


def _matplotlib():
    """matplotlib's Figure and Agg canvas classes; ImportError naming the extra if it is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(
            f"keras_amp's pictures need matplotlib, an optional extra: {EXTRA} "
            f"(or pip install matplotlib). The import failed with: {e}"
        ) from e
    return Figure, FigureCanvasAgg


def require_matplotlib() -> None:
    """Raises the ImportError naming the extra now, if matplotlib is missing (before a long run)."""
    _matplotlib()


def new_figure(width: float, height: float):
    """A `matplotlib.figure.Figure` of `width` x `height` inches on the Agg canvas (no display).

    Raises ImportError naming `pip install "keras-amp[plot]"` when matplotlib is missing.
    """
    for name, value in (("width", width), ("height", height)):
        validation.check_float(name, value, min_value=0.0, min_inclusive=False)
    figure_class, canvas_class = _matplotlib()
    figure = figure_class(figsize=(width, height), layout="constrained")
    canvas_class(figure)
    return figure


def save(figure: Any, path: str | os.PathLike) -> str:
    """Writes `figure` to `path` (a PNG unless the suffix names another format); returns the path.

    Missing parent folders are created.
    """
    validation.check_type("path", path, (str, os.PathLike), "a file path (str or os.PathLike)")
    path = os.fspath(path)
    if not path:
        raise ValueError(f"`path` must be a file path. Received: path={path!r}")
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One layer's row of the picture: what it computes in and, where keras_amp knows, why."""

    path: str
    layer_class: str
    compute_dtype: str
    variable_dtype: str
    category: str  # a key of COLOURS
    why: str


def _category(policy: keras.DTypePolicy) -> str:
    if isinstance(policy, Matmul16DTypePolicy):
        return "float32, 16-bit matmuls"
    if not keras.backend.is_float_dtype(policy.compute_dtype):
        return "not floating point"
    return "bfloat16 / float16" if recipe_roles.is_16bit_dtype(policy.compute_dtype) else "float32"


def _row(path: str, layer_class: str, policy: keras.DTypePolicy, why: str, island: bool = False) -> PlanRow:
    if island:  # its policy is its parent's (its output's, on request); inside it computes in float32
        return PlanRow(path, layer_class, "float32", policy.variable_dtype, "float32", why)
    return PlanRow(path, layer_class, policy.compute_dtype, policy.variable_dtype, _category(policy), why)


def _plan_policy(name: str) -> keras.DTypePolicy:
    # Matmul16DTypePolicy names first; Keras's registry parses the rest (quantized ones included).
    return policy_from_name(name) if name.startswith("matmul16_from_") else keras.dtype_policies.get(name)


def _why_now(layer: Any, model_16bit: bool) -> str:
    """Why `layer` has its current policy, where keras_amp can tell from the layer itself."""
    policy = layer.dtype_policy
    if model_graph.is_island(layer):
        return "float32 island: float32 inside by construction"
    if getattr(policy, "quantization_mode", None) is not None:
        return f"quantized layer ({policy.quantization_mode})"
    if isinstance(policy, Matmul16DTypePolicy):
        return recipe_roles.RNN_ROLE
    if model_16bit and layer.compute_dtype == "float32":
        kind = layer_kinds.op_kind(layer)
        if kind is not None:
            return recipe_roles.deny_reason(kind)
    return ""


def plan_rows(model: Any, *, recipe: str | None = None, rules: Mapping[Any, Any] | None = None) -> list[PlanRow]:
    """The rows `plot_precision_plan` draws, parents before children (arguments as there)."""
    if isinstance(model, recipes.RecipePlan):
        if recipe is not None or rules is not None:
            raise ValueError(
                "`recipe` and `rules` apply to a model, not to a RecipePlan (it is already planned). "
                f"Received: recipe={recipe!r}, rules={rules!r}")
        return [_row(e.path, e.layer_class, _plan_policy(e.policy), e.reason) for e in model.layers]
    validation.check_type("model", model, keras.Model, "a built keras.Model or a keras_amp.RecipePlan")
    if recipe is None and rules is not None:
        raise ValueError(f"`rules` needs a `recipe`. Received: recipe=None, rules={rules!r}")
    if recipe is not None:
        plan = recipes.plan_recipe(model, recipe, rules)  # checks the arguments and that `model` is built
    elif not model.built:
        raise ValueError(
            "`model` must be built (give it an Input or call it on a batch once). "
            f"Received: model={model.name!r}, built=False")
    into = lambda layer: not model_graph.is_island(layer)  # noqa: E731 (an island's inside is its own)
    layers = dict(model_graph.walk(model, into=into))
    if recipe is not None:
        return [_row(e.path, e.layer_class, _plan_policy(e.policy), e.reason, model_graph.is_island(layers[e.path]))
                for e in plan.layers]
    model_16bit = recipe_roles.is_16bit_dtype(model.compute_dtype)
    return [_row(path, type(layer).__name__, layer.dtype_policy, _why_now(layer, model_16bit),
                 model_graph.is_island(layer)) for path, layer in layers.items()]


def _title(model: Any, recipe: str | None, rows: list[PlanRow]) -> str:
    if isinstance(model, recipes.RecipePlan):
        head = f"precision plan: recipe {model.recipe!r}, compute policy {model.compute_policy}"
    elif recipe is not None:
        head = f"precision plan of {model.name!r}: recipe {recipe!r} (what apply_recipe sets)"
    else:
        head = f"precision of {model.name!r} as it is: model policy {model.dtype_policy.name}"
    counts = {c: sum(r.category == c for r in rows) for c in COLOURS}
    return head + f"\n{len(rows)} layers: " + "; ".join(f"{c} {n}" for c, n in counts.items() if n)


def plot_precision_plan(
    model: Any,
    path: str | os.PathLike | None = None,
    *,
    recipe: str | None = None,
    rules: Mapping[Any, Any] | None = None,
):
    """Draws each layer's precision as a table: layer, class, compute and variable dtype, and why.

    One row per layer, parents before children, coloured by what the layer computes in
    (float32, float32 with 16-bit matmuls, 16-bit, not floating point). The "why" column is the
    plan's reason (recipe role, deny list, rule) when the model is planned; for a model drawn as
    it is, what keras_amp can tell from the layer itself (a float32 island, a quantized layer, a
    deny-list op in float32), and empty otherwise.

    Needs matplotlib (`pip install "keras-amp[plot]"`); draws on the Agg canvas (no display).

    Args:
        model: A built `keras.Model` or a `keras_amp.RecipePlan` (from `plan_recipe`).
        path: String, os.PathLike or None (default). Also write the figure there (PNG unless
            the suffix names another format matplotlib writes).
        recipe: String or None (default). With a model: draw `plan_recipe(model, recipe, rules)`,
            the policies `apply_recipe` would set and why; None draws the model's policies as
            they are.
        rules: Mapping or None. `apply_recipe`'s rules; only with `recipe`.

    Returns:
        The `matplotlib.figure.Figure`.

    Example:
        >>> keras_amp.enable("mixed_bfloat16")
        >>> model = build_model()
        >>> keras_amp.plot_precision_plan(model, "plan.png", recipe="cnn")
    """
    if path is not None:
        validation.check_type("path", path, (str, os.PathLike), "a file path (str or os.PathLike) or None")
    rows = plan_rows(model, recipe=recipe, rules=rules)
    if not rows:
        raise ValueError(f"`model` must have layers to draw. Received: model={getattr(model, 'name', model)!r}")
    require_matplotlib()
    cells = [[r.path, r.layer_class, r.compute_dtype, r.variable_dtype,
              "\n".join(textwrap.wrap(r.why, _WHY_WIDTH)) or "–"] for r in rows]
    # Row heights in text lines: a header of 1.6, each row its wrapped lines plus padding.
    heights = [1.6] + [max(cell.count("\n") + 1 for cell in row) + 0.4 for row in cells]
    chars = [2 + max(len(_COLUMNS[i]), *(len(line) for row in cells for line in row[i].split("\n")))
             for i in range(len(_COLUMNS))]  # the header is bold: two characters to spare
    figure = new_figure(max(6.0, 0.066 * sum(chars) + 0.8), 1.0 + 0.17 * sum(heights))  # 0.17 in a line
    ax = figure.add_subplot()
    ax.axis("off")
    table = ax.table(cellText=cells, colLabels=_COLUMNS, loc="upper left", cellLoc="left",
                     colWidths=[c / sum(chars) for c in chars],
                     cellColours=[[COLOURS[r.category]] * len(_COLUMNS) for r in rows])
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    for (row, _), cell in table.get_celld().items():
        cell.set_height(heights[row] / sum(heights))
        cell.PAD = 0.02  # of the cell's width (matplotlib's 0.1 indents the wide "why" column)
        cell.set_edgecolor("white")
        if row == 0:
            cell.set_text_props(fontweight="bold")
            cell.set_facecolor("#f0f0f0")
    figure.suptitle(_title(model, recipe, rows), fontsize=9, x=0.01, ha="left")
    figure.legend(handles=[_patch(c) for c in COLOURS], loc="outside lower left", ncols=len(COLOURS),
                  fontsize=8, frameon=False)
    if path is not None:
        save(figure, path)
    return figure


def _patch(category: str):
    from matplotlib.patches import Patch  # noqa: PLC0415 (optional extra)

    return Patch(facecolor=COLOURS[category], label=category)

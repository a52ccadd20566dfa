"""The symptom library and the decision tree, as data.

`SYMPTOMS` lists what can go wrong in mixed-precision training and how the monitor detects it;
`NODES` is the decision tree that leads from a symptom to concrete actions. The monitor
(`keras_amp.callbacks.LossScaleMonitor`), `keras-amp troubleshoot` and the README's
troubleshooting section all print from these two tables: change the advice here, nowhere else.

A question node asks one yes/no fact (`fact`) and says how to find it out (`how`); a leaf lists
actions. Actions are templates: `{layers}`, `{vanishing}`, `{half_scale}`, `{probe_scale}`, `{half_min_scale}`
are filled from what the caller knows, else with a generic phrase.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Symptom:
    """A detectable symptom.

    Args:
        name: String. Identifier ("non_finite_loss").
        title: String. What the user sees.
        detection: String. How `LossScaleMonitor` detects it.
        start: String. Id of the decision-tree node to start from.
    """

    name: str
    title: str
    detection: str
    start: str


@dataclasses.dataclass(frozen=True)
class Node:
    """A decision-tree node: a yes/no question on `fact`, or a leaf with `actions`."""

    id: str
    question: str = ""
    fact: str = ""
    how: str = ""
    yes: str = ""
    no: str = ""
    actions: tuple[str, ...] = ()

    @property
    def is_leaf(self) -> bool:
        return not self.question


SYMPTOMS: tuple[Symptom, ...] = (
    Symptom("non_finite_loss", "The loss is NaN or inf",
            "the epoch-mean loss in the fit logs is not finite at a log point", "data"),
    Symptom("zero_gradients", "Gradients are all zero",
            "the probe batch's gradients are all zero (globally, or in the worst layer) for N steps",
            "loss_scaled"),
    Symptom("scale_at_floor", "The loss scale is pinned at its floor",
            "loss_scale <= min_scale, with steps still overflowing, at two log points in a row",
            "data_at_floor"),
    Symptom("validation_swing", "Validation metrics swing",
            "a val_* metric changes by more than the threshold (relative) from one epoch to the next, "
            "other than the way its training metric moves (both losses falling is learning)",
            "recent_overflows"),
    Symptom("memory_growth", "Memory grows epoch over epoch",
            "device memory in use (GPU) or process RSS rises at each of N consecutive epoch ends, "
            "by 5% in all",
            "memory"),
    Symptom("updates_vanish", "Weight updates vanish",
            "most of a layer's requested weight change is lost to rounding, or most of its weights "
            "do not move, in a measured step (keras_amp.diagnostics.UpdateLossProbe)",
            "lean_storage"),
    Symptom("step_time_jump", "Step time jumps",
            "the mean step time between two log points exceeds its running median by the factor, "
            "at two log points in a row",
            "step_time"),
)

_FLOAT32 = ("compute {layers} in float32: dtype='float32' on the layer, keras_amp.layers.Float32(...), "
            "or keras_amp.apply_recipe(model, recipe, rules={rules})")

_DATA_QUESTION = "Does the batch itself (inputs or labels) contain NaN/inf?"
_DATA_HOW = ("the monitor counts such batches in every step and checks the probe batch; "
             "keras_amp.find_overflow(model, x, y) lists them ('data:'); np.isfinite(x).all()")
_FORWARD_HOW = "keras_amp.find_overflow(model, x, y) names the producing layer, forward and backward"

NODES: tuple[Node, ...] = (
    # Data first: under a LossScaleOptimizer a NaN/inf batch overflows at every scale, so the
    # scale questions below would blame the scale for what the data did.
    Node("data", _DATA_QUESTION, "data_non_finite", _DATA_HOW, "clean_data", "loss_scaled_nan"),
    Node("clean_data", actions=(
        "Repair or filter the data (dataset.filter(...), np.nan_to_num, or tf.debugging.check_numerics "
        "in the input pipeline); NaN/inf in {data}. Lowering the loss scale cannot help: such a batch "
        "overflows at every scale.",)),
    Node("loss_scaled_nan", "Is the loss scaled (a LossScaleOptimizer)?", "loss_scaled",
         "model.optimizer is a keras.optimizers.LossScaleOptimizer (mixed_float16 uses one, "
         "mixed_bfloat16 needs none)", "overflowing", "forward_overflow_unscaled"),
    Node("overflowing", "Is the loss scale at its floor, or are steps overflowing?",
         "scale_at_floor_or_overflowing",
         "the monitor's loss_scale (vs min_scale) and overflows_since_log (in History and monitor.last)",
         "forward_overflow", "diverged"),
    Node("forward_overflow", "Does the forward pass itself produce the inf/NaN?", "forward_overflow",
         _FORWARD_HOW, "move_to_float32", "lower_scale"),
    Node("forward_overflow_unscaled", "Does the forward pass itself produce the inf/NaN?", "forward_overflow",
         _FORWARD_HOW, "move_to_float32", "diverged"),
    Node("move_to_float32", actions=(
        "C" + _FLOAT32[1:] + ".",
        "Run keras_amp.find_overflow(model, x, y) again: it should report no producer, or name the next "
        "layer to move (values that overflowed before may overflow one layer on).")),
    Node("lower_scale", actions=(
        "Lower the initial loss scale 2x: LossScaleOptimizer(..., initial_scale={half_scale}).",
        "If the backward pass still overflows, " + _FLOAT32 + ".")),
    Node("diverged", actions=(
        "The loss grew to inf in float32 arithmetic: lower the learning rate or clip gradients "
        "(clipnorm=1.0), and look for log(0) or a division by zero in the loss.",
        "Compare with a float32 run from the same seed: if it diverges too, precision is not the cause.")),
    Node("loss_scaled", "Is the loss scaled (a LossScaleOptimizer, for float16)?", "loss_scaled",
         "model.optimizer is a keras.optimizers.LossScaleOptimizer", "underflow", "wrap_optimizer"),
    Node("wrap_optimizer", actions=(
        "Wrap the optimizer: keras_amp.wrap(optimizer) or keras_amp.LossScaleOptimizer(optimizer); "
        "float16 gradients below 6e-8 become 0 without loss scaling.",)),
    Node("underflow", "Do the zeros underflow (fewer zeros at a larger loss scale)?", "gradient_underflow",
         "underflow_zero_fraction in keras_amp.diagnostics.gradient_statistics(model, x, y) or the "
         "GradientStatistics callback: zeros that are values at a 4096x larger scale",
         "raise_scale", "dead_gradients"),
    Node("raise_scale", actions=(
        "Raise the loss scale to where the zeros are values: initial_scale={probe_scale} (it backs off if "
        "steps overflow), or a larger min_scale.",
        "Or " + _FLOAT32 + ".")),
    Node("dead_gradients", actions=(
        "The gradients are zero in float32 too: look for dead ReLUs, a stop_gradient, a frozen "
        "(trainable=False) layer or one not connected to the loss.",)),
    Node("data_at_floor", _DATA_QUESTION, "data_non_finite", _DATA_HOW, "clean_data",
         "forward_overflow_at_floor"),
    Node("forward_overflow_at_floor", "Does the forward pass itself produce the inf/NaN?",
         "forward_overflow", _FORWARD_HOW, "move_to_float32", "lower_floor"),
    Node("lower_floor", actions=(
        "Let the scale back off further: LossScaleOptimizer(..., min_scale={half_min_scale}).",
        "If the backward pass overflows even there, " + _FLOAT32 + ".")),
    Node("recent_overflows", "Did steps overflow since the previous evaluation?", "recent_overflows",
         "the monitor's overflows_since_log (in History and monitor.last); without loss scaling no step is "
         "skipped, and a finite training loss says none overflowed", "lower_scale", "outputs_float32"),
    Node("outputs_float32", "Do the model's outputs and loss compute in float32?", "outputs_float32",
         "keras_amp.check_model(model) reports no output_not_float32 / low_precision_loss finding",
         "compare_float32", "float32_head"),
    Node("float32_head", actions=(
        "Make the last layer float32 (keras_amp.layers.OutputHead, or dtype='float32') and keep the "
        "loss in float32; then fix check_model's softmax and normalisation findings.",)),
    Node("compare_float32", actions=(
        "Compare with a float32 run from the same seed: if it swings too, lower the learning rate "
        "or check the validation data; if not, move check_model's flagged layers to float32.",)),
    Node("memory", actions=(
        "Check how long tensors live: per-step tensors kept in Python lists (callbacks, metrics, "
        "logs), tf.function retracing on changing shapes or Python arguments, models built in a "
        "loop without keras.backend.clear_session().",
        "Growth is a leak, not precision: a float32 copy costs its memory once. To lower the level "
        "itself, keras_amp.check_model(model) and the op audit show ops and variables kept in float32 "
        "and 16-bit tensors copied to float32.")),
    Node("lean_storage", "Are the layer's weights stored in 16 bits (pure 16-bit policy or LeanAdam)?",
         "weights_16bit", "keras_amp.memory.storage_dtype(variable) for the layer's weights",
         "compensate", "tiny_steps"),
    Node("compensate", actions=(
        "Train {vanishing} with compensation: keras_amp.optimizers.LeanAdam (16-bit weights plus their low "
        "bits, exact), or keep a float32 master for this layer (a mixed policy: "
        "keras_amp.enable('mixed_bfloat16'), or dtype='mixed_bfloat16' on the layer).",
        "Pure bfloat16 Keras Adam computes 1 - 0.999**t in bfloat16, where it is 0: it never moves "
        "the weights at all.")),
    Node("tiny_steps", actions=(
        "The float32 master loses the update (the step is below float32's 2**-24 of the weight): "
        "raise the learning rate, or rescale the weights.",)),
    Node("step_time", actions=(
        "Check device utilisation (on a GPU nvidia-smi; on any device "
        "keras.callbacks.TensorBoard(profile_batch=(10, 20))).",
        "Check the input pipeline: dataset.prefetch(tf.data.AUTOTUNE), cache(), "
        "map(..., num_parallel_calls=tf.data.AUTOTUNE); and retracing (changing batch shapes).")),
)

_NODES = {n.id: n for n in NODES}
_SYMPTOMS = {s.name: s for s in SYMPTOMS}
SYMPTOM_NAMES = tuple(_SYMPTOMS)

# What a template says where the caller does not know the value: an expression to evaluate,
# never an unfilled placeholder.
_GENERIC = {
    "layers": "the layers keras_amp.find_overflow(model, x, y) names",
    "vanishing": "the layers keras_amp.diagnostics.UpdateLossProbe (or LossScaleMonitor(update_loss_every=N)) names",
    "half_scale": "float(optimizer.dynamic_scale) / 2",
    "probe_scale": "float(optimizer.dynamic_scale) * 4096",
    "half_min_scale": "optimizer.min_scale / 2",
    "data": "the batch",
    "rules": "{layer.name: 'float32'}",
}
TEMPLATE_KEYS = tuple(_GENERIC)


class _Fill(dict):
    def __missing__(self, key):
        if key not in _GENERIC:  # a template names a key this table does not define
            raise KeyError(f"Unknown template key {key!r}. Allowed: {', '.join(TEMPLATE_KEYS)}")
        return _GENERIC[key]


def symptom(name: str) -> Symptom:
    """The `Symptom` called `name`."""
    if name not in _SYMPTOMS:
        raise ValueError(f"Unknown `symptom`. Received: symptom={name!r}. Allowed: {', '.join(SYMPTOM_NAMES)}")
    return _SYMPTOMS[name]


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """A walk through the tree: the questions with their answers, and the actions it ends in."""

    symptom: Symptom
    steps: tuple[tuple[str, str], ...]
    actions: tuple[str, ...]
    detail: str = ""

    def __str__(self) -> str:
        lines = [f"keras_amp diagnosis: {self.symptom.title}" + (f" ({self.detail})" if self.detail else "")]
        lines += [f"  {q} -> {a}" for q, a in self.steps]
        lines += [f"  action: {a}" for a in self.actions]
        return "\n".join(lines)


def diagnose(name: str, facts: Mapping[str, Any] | None = None, detail: str = "", **context) -> Diagnosis:
    """Walks the tree from symptom `name`, answering questions from `facts`.

    The walk stops at the first fact that is missing (or None): that question is answered
    "unknown", and the one action is to find it out (never the actions of both branches).
    `context` fills the action templates (`layers`, `half_scale`, `probe_scale`,
    `half_min_scale`, `data`); a value not given is said as an expression to evaluate.
    """
    facts = facts or {}
    fill = _Fill({k: v for k, v in context.items() if v not in (None, "", [])})
    if isinstance(fill.get("layers"), (list, tuple)):
        # apply_recipe's rules match a regex against a layer's name or path, in full.
        fill.setdefault("rules", "{" + ", ".join(f"{re.escape(p)!r}: 'float32'" for p in fill["layers"]) + "}")
        fill["layers"] = ", ".join(repr(p) for p in fill["layers"])
    steps: list[tuple[str, str]] = []
    actions: list[str] = []

    def walk(node_id: str):
        node = _NODES[node_id]
        if node.is_leaf:
            actions.extend(a.format_map(fill) for a in node.actions)
            return
        value = facts.get(node.fact)
        if value is None:
            steps.append((node.question, "unknown"))
            actions.append(f"Answer first: {node.question} Find out: {node.how}. "
                           f"`keras-amp troubleshoot {name}` shows what each answer leads to.")
        else:
            steps.append((node.question, "yes" if value else "no"))
            walk(node.yes if value else node.no)

    walk(symptom(name).start)
    return Diagnosis(symptom(name), tuple(steps), tuple(dict.fromkeys(actions)), detail)


def _tree_lines(node_id: str, indent: str, fill: _Fill) -> list[str]:
    node = _NODES[node_id]
    if node.is_leaf:
        return [f"{indent}- {a.format_map(fill)}" for a in node.actions]
    lines = [f"{indent}{node.question} (find out: {node.how})"]
    for answer, child in (("yes", node.yes), ("no", node.no)):
        lines.append(f"{indent}  {answer}:")
        lines += _tree_lines(child, indent + "    ", fill)
    return lines


def _markdown_lines(node_id: str, indent: str) -> list[str]:
    node = _NODES[node_id]
    if node.is_leaf:
        return [f"{indent}- {a.format_map(_Fill())}" for a in node.actions]
    lines = [f"{indent}- **{node.question}** (find out: {node.how})"]
    for answer, child in (("yes", node.yes), ("no", node.no)):
        lines.append(f"{indent}  - {answer}:")
        lines += _markdown_lines(child, indent + "    ")
    return lines


def render_text(name: str | None = None) -> str:
    """The tree as indented text, for one symptom or all (what `keras-amp troubleshoot` prints)."""
    chosen = [symptom(name)] if name is not None else list(SYMPTOMS)
    lines = []
    for s in chosen:
        lines.append(f"{s.title} [{s.name}]")
        lines.append(f"  detected: {s.detection}")
        lines += _tree_lines(s.start, "  ", _Fill())
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def render_markdown(name: str | None = None) -> str:
    """The README's troubleshooting section, generated from the same tables; with `name`, that
    symptom's subsection alone."""
    if name is None:
        lines = ["## Troubleshooting", "",
                 "`keras_amp.callbacks.LossScaleMonitor` detects these symptoms during `fit` and prints "
                 "the walk through this tree; `keras-amp troubleshoot` prints it.", ""]
    else:
        lines = []
    for s in [symptom(name)] if name is not None else SYMPTOMS:
        lines.append(f"### {s.title}")
        lines.append("")
        lines.append(f"Detected when {s.detection}.")
        lines.append("")
        lines += _markdown_lines(s.start, "")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"

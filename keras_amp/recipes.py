"""Per-layer precision recipes: recipe + deny list + user rules -> one policy per layer, set in place.

`plan_recipe()` decides; `apply_recipe()` sets each layer's `dtype_policy` on the model it is
given (no clone, no `get_config()` round trip), so it works on Sequential, functional (operator
nodes included), nested and subclassed models and on third-party layers. The decisions, for every
layer `model_graph.walk()` reaches, parents before children, the later one winning:

    0. default       a layer's parent's planned policy (the model's: the compute dtype), so a
                     float32 block is float32 all through and MultiHeadAttention's projections,
                     an RNN's cell and a wrapper's inner layer follow their parent
    1. recipe role   "cnn":         first and last layers float32
                     "transformer": nothing beyond the compute dtype: attention scores are
                                    float32 by keras_amp's op rules, logits and loss by the loss
                     "rnn":         LSTM/GRU/any RNN, Bidirectional and their cells: gates,
                                    nonlinearities and carried state float32, input and
                                    recurrent matmuls 16-bit (`keras_amp.Matmul16DTypePolicy`);
                                    the output layer, like the transformer's, in the compute
                                    dtype (float32 logits-to-loss by the loss)
    2. deny list     softmax, normalisation, exp/log-type activations, activity-regularizer
                     losses -> float32; stock BatchNormalization / LayerNormalization between
                     16-bit layers keep the compute dtype (float32 inside either way). Decided
                     by `layer_kinds.op_kind`: Keras types, activations by identity, and a graph
                     layer's own traced ops (a root of a mean of squares), never a name
    3. user rules    layer class or name/path regex -> policy

Roles and the deny list change a layer's output dtype, which Keras handles between the layers of
a Sequential or functional graph but a subclassed model's or a composite layer's own code may
not (`float32 + bfloat16` is an error in TF). So a layer called from such code keeps the dtype
relation to its parent it was built with: it follows its parent, or, built in another dtype than
a 16-bit parent (keras-hub's float32 softmax in its attention layers), stays as built; its
reason says what its deny-list op then computes in (float32 where the op table's rule in force, or
Keras, computes it in float32; the compute dtype otherwise). An RNN there keeps its
parent's policy (its output dtype) and only its cell gets the "rnn" role: `RNN.call` casts the
initial states to the cell's dtype and the outputs to the RNN's, so gates and state are float32
through the loop and the returned states are rounded once, at the end.

Left as built: keras_amp's float32 islands (`model_graph.Float32Island`), non-float layers
(lookups, tokenizers) and quantized layers.

"First"/"last" layers are those reached from the inputs (outputs) through parameter-free layers
and operator nodes up to the first layer with weights (`model_graph.boundary`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import keras
from absl import logging

from keras_amp import layer_kinds, layer_policies, model_graph, recipe_roles
from keras_amp import policy as amp_policy
from keras_amp import validation
from keras_amp.matmul16_policy import PREFIX as MATMUL16_PREFIX
from keras_amp.matmul16_policy import policy_from_name
from keras_amp.recipe_roles import FLOAT32

RECIPES = ("cnn", "rnn", "transformer")
# Mixed or float32 only: layers keep their float32 variables (a pure 16-bit policy would need new ones).
RULE_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
    """One layer's planned policy.

    Args:
        path: String. The layer's path below the model ("block/attention/query").
        layer_class: String. The layer's class name.
        policy: String. The dtype policy name the layer will have.
        reason: String. Which default, recipe role, deny-list entry or rule decided it.
    """

    path: str
    layer_class: str
    policy: str
    reason: str


@dataclasses.dataclass(frozen=True)
class RecipePlan:
    """The per-layer policies `apply_recipe` sets, parents before children."""

    recipe: str
    compute_policy: str
    layers: tuple[LayerPolicy, ...]

    def policies(self) -> dict[str, str]:
        """Layer path -> policy name."""
        return {entry.path: entry.policy for entry in self.layers}

    def policy_map(self) -> keras.dtype_policies.DTypePolicyMap:
        """The plan as a Keras `DTypePolicyMap` keyed by layer path (default: the compute policy)."""
        return keras.dtype_policies.DTypePolicyMap(
            default_policy=keras.DTypePolicy(self.compute_policy),
            policy_map={e.path: policy_from_name(e.policy) for e in self.layers},
        )

    def __str__(self) -> str:
        lines = [f"recipe {self.recipe!r}, compute policy {self.compute_policy}:"]
        # Columns as wide as their longest entry (keras-hub paths run past any fixed width).
        path, cls = (max([width, *(len(getattr(e, k)) for e in self.layers)]) for k, width in
                     (("path", 36), ("layer_class", 28)))
        for e in self.layers:
            lines.append(f"  {e.path:<{path}} {e.layer_class:<{cls}} {e.policy:<15} {e.reason}")
        return "\n".join(lines)


def _check_rules(rules: Any) -> list[tuple[Any, str, str]]:
    """Validates `rules`; returns (layer class or compiled regex, policy name, shown key) in order."""
    if rules is None:
        return []
    validation.check_type("rules", rules, Mapping, "None or a mapping of layer class or name regex to policy")
    checked = []
    for key, value in rules.items():
        if type(value) is keras.DTypePolicy:
            value = value.name
        if not isinstance(value, str) or value not in RULE_POLICIES:
            raise ValueError(
                "Each `rules` value must be float32 or a mixed policy (layers keep their float32 "
                f"variables). Received: rules[{key!r}]={value!r}. Allowed: {', '.join(RULE_POLICIES)} "
                "(or a keras.DTypePolicy of one)"
            )
        if isinstance(key, type):
            if not issubclass(key, keras.layers.Layer):
                raise TypeError(
                    "Each `rules` key must be a keras.layers.Layer subclass or a name regex. "
                    f"Received: rules key {key!r}"
                )
            checked.append((key, value, key.__name__))
        elif isinstance(key, str):
            try:
                checked.append((re.compile(key), value, key))
            except re.error as e:
                raise ValueError(f"`rules` key must be a valid regex ({e}). Received: rules key {key!r}") from e
        else:
            raise TypeError(
                "Each `rules` key must be a keras.layers.Layer subclass or a name regex string. "
                f"Received: rules key {key!r} of type {type(key).__name__}"
            )
    return checked


def _compute_policy() -> str:
    config = amp_policy.config()
    return config.policy if config is not None else keras.config.dtype_policy().name


def _left_as_built(layer: Any) -> str | None:
    """Why `layer` keeps its own policy, or None when the plan decides it."""
    if model_graph.is_island(layer):
        return "float32 island: kept as built"
    policy = layer.dtype_policy
    if getattr(policy, "quantization_mode", None) is not None:
        return "quantized layer: kept as built"
    if not keras.backend.is_float_dtype(layer.compute_dtype):
        return f"{layer.compute_dtype} layer: kept as built"
    return None


def _decide(recipe, layer, parent, model, planned, first, last, compute) -> tuple[str, str]:
    """`layer`'s policy and reason from its parent, the recipe and the deny list (rules come after).

    `planned` maps a layer's id to its (policy, reason), parents before children."""
    inherited, parent_reason = planned.get(id(parent), (compute, ""))
    role = recipe_roles.role(recipe, layer, parent, id(layer) in first, id(layer) in last)
    if role == recipe_roles.RNN_CELL_ROLE:
        if inherited.startswith(MATMUL16_PREFIX):
            if not recipe_roles.saves_its_cell(parent):  # LSTM, GRU, SimpleRNN build their cell with their dtype
                return inherited, f"as its parent {parent.name!r}"
            # A cell saved in its RNN's config: float32, not the RNN's Matmul16DTypePolicy, which
            # Keras's `Operation.from_config` would turn into a name no policy parses. The rule
            # applies inside the RNN.
            return FLOAT32, recipe_roles.RNN_CELL_INSIDE
        if parent_reason.startswith(recipe_roles.RNN_ROLE):  # the RNN kept its output dtype for its parent's code
            return recipe_roles.role_policy(role, compute), role
        role = None  # the RNN was decided otherwise (a rule, float32): its cell follows it
    kind = layer_kinds.op_kind(layer)
    if model_graph.is_graph(parent):
        # Keras casts between the layers of a graph (inputs are autocast, operator nodes promote),
        # so a layer's output dtype may change freely here.
        if kind is not None:
            return FLOAT32, recipe_roles.deny_reason(kind)
        if role is not None:
            return recipe_roles.role_policy(role, compute), role
        return inherited, f"{recipe}: compute dtype" if parent is model else f"as its parent {parent.name!r}"
    # Called from a subclassed model's or a composite layer's own code, which may mix its output
    # with other tensors (TF adds no implicit casts: float32 + bfloat16 is an error), a layer keeps
    # the dtype relation to its parent it was built with.
    if recipe_roles.is_16bit_dtype(parent.compute_dtype) and layer.compute_dtype != parent.compute_dtype:
        return layer.dtype_policy.name, f"kept: built {layer.compute_dtype} inside a {parent.compute_dtype} parent"
    if kind is not None:
        return inherited, recipe_roles.kept_deny_reason(kind, layer, parent, inherited)
    if role is not None and inherited != recipe_roles.role_policy(role, compute):
        if role == recipe_roles.RNN_ROLE:
            return inherited, (
                f"{role}: its output kept in {inherited} for {parent.name!r}'s own code; its cell "
                "computes in float32"
            )
        return inherited, f"{role}: not applied inside {parent.name!r}'s own code (output dtype kept)"
    return inherited, f"as its parent {parent.name!r}"


def _plan(model: Any, recipe: str, rules: Any) -> tuple[RecipePlan, list[tuple[Any, LayerPolicy]]]:
    validation.check_choice("recipe", recipe, RECIPES)
    checked_rules = _check_rules(rules)
    validation.check_type("model", model, keras.Model, "a keras.Model")
    if not model.built:
        raise ValueError(
            "`model` must be built (give it an Input or call it on a batch once). "
            f"Received: model={model.name!r}, built=False"
        )
    compute = _compute_policy()
    first = model_graph.boundary(model, first=True) if recipe == "cnn" else set()
    last = model_graph.boundary(model, first=False) if recipe == "cnn" else set()
    planned: dict[int, tuple[str, str]] = {id(model): (compute, "")}
    parent_of: dict[int, Any] = {}
    used: set[int] = set()
    out: list[tuple[Any, LayerPolicy]] = []

    def into(layer):
        return not model_graph.is_island(layer)

    for path, layer in model_graph.walk(model, into=into):
        for child in model_graph.children(layer):
            parent_of.setdefault(id(child), layer)
        parent = parent_of.get(id(layer), model)
        kept = _left_as_built(layer)
        if kept is not None:
            policy, reason = layer.dtype_policy.name, kept
            for i, (key, _, shown) in enumerate(checked_rules):
                if _matches(key, layer, path):
                    used.add(i)
                    logging.warning("apply_recipe: rule %r skipped for %r: %s", shown, path, kept)
        else:
            policy, reason = _decide(recipe, layer, parent, model, planned, first, last, compute)
            for i, (key, rule_policy, shown) in enumerate(checked_rules):
                if _matches(key, layer, path):
                    used.add(i)
                    policy, reason = rule_policy, f"rule {shown!r}"
        planned[id(layer)] = (policy, reason)
        out.append((layer, LayerPolicy(path, type(layer).__name__, policy, reason)))
    recipe_roles.normalization_between_16bit_layers(model, out, planned, compute)
    unused = [shown for i, (_, _, shown) in enumerate(checked_rules) if i not in used]
    if unused:
        logging.warning("apply_recipe: rules matched no layer of %r: %r", model.name, unused)
    plan = RecipePlan(recipe=recipe, compute_policy=compute, layers=tuple(e for _, e in out))
    return plan, out


def _matches(key: Any, layer: Any, path: str) -> bool:
    if isinstance(key, type):
        return isinstance(layer, key)
    return bool(key.fullmatch(layer.name) or key.fullmatch(path))


def _say_lowered(model: keras.Model, entries: list[tuple[Any, LayerPolicy]]) -> None:
    """Warns of float32 layers the plan computes in 16 bits, in a model built with 16-bit layers:
    there they were chosen (a float32 head), and a recipe that lowers them creates the finding they
    avoided. A model built wholly in float32 is what a recipe converts: nothing to say."""
    mixed = any(recipe_roles.is_16bit_dtype(layer.compute_dtype) for layer, _ in entries)
    lowered = [e.path for layer, e in entries if layer.compute_dtype == FLOAT32
               and recipe_roles.is_16bit_dtype(e.policy.removeprefix("mixed_"))]
    if mixed and lowered:
        logging.warning(
            "apply_recipe on %r: %s computed in float32 and now compute(s) in 16 bits (the recipe's plan). To "
            "keep them float32, pass rules=%r", model.name, ", ".join(repr(p) for p in lowered[:8]),
            {re.escape(p): FLOAT32 for p in lowered[:8]})


def plan_recipe(model: keras.Model, recipe: str, rules: Mapping[Any, Any] | None = None) -> RecipePlan:
    """The per-layer policies `apply_recipe(model, recipe, rules)` would set; changes nothing."""
    return _plan(model, recipe, rules)[0]


def _reset_compiled_functions(model: keras.Model) -> None:
    # Traced functions keep the dtypes they were traced with: the next fit/evaluate/predict
    # must trace again to use the new policies (Keras rebuilds a function that is None).
    model.train_function = None
    model.test_function = None
    model.predict_function = None


def apply_recipe(model: keras.Model, recipe: str, rules: Mapping[Any, Any] | None = None) -> keras.Model:
    """Sets per-layer dtype policies from a recipe on `model` itself, and returns the same model.

    In place: no layer is rebuilt and no weight is copied, so any built model works
    (Sequential, functional with operator nodes, nested, subclassed, keras-hub,
    keras.applications), optimizer state and references to its layers stay valid, and the
    model's own dtype policy becomes the compute policy (`model_graph.is_stale` then knows it
    was converted). Its traced train/test/predict functions are dropped, so the next `fit`,
    `evaluate` or `predict` traces anew with the new policies. For a copy, apply the recipe to
    `keras.models.clone_model(model)` or to a reloaded `.keras` file.

    Args:
        model: A built `keras.Model`.
        recipe: String. "cnn", "transformer" or "rnn" (see the module docstring).
        rules: Mapping or None. Overrides applied after the recipe and the deny list: keys
            are `keras.layers.Layer` subclasses (isinstance) or regexes matched in full against
            a layer's name or path ("block_1/.*"); values are "float32", "mixed_bfloat16",
            "mixed_float16" or a `keras.DTypePolicy` of one. Later rules win. A rule names only
            the layers it matches; sublayers of a layer ruled float32 are float32 by default.

    Returns:
        `model`, with every layer's policy set. The compute dtype is that of
        `keras_amp.config()` (Keras's global policy when keras_amp is not enabled).

    Example:
        >>> keras_amp.enable("mixed_bfloat16")
        >>> model = keras_hub.models.BertBackbone(...)   # or any built model
        >>> keras_amp.apply_recipe(model, "transformer", rules={r"logits": "float32"})
    """
    plan, entries = _plan(model, recipe, rules)
    by_path = {entry.path: (layer, entry) for layer, entry in entries}
    _say_lowered(model, entries)
    try:  # all or nothing: no half-converted model
        layer_policies.set_in_place((entry.path, layer, entry.policy) for layer, entry in entries)
    except layer_policies.PolicyChangeError as e:
        layer, entry = by_path[e.path]
        raise ValueError(
            f"apply_recipe: {e}. Build that layer with dtype={entry.policy!r}, or keep its policy with "
            f"rules={{{entry.path!r}: {layer.dtype_policy.name!r}}}") from e
    model.dtype_policy = plan.compute_policy
    _reset_compiled_functions(model)
    logging.info("apply_recipe %r on %r:\n%s", recipe, model.name, plan)
    return model

"""Per-layer precision recipes: recipe + deny list + user rules -> one policy per layer -> a clone.

`plan_recipe()` decides, `apply_recipe()` rebuilds the model with `keras.models.clone_model`,
each layer re-created from its config with its planned `DTypePolicy` (and, where the recipe
needs a float32 island inside a layer, as the `keras_amp.layers` subclass), then copies the
weights. The decisions, in order, the later one winning:

    1. recipe role   "cnn":         first and last layers float32, everything else compute dtype
                     "transformer": MultiHeadAttention -> keras_amp's (scores/softmax float32),
                                    output head float32, everything else compute dtype
                     "rnn":         LSTM/GRU -> keras_amp's (gates, cell state float32),
                                    sequence output layer float32, everything else compute dtype
    2. deny list     softmax, normalisation, exp/log-type activations, activity-regularizer
                     losses -> float32 (stock `Softmax` -> keras_amp's)
    3. user rules    layer class or name/path regex -> policy; the layer keeps its class

"First"/"last" layers are those reached from the inputs (outputs) through parameter-free layers
up to the first layer with weights, so `Rescaling -> Conv2D` or `Dense -> Activation("softmax")`
are one region.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import keras
from absl import logging

from keras_amp import layers as amp_layers
from keras_amp import policy as amp_policy

RECIPES = ("cnn", "rnn", "transformer")
RULE_POLICIES = ("bfloat16", "float16", "float32", "mixed_bfloat16", "mixed_float16")
FLOAT32 = "float32"

# Activations by the op type that makes them unsafe in 16 bits. Softmax-type: the normaliser
# is a long sum of exponentials that loses precision in 16 bits (and inputs near float16's
# range overflow). Exp/log-type: exp(x) overflows float16 for x > 11.09.
SOFTMAX_ACTIVATIONS = (keras.activations.softmax, keras.activations.log_softmax)
EXP_ACTIVATIONS = (keras.activations.exponential, keras.activations.softplus, keras.activations.log_sigmoid)
CONV_LAYERS = amp_policy.CONV_LAYERS
_NORMALIZATION_NAME = re.compile(r".*Norm(alization)?")
# Stock layers the recipes replace by the keras_amp subclass that keeps the island inside
# (same weights, so they carry over).
_REPLACEMENTS = {
    keras.layers.MultiHeadAttention: amp_layers.MultiHeadAttention,
    keras.layers.LSTM: amp_layers.LSTM,
    keras.layers.GRU: amp_layers.GRU,
    keras.layers.Softmax: amp_layers.Softmax,
}


def op_kind(layer: keras.layers.Layer) -> str | None:
    """The deny-list op type `layer` computes ("softmax", "normalization", "exp", "loss"), or None.

    Normalisation layers are recognised by class (Keras's) or by a class name ending in "Norm" /
    "Normalization" (user-written ones); "loss" is a layer with an activity regularizer, whose
    penalty (e.g. sum of squares) is computed in the layer's compute dtype.
    """
    if isinstance(layer, keras.layers.Wrapper) and not isinstance(layer, amp_layers.Float32):
        return op_kind(layer.layer)  # TimeDistributed(Dense(activation="softmax")) is a softmax
    activation = getattr(layer, "activation", None)
    if isinstance(layer, keras.layers.Softmax) or any(activation is f for f in SOFTMAX_ACTIVATIONS):
        return "softmax"
    if any(activation is f for f in EXP_ACTIVATIONS):
        return "exp"
    if any(_NORMALIZATION_NAME.fullmatch(cls.__name__) for cls in type(layer).__mro__[:-1]):
        if not isinstance(layer, keras.Model):
            return "normalization"
    if getattr(layer, "activity_regularizer", None) is not None:
        return "loss"
    return None


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
    """One layer's planned policy.

    Args:
        path: String. The layer's name, prefixed by enclosing model names ("block/conv").
        layer_class: String. The class the layer has now.
        policy: String. The dtype policy name the layer will get.
        reason: String. Which recipe role, deny-list entry or rule decided it.
        replace_with: String or None. The keras_amp class the layer (or the RNNs inside a
            Bidirectional) is rebuilt as, if any.
    """

    path: str
    layer_class: str
    policy: str
    reason: str
    replace_with: str | None = None


@dataclasses.dataclass(frozen=True)
class RecipePlan:
    """The per-layer policies `apply_recipe` will set, in model order."""

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
            policy_map={e.path: keras.DTypePolicy(e.policy) for e in self.layers},
        )

    def __str__(self) -> str:
        lines = [f"recipe {self.recipe!r}, compute policy {self.compute_policy}:"]
        for e in self.layers:
            cls = e.layer_class + (f" -> keras_amp.layers.{e.replace_with}" if e.replace_with else "")
            lines.append(f"  {e.path:<28} {cls:<42} {e.policy:<15} {e.reason}")
        return "\n".join(lines)


def _check_recipe(recipe: Any) -> None:
    if not isinstance(recipe, str):
        raise TypeError(
            f"`recipe` must be a string. Received: recipe={recipe!r} of type {type(recipe).__name__}. "
            f"Allowed: {', '.join(RECIPES)}"
        )
    if recipe not in RECIPES:
        raise ValueError(f"Unknown `recipe`. Received: recipe={recipe!r}. Allowed: {', '.join(RECIPES)}")


def _check_rules(rules: Any) -> list[tuple[Any, str]]:
    """Validates `rules`; returns (compiled regex or layer class, policy name) pairs in order."""
    if rules is None:
        return []
    if not isinstance(rules, Mapping):
        raise TypeError(
            "`rules` must be None or a mapping of layer class or name regex to policy. "
            f"Received: rules={rules!r} of type {type(rules).__name__}"
        )
    checked = []
    for key, value in rules.items():
        if isinstance(value, keras.DTypePolicy) and type(value) is keras.DTypePolicy:
            value = value.name
        if not isinstance(value, str) or value not in RULE_POLICIES:
            raise ValueError(
                f"Each `rules` value must be a float dtype policy. Received: rules[{key!r}]={value!r}. "
                f"Allowed: {', '.join(RULE_POLICIES)} (or a keras.DTypePolicy of one)"
            )
        if isinstance(key, type):
            if not issubclass(key, keras.layers.Layer):
                raise TypeError(
                    "Each `rules` key must be a keras.layers.Layer subclass or a name regex. "
                    f"Received: rules key {key!r}"
                )
            checked.append((key, value))
        elif isinstance(key, str):
            try:
                checked.append((re.compile(key), value))
            except re.error as e:
                raise ValueError(f"`rules` key is not a valid regex ({e}). Received: rules key {key!r}") from e
        else:
            raise TypeError(
                "Each `rules` key must be a keras.layers.Layer subclass or a name regex string. "
                f"Received: rules key {key!r} of type {type(key).__name__}"
            )
    return checked


def _compute_policy() -> str:
    config = amp_policy.config()
    return config.policy if config is not None else keras.config.dtype_policy().name


def _is_model_graph(layer: Any) -> bool:
    return isinstance(layer, keras.Sequential) or (
        isinstance(layer, keras.Model) and hasattr(layer, "_nodes_by_depth")
    )


def _graph(model: keras.Model) -> tuple[list, dict, dict, list, list]:
    """Layers in order, predecessors, successors, input-fed and output-producing layers.

    Uses Keras 3.15 internals (`_nodes_by_depth`, `Node.parent_nodes`, `_keras_history`), the
    only record of a functional model's graph; tests/test_keras_guards_recipes.py guards them.
    """
    if isinstance(model, keras.Sequential):
        layers = [l for l in model.layers if not isinstance(l, keras.layers.InputLayer)]
        preds = {id(l): [p] for p, l in zip(layers, layers[1:])}
        succs = {id(p): [l] for p, l in zip(layers, layers[1:])}
        return layers, preds, succs, layers[:1], layers[-1:]
    preds: dict[int, list] = {}
    succs: dict[int, list] = {}
    for nodes in model._nodes_by_depth.values():
        for node in nodes:
            op = node.operation
            for parent in node.parent_nodes:
                if not isinstance(parent.operation, keras.layers.InputLayer):
                    preds.setdefault(id(op), []).append(parent.operation)
                    succs.setdefault(id(parent.operation), []).append(op)
    layers = [l for l in model.layers if not isinstance(l, keras.layers.InputLayer)]
    firsts = [
        l for l in layers
        if any(isinstance(p.operation, keras.layers.InputLayer) for n in l._inbound_nodes for p in n.parent_nodes)
    ]
    lasts = []
    for tensor in keras.tree.flatten(model.outputs):
        op = tensor._keras_history.operation
        if op not in lasts and not isinstance(op, keras.layers.InputLayer):
            lasts.append(op)
    return layers, preds, succs, firsts, lasts


def _region(model: keras.Model, first: bool) -> set[int]:
    """ids of the leaf layers from the inputs (first) or outputs (not first) up to the first weighted layer."""
    _, preds, succs, firsts, lasts = _graph(model)
    step = succs if first else preds
    found: set[int] = set()
    stack, seen = list(firsts if first else lasts), set()
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if _is_model_graph(layer):
            found |= _region(layer, first)
            if layer.weights:
                continue
        else:
            found.add(id(layer))
            if layer.weights:
                continue
        stack.extend(step.get(id(layer), []))
    return found


def _leaves(model: keras.Model, prefix: str = "") -> list[tuple[str, keras.layers.Layer]]:
    """(path, layer) for every layer clone_model(recursive=True) passes to clone_function."""
    out = []
    for layer in _graph(model)[0]:
        path = f"{prefix}{layer.name}"
        if _is_model_graph(layer):
            out.extend(_leaves(layer, prefix=f"{path}/"))
        else:
            out.append((path, layer))
    return out


def _replacement(layer: keras.layers.Layer) -> str | None:
    """Name of the keras_amp class to rebuild `layer` (or its Bidirectional RNNs) as, or None."""
    # Exact class only: a user's subclass of MultiHeadAttention carries code a swap would drop.
    if isinstance(layer, keras.layers.Bidirectional):
        inner = {type(layer.forward_layer), type(layer.backward_layer)}
        cls = _REPLACEMENTS.get(inner.pop()) if len(inner) == 1 else None
    else:
        cls = _REPLACEMENTS.get(type(layer))
    return cls.__name__ if cls else None


def _retarget_wrapped(config: dict, policy: keras.DTypePolicy, cls: type | None) -> None:
    """Gives the layers serialized inside a wrapper's config the wrapper's policy (and class).

    A wrapper (TimeDistributed, Bidirectional) rebuilds its inner layers from their own configs,
    dtype included, so setting only the wrapper's policy would leave them computing as before.
    """
    for key in ("layer", "backward_layer"):
        inner = config.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("config"), dict):
            inner["config"]["dtype"] = keras.saving.serialize_keras_object(policy)
            if cls is not None:
                inner.update(
                    module=cls.__module__,
                    class_name=cls.__name__,
                    registered_name=keras.saving.get_registered_name(cls),
                )


def _recipe_decision(recipe: str, layer, is_first: bool, is_last: bool, compute: str) -> tuple[str, str, str | None]:
    if recipe == "cnn":
        if is_first:
            return FLOAT32, "cnn: first layer", None
        if is_last:
            return FLOAT32, "cnn: last layer", None
        if isinstance(layer, CONV_LAYERS):
            return compute, "cnn: convolution", None
        return compute, "cnn: compute dtype", None
    if is_last:
        return FLOAT32, "transformer: output head" if recipe == "transformer" else "rnn: sequence output layer", None
    if recipe == "transformer" and isinstance(layer, keras.layers.MultiHeadAttention):
        return compute, "transformer: attention (scores and softmax float32)", _replacement(layer)
    if recipe == "rnn" and isinstance(layer, (keras.layers.LSTM, keras.layers.GRU, keras.layers.Bidirectional)):
        return compute, "rnn: recurrence (gates and cell state float32)", _replacement(layer)
    return compute, f"{recipe}: compute dtype", None


def _plan(model: Any, recipe: str, rules: Any) -> tuple[RecipePlan, dict[int, LayerPolicy]]:
    _check_recipe(recipe)
    checked_rules = _check_rules(rules)
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model of type {type(model).__name__}")
    if not _is_model_graph(model):
        raise TypeError(
            "apply_recipe needs a Sequential or functional model: a subclassed model's layer graph is "
            f"not known to Keras, so it cannot be cloned. Received: model of type {type(model).__name__}. "
            "Build its layers with `dtype=` / keras_amp.layers, or wrap its layers in a functional model."
        )
    if not model.built:
        raise ValueError(
            f"`model` must be built (give it an Input or call it once). Received: model={model.name!r}, built=False"
        )
    compute = _compute_policy()
    firsts, lasts = _region(model, first=True), _region(model, first=False)
    by_id: dict[int, LayerPolicy] = {}
    used_rules: set[int] = set()
    for path, layer in _leaves(model):
        policy, reason, swap = _recipe_decision(recipe, layer, id(layer) in firsts, id(layer) in lasts, compute)
        kind = op_kind(layer)
        if kind is not None:
            policy, reason = FLOAT32, f"deny list: {kind}"
            swap = _replacement(layer) if isinstance(layer, keras.layers.Softmax) else swap
        for i, (key, rule_policy) in enumerate(checked_rules):
            if isinstance(key, type):
                hit = isinstance(layer, key)
            else:
                hit = bool(key.fullmatch(layer.name) or key.fullmatch(path))
            if hit:
                used_rules.add(i)
                rule_name = key.__name__ if isinstance(key, type) else key.pattern
                if isinstance(layer, amp_layers.OutputHead):
                    logging.warning(
                        "apply_recipe: rule %r skipped for %r: keras_amp.layers.OutputHead is a float32 island",
                        rule_name, path,
                    )
                    continue
                policy, swap = rule_policy, None
                reason = f"rule {rule_name!r}"
        if isinstance(layer, amp_layers.OutputHead):
            # OutputHead accepts only a float32 policy, whatever its recipe role or the rules.
            policy, reason, swap = FLOAT32, "float32 island", None
        by_id[id(layer)] = LayerPolicy(path, type(layer).__name__, policy, reason, swap)
    unused = [rules_key for i, rules_key in enumerate(rules or {}) if i not in used_rules]
    if unused:
        logging.warning("apply_recipe: rules matched no layer of %r: %r", model.name, unused)
    plan = RecipePlan(recipe=recipe, compute_policy=compute, layers=tuple(by_id.values()))
    paths = [e.path for e in plan.layers]
    if len(set(paths)) != len(paths):
        raise ValueError(f"apply_recipe needs unique layer paths. Received: paths {paths}")
    return plan, by_id


def plan_recipe(model: keras.Model, recipe: str, rules: Mapping[Any, Any] | None = None) -> RecipePlan:
    """The per-layer policies `apply_recipe(model, recipe, rules)` would set; changes nothing."""
    return _plan(model, recipe, rules)[0]


def apply_recipe(model: keras.Model, recipe: str, rules: Mapping[Any, Any] | None = None) -> keras.Model:
    """Returns a copy of `model` with per-layer dtype policies from a recipe, weights preserved.

    Args:
        model: A built Sequential or functional `keras.Model` (nested ones included). Subclassed
            models raise a TypeError: their layer graph cannot be cloned.
        recipe: String. "cnn", "transformer" or "rnn" (see the module docstring).
        rules: Mapping or None. User overrides applied after the recipe and the deny list:
            keys are `keras.layers.Layer` subclasses (isinstance) or regexes matched in full
            against a layer's name or path; values are policy names ("float32",
            "mixed_bfloat16", ...) or `keras.DTypePolicy`. Later rules win; a ruled layer keeps
            its own class.

    Returns:
        A new model (the input is untouched). The compute dtype is that of `keras_amp.config()`
        (or Keras's global policy when keras_amp is not enabled); float32 islands get "float32".
        If `model` was compiled, the copy is compiled from the same compile config with fresh
        optimizer state, so apply a recipe before training.

    Example:
        >>> keras_amp.enable("mixed_bfloat16")
        >>> model = keras_amp.apply_recipe(model, "transformer", rules={r"logits": "float32"})
    """
    # A model built before enable() is fine here: every layer gets its policy from the plan.
    plan, by_id = _plan(model, recipe, rules)
    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] = []

    def clone_function(layer):
        entry = by_id[id(layer)]
        swap = getattr(amp_layers, entry.replace_with) if entry.replace_with else None
        policy = keras.DTypePolicy(entry.policy)
        config = layer.get_config()
        config["dtype"] = policy
        cls = swap or type(layer)
        # keras_amp's Float32 wrapper decides its inner layer's precision itself.
        if isinstance(layer, (keras.layers.Wrapper, keras.layers.Bidirectional)) and not isinstance(
            layer, amp_layers.Float32
        ):
            _retarget_wrapped(config, policy, swap)
            cls = type(layer)
        try:
            clone = cls.from_config(config)
        except Exception as e:
            raise ValueError(
                "apply_recipe rebuilds each layer from its get_config(); this layer could not be. "
                f"Received: layer {entry.path!r} of class {type(layer).__name__} ({e})"
            ) from e
        pairs.append((layer, clone))
        return clone

    input_tensors = None
    if not isinstance(model, keras.Sequential):
        # Keep input names (clone_model would name the new inputs after their KerasTensors).
        input_tensors = keras.tree.map_structure(
            lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t._keras_history.operation.name),
            model.input,
        )
    clone = keras.models.clone_model(
        model, input_tensors=input_tensors, clone_function=clone_function, recursive=True
    )
    for old, new in pairs:
        old_weights = old.weights
        new_weights = new.weights
        if [tuple(w.shape) for w in old_weights] != [tuple(w.shape) for w in new_weights]:
            raise RuntimeError(
                f"apply_recipe: layer {old.name!r} ({type(old).__name__} -> {type(new).__name__}) "
                "changed its weight structure; weights cannot be carried over."
            )
        for src, dst in zip(old_weights, new_weights):
            dst.assign(src.value)
    if model.compiled and not clone.compiled:
        clone.compile_from_config(model.get_compile_config())
    # Its policies are deliberate: warn_if_built_before_enable does not flag a recipe-made model
    # whose heavy layers all ended up float32.
    clone._keras_amp_recipe = recipe
    logging.info("apply_recipe %r on %r:\n%s", recipe, model.name, plan)
    return clone

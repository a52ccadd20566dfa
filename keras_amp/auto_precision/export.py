"""`export_for_inference()`: a copy that runs in float16/bfloat16 for serving, float32 islands kept.

Training keeps float32 master weights (mixed policies); serving needs no master copy. The
export rebuilds the model from its config with every layer on the pure 16-bit policy
("float16"/"bfloat16": 16-bit variables and compute), except the layers that compute in float32
in the trained model (the recipe's or the search's float32 islands), and copies the weights,
rounded once. Weight memory halves for the 16-bit layers only: the copy's weights take
`0.5 + 0.5 * s` of the source's float32 master bytes, where `s` is the float32 layers' share of
them (a "cnn"-recipe model keeps its last layer float32: a 1000-class head holds 40% of
MobileNetV3Small's weights, so its export keeps 0.70 of them). The masters are counted as float32
where `keras_amp.memory` stores them in 16 bits (frozen and `LeanAdam` weights), so the ratio
reads the same before and after training.

Islands are found by place, not by name: a layer path selects the serialized layer at that path,
and a rebuilt subclassed model's layers (new auto-generated names) are paired with the source's by
their place in the layer tree. A float32 layer the copy cannot keep float32 is an error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import keras
import numpy as np

from keras_amp import model_graph, validation
from keras_amp.dtypes import LOW_PRECISION as DTYPES
from keras_amp.auto_precision import model_policies
from keras_amp.memory import frozen, storage


@dataclasses.dataclass(frozen=True)
class InferenceExport:
    """The serving copy and what it cost.

    Args:
        model: The exported `keras.Model` (save it with `.save("m.keras")` or `.export(dir)`).
        dtype: String. The 16-bit dtype of the copy.
        float32_layers: Tuple of the copy's layer paths kept in float32.
        weight_bytes_before: Int. Bytes of the source model's weights as the float32 masters it
            holds: a weight `keras_amp.memory` stores in 16 bits (a frozen weight, a `LeanAdam`
            weight) in a layer that keeps float32 variables counts 4 bytes: the same figure before
            and after training.
        weight_bytes_after: Int. Bytes of the copy's weights.
        weight_bytes_float32: Int. Bytes of the copy's weights kept in float32 (its float32 layers').
    """

    model: keras.Model
    dtype: str
    float32_layers: tuple[str, ...]
    weight_bytes_before: int
    weight_bytes_after: int
    weight_bytes_float32: int = 0

    @property
    def memory_ratio(self) -> float:
        """weight_bytes_after / weight_bytes_before: 0.5 when every weight went to 16 bits, more by half
        the float32 layers' share of the weights."""
        return self.weight_bytes_after / max(self.weight_bytes_before, 1)


def weight_bytes(model: keras.Model) -> int:
    """Bytes held by the model's weights as stored now (a weight stored in 16 bits counts 2 per value)."""
    validation.check_type("model", model, keras.Model, "a keras.Model")
    return storage.variable_bytes(model.weights)


def _master_bytes(model: keras.Model) -> int:
    """Bytes of `model`'s weights, a 16-bit-stored one of a layer with float32 variables as its float32 master."""
    # Training under a mixed policy stores some float32 masters in 16 bits (frozen weights, LeanAdam's
    # weights beside their compensation); the model still stands for float32 weights, so the export is
    # measured against those: the same figure before and after `fit`.
    owners = {id(v): layer for layer, v, _ in frozen.owned_weights(model)}
    narrowed, kept = [], []
    for v in model.weights:
        layer = owners.get(id(v))
        variable_dtype = None if layer is None else layer.dtype_policy.variable_dtype
        stored_16bit = storage.storage_dtype(v) in DTYPES
        (narrowed if stored_16bit and variable_dtype == "float32" else kept).append(v)
    return storage.variable_bytes(kept) + 4 * sum(int(np.prod(v.shape)) for v in narrowed)


def _retarget(config: Any, islands: set[str], paths: set[str], dtype: str, prefix: str = "",
              island: bool = False) -> None:
    """Sets the "dtype" of every serialized layer under `config` by its path: float32 islands keep float32.

    A serialized layer's path is the chain of the names it sits in, as `model_graph.walk` names it
    ("enc1/proj"); one the walk does not name (say the layer a wrapper serializes) follows the layer
    it sits in (`island`).
    """
    if isinstance(config, list):
        for item in config:
            _retarget(item, islands, paths, dtype, prefix, island)
        return
    if not isinstance(config, dict):
        return
    inner = config.get("config")
    if config.get("class_name") is not None and isinstance(inner, dict) and isinstance(inner.get("name"), str):
        path = prefix + inner["name"]
        island = path in islands if path in paths else island
        # InputLayers keep their dtype: the serving signature takes what the model took.
        if "dtype" in inner and config["class_name"] != "InputLayer":
            inner["dtype"] = "float32" if island else dtype
        prefix = f"{path}/"
    for value in config.values():
        _retarget(value, islands, paths, dtype, prefix, island)


def _paired(source: keras.Model, copy: keras.Model) -> dict[str, keras.layers.Layer]:
    """`source`'s walk path -> the layer of `copy` at the same place in the layer tree, of the same class.

    Matched by place, not by name: a rebuilt subclassed model's auto-named layers get new names
    ("dense_3" for "dense"). Under a parent, children are paired in order up to the first whose
    classes differ; a layer `copy` does not have yet (one created in `build()`) has no pair.
    """
    pairs: dict[str, keras.layers.Layer] = {}
    seen: set[int] = set()

    def visit(src, dst, prefix):
        for s, d in zip(model_graph.children(src), model_graph.children(dst)):
            if type(s) is not type(d):
                return  # the rest of this level is out of step
            if id(s) in seen:
                continue
            seen.add(id(s))
            pairs[f"{prefix}{s.name}"] = d
            visit(s, d, f"{prefix}{s.name}/")

    visit(source, copy, "")
    return pairs


def export_for_inference(
    model: keras.Model, dtype: str = "bfloat16", *, keep_float32: Iterable[str] | None = None, sample: Any = None
) -> InferenceExport:
    """A serving copy of `model` in `dtype`, keeping its float32 layers float32.

    Args:
        model: A built `keras.Model` whose config round-trips (`get_config` / `from_config`).
        dtype: String. "bfloat16" (default) or "float16".
        keep_float32: Iterable of layer-path regexes or None. The layers to keep float32 (a regex
            also matches a layer's own name); None: every layer that computes in float32 in `model`
            (its islands).
        sample: Inputs or None. For subclassed models (whose sublayers are not in their
            config), a batch to build the copy on; functional and Sequential models need none.

    Returns:
        An `InferenceExport`; the source model is unchanged.

    Raises:
        ValueError: when a float32 layer has no float32 counterpart in the copy (a layer created in
            `build()` or `call()`, or one whose config leaves out its dtype).
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    dtype = validation.check_choice("dtype", dtype, DTYPES)
    if not model.built:
        raise ValueError(f"`model` must be built. Received: model={model.name!r}, built=False")
    layers = model_policies.layers_by_path(model)
    if keep_float32 is None:
        islands = {p for p, l in layers.items() if l.compute_dtype == "float32"}
    else:
        # A regex matches a path or a layer name; the error's examples name each once.
        names = list(dict.fromkeys([*layers, *(l.name for l in layers.values())]))
        patterns = validation.check_regexes("keep_float32", keep_float32, names)
        islands = {p for p, l in layers.items() if any(r.fullmatch(p) or r.fullmatch(l.name) for r in patterns)}
    config = keras.saving.serialize_keras_object(model)
    if "dtype" in config["config"]:
        config["config"]["dtype"] = dtype
    _retarget(config["config"], islands, set(layers), dtype)
    if not model_graph.is_graph(model):
        # A subclassed model's sublayers are not in its config: rebuild it unbuilt, set its islands
        # before the variables exist, then build it on `sample`.
        config.pop("build_config", None)
    saved_global = keras.config.dtype_policy()
    try:
        # Sublayers a config does not list (subclassed models) take the global policy at construction.
        keras.config.set_dtype_policy(dtype)
        copy = keras.saving.deserialize_keras_object(config)
        if not copy.built:
            if sample is None:
                raise ValueError(
                    f"export_for_inference: model {model.name!r} is not rebuilt from its config (a subclassed "
                    "model): pass `sample=` a batch of inputs to build the copy on."
                )
            for path, layer in _paired(model, copy).items():
                if path in islands:
                    layer.dtype_policy = keras.DTypePolicy("float32")
            copy(sample)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(
            f"export_for_inference rebuilds the model from its config, and model {model.name!r} "
            f"({type(model).__name__}) could not be rebuilt: {e}"
        ) from e
    finally:
        keras.config.set_dtype_policy(saved_global)
    pairs = _paired(model, copy)
    lost = sorted(p for p in islands if p not in pairs or pairs[p].compute_dtype != "float32")
    if lost:
        raise ValueError(
            f"export_for_inference must keep the float32 layers of model {model.name!r} in float32, and its "
            f"rebuilt copy has no float32 layer of the same class at their place (a layer created in build() "
            f"or call(), or whose get_config() leaves out its dtype). Received: float32 layers {lost}"
        )
    src, dst = model.weights, copy.weights
    if [tuple(w.shape) for w in src] != [tuple(w.shape) for w in dst]:
        raise ValueError(
            f"export_for_inference: the rebuilt copy of {model.name!r} has a different weight structure "
            f"({len(src)} vs {len(dst)} weights); its get_config() does not describe the model fully."
        )
    for s, d in zip(src, dst):
        master = storage.lean_master(s)  # a LeanAdam weight: its float32 master, not its 16-bit half
        d.assign(keras.ops.cast(s.value if master is None else master, d.dtype))
    kept = tuple(p for p, l in model_policies.layers_by_path(copy).items() if l.compute_dtype == "float32")
    float32_bytes = storage.variable_bytes([w for w in copy.weights if w.dtype == "float32"])
    return InferenceExport(copy, dtype, kept, _master_bytes(model), weight_bytes(copy), float32_bytes)

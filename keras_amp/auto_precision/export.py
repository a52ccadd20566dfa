"""`export_for_inference()`: a copy that runs in float16/bfloat16 for serving, float32 islands kept.

Training keeps float32 master weights (mixed policies); serving needs no master copy. The
export rebuilds the model from its config with every layer on the pure 16-bit policy
("float16"/"bfloat16": 16-bit variables and compute), except the layers that compute in float32
in the trained model (the recipe's or the search's float32 islands), and copies the weights,
rounded once. Weight memory halves for the 16-bit layers only: the copy's weights take
`0.5 + 0.5 * s` of the source's bytes, where `s` is the float32 layers' share of them (a
"cnn"-recipe model keeps its last layer float32: a 1000-class head holds 40% of MobileNetV3Small's
weights, so its export keeps 0.70 of them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import keras
from keras_amp import model_graph, validation
from keras_amp.dtypes import LOW_PRECISION as DTYPES
from keras_amp.auto_precision import model_policies



@dataclasses.dataclass(frozen=True)
class InferenceExport:
    """The serving copy and what it cost.

    Args:
        model: The exported `keras.Model` (save it with `.save("m.keras")` or `.export(dir)`).
        dtype: String. The 16-bit dtype of the copy.
        float32_layers: Tuple of paths kept in float32.
        weight_bytes_before: Int. Bytes of the source model's weights.
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
    """Bytes held by the model's weights."""
    validation.check_type("model", model, keras.Model, "a keras.Model")
    return sum(keras.ops.convert_to_numpy(w.value).nbytes for w in model.weights)


def _retarget(config: Any, float32_names: set[str], dtype: str) -> None:
    """Sets the "dtype" of every serialized layer in `config`: float32 islands keep float32."""
    if isinstance(config, list):
        for item in config:
            _retarget(item, float32_names, dtype)
        return
    if not isinstance(config, dict):
        return
    inner = config.get("config")
    # InputLayers keep their dtype: the serving signature takes what the model took.
    if (config.get("class_name") not in (None, "InputLayer") and isinstance(inner, dict)
            and "dtype" in inner and "name" in inner):
        inner["dtype"] = "float32" if inner["name"] in float32_names else dtype
    for value in config.values():
        _retarget(value, float32_names, dtype)


def export_for_inference(
    model: keras.Model, dtype: str = "bfloat16", *, keep_float32: Iterable[str] | None = None, sample: Any = None
) -> InferenceExport:
    """A serving copy of `model` in `dtype`, keeping its float32 layers float32.

    Args:
        model: A built `keras.Model` whose config round-trips (`get_config` / `from_config`).
        dtype: String. "bfloat16" (default) or "float16".
        keep_float32: Iterable of layer-path regexes or None. The layers to keep float32; None:
            every layer that computes in float32 in `model` (its islands).
        sample: Inputs or None. For subclassed models (whose sublayers are not in their
            config), a batch to build the copy on; functional and Sequential models need none.

    Returns:
        An `InferenceExport`; the source model is unchanged.
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    dtype = validation.check_choice("dtype", dtype, DTYPES)
    if not model.built:
        raise ValueError(f"`model` must be built. Received: model={model.name!r}, built=False")
    layers = model_policies.layers_by_path(model)
    if keep_float32 is None:
        islands = {p for p, l in layers.items() if l.compute_dtype == "float32"}
    else:
        # A regex matches a path or a layer name.
        patterns = validation.check_regexes("keep_float32", keep_float32, [*layers, *(l.name for l in layers.values())])
        islands = {p for p, l in layers.items() if any(r.fullmatch(p) or r.fullmatch(l.name) for r in patterns)}
    float32_names = {layers[p].name for p in islands}
    config = keras.saving.serialize_keras_object(model)
    _retarget(config, float32_names, dtype)
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
            copy_layers = model_policies.layers_by_path(copy)
            for path in islands:
                if path in copy_layers:
                    copy_layers[path].dtype_policy = keras.DTypePolicy("float32")
            copy(sample)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(
            f"export_for_inference rebuilds the model from its config, and model {model.name!r} "
            f"({type(model).__name__}) could not be rebuilt: {e}"
        ) from e
    finally:
        keras.config.set_dtype_policy(saved_global)
    src, dst = model.weights, copy.weights
    if [tuple(w.shape) for w in src] != [tuple(w.shape) for w in dst]:
        raise ValueError(
            f"export_for_inference: the rebuilt copy of {model.name!r} has a different weight structure "
            f"({len(src)} vs {len(dst)} weights); its get_config() does not describe the model fully."
        )
    for s, d in zip(src, dst):
        d.assign(keras.ops.cast(s.value, d.dtype))
    kept = tuple(p for p, l in model_policies.layers_by_path(copy).items() if l.compute_dtype == "float32")
    float32_bytes = sum(keras.ops.convert_to_numpy(w.value).nbytes for w in copy.weights if w.dtype == "float32")
    return InferenceExport(copy, dtype, kept, weight_bytes(model), weight_bytes(copy), float32_bytes)

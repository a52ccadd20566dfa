"""Per-layer policies of a built model, read and set in place (shared by search, fallback, schedule)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import keras

from keras_amp import model_graph
from keras_amp.op_rules.matmul import Matmul16DTypePolicy, policy_from_name

FLOAT32 = "float32"


def layers_by_path(model: keras.Model) -> dict[str, keras.layers.Layer]:
    """Every layer below `model` by its `model_graph.walk` path ("block/dense"), in model order."""
    return dict(model_graph.walk(model))


def policy_names(model: keras.Model) -> dict[str, str]:
    """path -> dtype policy name for every layer."""
    return {path: layer.dtype_policy.name for path, layer in layers_by_path(model).items()}


def set_policies(model: keras.Model, policies: dict[str, str]) -> None:
    """Sets each named layer's dtype policy in place and drops the model's traced functions.

    Variables are untouched (mixed and float32 policies both keep float32 variables), so
    weights and optimizer state carry over; the next `fit`/`evaluate`/`predict` traces anew.
    """
    layers = layers_by_path(model)
    unknown = sorted(set(policies) - set(layers))
    if unknown:
        raise ValueError(
            f"Unknown layer path(s) for model {model.name!r}: {unknown}. "
            f"Allowed: the paths of its layers, e.g. {list(layers)[:5]}"
        )
    for path, name in policies.items():
        if layers[path].dtype_policy.name != name:
            layers[path].dtype_policy = policy_from_name(name)
    reset_functions(model)


def float32_policies(model: keras.Model, paths) -> dict[str, str]:
    """{path: "float32"} for `paths`, and for every layer above or below one of them whose policy
    is a `Matmul16DTypePolicy`: that policy's matmuls reach the layers inside it (an RNN's float32
    cell), so a layer there is only float32 once the whole recurrence is."""
    layers = layers_by_path(model)
    out = {}
    for path in paths:
        out[path] = FLOAT32
        for other, layer in layers.items():
            related = path.startswith(other + "/") or other.startswith(path + "/")
            if related and isinstance(layer.dtype_policy, Matmul16DTypePolicy):
                out[other] = FLOAT32
    return out


def reset_functions(model: keras.Model) -> None:
    """Forgets traced train/test/predict functions so the next call retraces with the new policies."""
    for attr in ("train_function", "test_function", "predict_function"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)


@contextlib.contextmanager
def temporary_policies(model: keras.Model) -> Iterator[None]:
    """Restores every layer's policy (and drops traced functions) on exit."""
    saved = policy_names(model)
    try:
        yield
    finally:
        set_policies(model, saved)

"""Setting layer dtype policies in place: the one setter recipes, search, fallback and schedule use.

`set_in_place(changes)` sets every change or none. For each layer it

- keeps what the layer's policy carries besides dtypes: a layer quantized with Keras's
  `quantize("float8")` (or "int8"/"int4") keeps its quantization under the new compute dtype
  (`float8_from_float32`), so its scale and amax-history variables stay in use. Keras's own
  setter, given "float32", would silently drop it. A change that cannot keep it (a
  `Matmul16DTypePolicy`, or a quantization mode whose policy this module cannot rebuild, such
  as GPTQ's) is refused with a ValueError naming the layer;
- refreshes what the layer cast to its compute dtype when it was built (`Normalization`'s mean
  and variance), so it does not keep 16-bit-rounded statistics after a change;
- on any failure puts every layer already changed back (policy and refresh), then raises.
"""

from __future__ import annotations

from typing import Any, Iterable

import keras

from keras_amp import validation
from keras_amp.matmul16_policy import Matmul16DTypePolicy, policy_from_name

# Quantization modes whose policy is rebuilt from (mode, source policy) alone (Keras 3.15.1).
_REBUILT_MODES = ("int8", "int4", "float8")


class PolicyChangeError(ValueError):
    """A layer refused a policy change; `path` names it. Every change was rolled back."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def target_policy(layer: keras.layers.Layer, path: str, policy: str | keras.DTypePolicy) -> keras.DTypePolicy:
    """The policy to give `layer` for the requested `policy` ("float32", "mixed_bfloat16", ..., a
    `keras.DTypePolicy`), keeping the layer's quantization. Raises PolicyChangeError when it
    cannot be kept."""
    new = policy_from_name(policy) if isinstance(policy, str) else policy
    validation.check_type("policy", new, keras.DTypePolicy, "a dtype policy name or a keras.DTypePolicy")
    old = layer.dtype_policy
    mode = getattr(old, "quantization_mode", None)
    if mode is None or new.quantization_mode is not None:
        return new
    if isinstance(new, Matmul16DTypePolicy) or mode not in _REBUILT_MODES:
        raise PolicyChangeError(
            f"Layer {path!r} ({type(layer).__name__}) is quantized ({old.name!r}); setting its policy to "
            f"{new.name!r} would drop the {mode} quantization and leave its scale variables unused. "
            f"Allowed for a {mode} layer: 'float32', 'mixed_bfloat16' or 'mixed_float16' (the "
            f"quantization is kept: '{mode}_from_<policy>'), or leave it out of the change.", path)
    if mode == "float8":
        return keras.dtype_policies.QuantizedFloat8DTypePolicy(
            mode, source_name=new.name, amax_history_length=old.amax_history_length)
    return keras.dtype_policies.QuantizedDTypePolicy(mode, source_name=new.name)


def refresh_build_time_state(layer: Any) -> None:
    """Recomputes what `layer` cast to its compute dtype when it was built (Keras 3.15.1)."""
    # Normalization casts its mean and variance to the compute dtype in build() (given mean and
    # variance) or finalize_state() (adapted): recompute them from the float32 originals.
    if isinstance(layer, keras.layers.Normalization) and layer.built:
        if layer.input_mean is not None:
            layer.build_from_config(layer.get_build_config())
        else:
            layer.finalize_state()


def set_in_place(changes: Iterable[tuple[str, keras.layers.Layer, str | keras.DTypePolicy]]) -> list[str]:
    """Sets each `(path, layer, policy)`, all or nothing; returns the paths whose policy changed.

    A layer whose policy already has that name is left alone. Raises PolicyChangeError (a
    ValueError) naming the layer that refused, after rolling back every change made.
    """
    done: list[tuple[str, keras.layers.Layer, keras.DTypePolicy]] = []
    try:
        for path, layer, policy in changes:
            new = target_policy(layer, path, policy)
            if layer.dtype_policy.name == new.name:
                continue
            old = layer.dtype_policy
            try:
                layer.dtype_policy = new
            except Exception as e:  # a third-party layer may define dtype_policy without a setter
                raise PolicyChangeError(
                    f"Could not set the dtype policy of layer {path!r} ({type(layer).__name__}) to "
                    f"{new.name!r}: {type(e).__name__}: {e}", path) from e
            done.append((path, layer, old))
            refresh_build_time_state(layer)
    except BaseException:
        for _, layer, old in reversed(done):
            layer.dtype_policy = old
            refresh_build_time_state(layer)
        raise
    return [path for path, _, _ in done]

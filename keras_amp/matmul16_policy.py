"""`Matmul16DTypePolicy`: float32 layers whose matmuls run with 16-bit operands, and its saved form.

A layer with a `Matmul16DTypePolicy` is a float32 layer (compute and variable dtype float32:
its gates, nonlinearities, carried state, bias and output are float32) whose matmuls run with
16-bit operands while keras_amp's op rules are installed (the rule: `keras_amp.op_rules.matmul`).
It is how the "rnn" recipe keeps a stock LSTM/GRU/SimpleRNN's gates and state in float32, in
place, at the speed of its 16-bit matmuls. The policy is part of the dtype vocabulary, on the
floor beside `policy.py`, because recipes, the policy setter, search and plotting name it
without needing the rule.

Without the rules (keras_amp disabled, or the model loaded in a process that never enabled it)
such a layer is a plain float32 layer: slower, never less precise. The policy is saved so that
stock Keras reads it as "float32" and keras_amp restores its own: `{"class_name": "DTypePolicy",
"config": {"name": "float32"}, "registered_name": "keras_amp>matmul16_from_<source_name>"}`.
Keras resolves a dtype policy's `class_name` among its own policies unless the registered name
is a registered object, so a process that never imported keras_amp builds a float32
`DTypePolicy` from it, and one that did finds the per-source class registered under that name.
It loads where the layer's `from_config` passes its config to the constructor as it is (LSTM,
GRU, SimpleRNN, RNN, Bidirectional, ConvLSTM). Keras 3.15's `Operation.from_config`, which most
layers and every RNN cell use, turns a non-quantized policy into its name, which Keras cannot
parse back: so the "rnn" recipe gives the policy to RNN layers and leaves their cells float32,
and the rule also applies inside such a layer. Files saved before this format
(`keras_amp>Matmul16DTypePolicy`, config `{"source_name": ...}`) still load with keras_amp.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_amp import validation

SOURCE_POLICIES = ("mixed_bfloat16", "mixed_float16")
PREFIX = "matmul16_from_"


@keras.saving.register_keras_serializable(package="keras_amp")
class Matmul16DTypePolicy(keras.DTypePolicy):
    """A float32 policy whose layers' matmuls run in the 16-bit dtype of `source_name`.

    Compute and variable dtypes are float32; `matmul_dtype` is "bfloat16" for
    "mixed_bfloat16" and "float16" for "mixed_float16". The name is
    `"matmul16_from_<source_name>"` (as Keras names quantized policies).

    Args:
        source_name: String. "mixed_bfloat16" or "mixed_float16".

    `keras_amp.apply_recipe(model, "rnn")` sets it where it belongs (RNN layers; their cells
    float32 or the same policy). By hand, set the RNN and its cell: a cell left at a 16-bit
    policy computes its gates in 16 bits.

    Example:
        >>> keras_amp.enable("mixed_bfloat16")
        >>> lstm.dtype_policy = keras_amp.Matmul16DTypePolicy("mixed_bfloat16")
        >>> lstm.cell.dtype_policy = "float32"   # float32 gates; matmuls bfloat16 under the LSTM
    """

    def __new__(cls, source_name: str = "mixed_bfloat16"):
        # Every instance is of the per-source class that saves as float32 (see `_saved_as_float32`).
        if cls is Matmul16DTypePolicy and isinstance(source_name, str) and source_name in _SAVED:
            cls = _SAVED[source_name]
        return super().__new__(cls)

    def __init__(self, source_name: str = "mixed_bfloat16"):
        validation.check_choice("source_name", source_name, SOURCE_POLICIES)
        super().__init__("float32")
        self._source_name = source_name
        self._matmul_dtype = self._parse_name(source_name)[0]
        self._name = PREFIX + source_name

    @property
    def matmul_dtype(self) -> str:
        """The 16-bit dtype of the layer's matmul operands ("bfloat16" or "float16")."""
        return self._matmul_dtype

    @property
    def source_name(self) -> str:
        return self._source_name

    def get_config(self) -> dict[str, Any]:
        return {"source_name": self._source_name}

    def __repr__(self) -> str:
        return f'<Matmul16DTypePolicy "{self._name}">'


def _saved_as_float32(source_name: str) -> type:
    """The class of `Matmul16DTypePolicy(source_name)` instances: saved as a float32 `DTypePolicy`.

    Keras writes `class_name` from the class's `__name__` and `registered_name` from the
    registry, and reads a dtype policy by `class_name` among its own unless `registered_name` is
    registered: so this class is named "DTypePolicy", its config is stock `DTypePolicy`'s
    (`{"name": "float32"}`), and the source policy is in its registered name
    ("keras_amp>matmul16_from_<source_name>"). Without keras_amp the layer loads as float32.
    """

    def get_config(self) -> dict[str, Any]:
        return {"name": "float32"}  # what stock `DTypePolicy(**config)` reads

    def from_config(cls, config: dict[str, Any]) -> Matmul16DTypePolicy:
        return Matmul16DTypePolicy(cls.saved_source_name)

    qualname = "_Matmul16From" + "".join(part.capitalize() for part in source_name.split("_"))
    cls = type("DTypePolicy", (Matmul16DTypePolicy,), {
        "__module__": __name__, "__qualname__": qualname, "__doc__": Matmul16DTypePolicy.__doc__,
        "saved_source_name": source_name, "get_config": get_config,
        "from_config": classmethod(from_config)})
    globals()[qualname] = cls  # where pickle looks it up
    return keras.saving.register_keras_serializable(package="keras_amp", name=PREFIX + source_name)(cls)


_SAVED = {source: _saved_as_float32(source) for source in SOURCE_POLICIES}


def policy_from_name(name: str) -> keras.DTypePolicy:
    """The policy named `name`: a `Matmul16DTypePolicy` for "matmul16_from_...", else Keras's."""
    if isinstance(name, str) and name.startswith(PREFIX):
        return Matmul16DTypePolicy(name[len(PREFIX):])
    return keras.DTypePolicy(name)


def matmul16_name(compute_policy: str) -> str:
    """The `Matmul16DTypePolicy` name for a mixed compute policy; "float32" for any other."""
    return PREFIX + compute_policy if compute_policy in SOURCE_POLICIES else "float32"

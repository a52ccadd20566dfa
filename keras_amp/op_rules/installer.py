"""Installing the op rules: replace the Keras objects while a 16-bit policy is in force, restore them after.

Keras's public ops (`keras.ops.softmax`, ...) call the TensorFlow backend by attribute at call
time (`backend.nn.softmax(x)`), in eager execution, inside `tf.function` and from each op's
`Operation.call`. The rules replace those backend attributes, so every route reaches them; the
symbolic route (`compute_output_spec`, used while a functional model is built) is replaced too
where a rule changes the output dtype, so symbolic and eager dtypes agree.

Each replacement is written against Keras 3.15.1: it is installed only for Keras 3.15.x and only
when the replaced function's source digest matches `ORIGINAL_DIGESTS`; otherwise that rule is
skipped with an `AmpWarning`, since a rule written for other code could be wrong there. A config
listener, registered once when this module is imported, installs the rules under a 16-bit
compute dtype and removes them otherwise.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
import warnings
from typing import Any, Callable

import keras
from absl import logging
from keras.src.backend.common import name_scope as common_name_scope
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import math as tf_math
from keras.src.backend.tensorflow import nn as tf_nn
from keras.src.backend.tensorflow import numpy as tf_numpy
from keras.src.ops import nn as ops_nn

from keras_amp import policy as amp_policy
from keras_amp import validation
from keras_amp.op_rules.attention import float32_attention, float32_dot_product_attention
from keras_amp.op_rules.float32_ops import (
    float32_batch_normalization,
    float32_input_dtype,
    float32_loss,
    float32_loss_spec,
    float32_probabilities,
    float32_root,
)
from keras_amp.op_rules.lean import (
    lean_batch_normalization,
    lean_gelu,
    lean_layer_normalization,
    lean_moments,
    lean_sparse_categorical_crossentropy,
)
from keras_amp.op_rules.matmul import matmul16
from keras_amp.op_rules.table import (
    DPA,
    MATMUL,
    RSQRT,
    SQRT,
    LOW_PRECISION,
    ORIGINAL_DIGESTS,
    RELIED_ON,
    RULES,
    TARGET_KERAS,
    TF_NN,
    Rule,
)

_MHA = keras.layers.MultiHeadAttention


def _digest(fn: Callable) -> str:
    """sha256 of `inspect.getsource(fn)`, first 16 hex digits (as tests/keras_guard.py)."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


# qualified name -> (owner, attribute, factory(original) -> replacement or None if relied on only).
_TARGETS: dict[str, tuple[Any, str, Callable | None]] = {
    f"{TF_NN}.softmax": (tf_nn, "softmax", float32_probabilities),
    f"{TF_NN}.log_softmax": (tf_nn, "log_softmax", float32_probabilities),
    "keras.src.backend.tensorflow.math.logsumexp": (tf_math, "logsumexp", float32_input_dtype),
    "keras.layers.MultiHeadAttention._compute_attention": (_MHA, "_compute_attention", float32_attention),
    "keras.layers.MultiHeadAttention.call": (_MHA, "call", None),
    f"{TF_NN}.batch_normalization": (
        tf_nn, "batch_normalization", lambda f: lean_batch_normalization(float32_batch_normalization(f))),
    f"{TF_NN}.moments": (tf_nn, "moments", lean_moments),
    "keras.src.ops.nn._layer_normalization": (ops_nn, "_layer_normalization", lean_layer_normalization),
    "keras.src.ops.nn._normalize": (ops_nn, "_normalize", float32_input_dtype),
    "keras.src.backend.tensorflow.numpy.std": (tf_numpy, "std", float32_input_dtype),
    f"{TF_NN}.gelu": (tf_nn, "gelu", lean_gelu),
    f"{TF_NN}.categorical_crossentropy": (tf_nn, "categorical_crossentropy", float32_loss("Softmax")),
    "keras.src.ops.nn.CategoricalCrossentropy.compute_output_spec": (
        ops_nn.CategoricalCrossentropy, "compute_output_spec", float32_loss_spec),
    f"{TF_NN}.sparse_categorical_crossentropy": (
        tf_nn, "sparse_categorical_crossentropy",
        lambda f: lean_sparse_categorical_crossentropy(float32_loss("Softmax")(f))),
    "keras.src.ops.nn.SparseCategoricalCrossentropy.compute_output_spec": (
        ops_nn.SparseCategoricalCrossentropy, "compute_output_spec", float32_loss_spec),
    f"{TF_NN}.binary_crossentropy": (tf_nn, "binary_crossentropy", float32_loss("Sigmoid")),
    "keras.src.ops.nn.BinaryCrossentropy.compute_output_spec": (
        ops_nn.BinaryCrossentropy, "compute_output_spec", float32_loss_spec),
    RSQRT: (tf_math, "rsqrt", float32_root),
    SQRT: (tf_numpy, "sqrt", float32_root),
    DPA: (tf_nn, "_dot_product_attention_xla", float32_dot_product_attention),
    f"{TF_NN}._apply_masks": (tf_nn, "_apply_masks", None),
    MATMUL: (tf_numpy, "matmul", matmul16),
    "keras.layers.Layer.__call__": (keras.layers.Layer, "__call__", None),
    "keras.layers.Layer._open_name_scope": (keras.layers.Layer, "_open_name_scope", None),
    "keras.src.backend.tensorflow.core.name_scope": (tf_core, "name_scope", None),
    "keras.src.backend.common.name_scope.name_scope": (common_name_scope, "name_scope", None),
}


def _own(owner: Any, attr: str) -> Any:
    # A class's own attribute (the plain function), so restoring it restores identity.
    return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


ORIGINALS: dict[str, Callable] = {name: _own(owner, attr) for name, (owner, attr, _) in _TARGETS.items()}
_REPLACEMENTS: dict[str, Callable] = {
    name: factory(ORIGINALS[name]) for name, (_, _, factory) in _TARGETS.items() if factory is not None
}
_lock = threading.RLock()
_installed: str | None = None
_active: list[str] = []  # the qualified names replaced now


def source_digests() -> dict[str, str]:
    """The 16-hex source digest of every original Keras object the rules replace or rely on, now."""
    return {name: _digest(fn) for name, fn in ORIGINALS.items()}


def why_not_installed(rule: Rule) -> str | None:
    """Why `rule`'s override cannot be installed on this Keras, or None when it can."""
    if not keras.__version__.startswith(TARGET_KERAS):
        return (
            f"keras_amp's op rule for {rule.op} targets Keras {TARGET_KERAS}x; Keras {keras.__version__} "
            "is installed, so it is not installed (update keras_amp.op_rules and its guard rows)."
        )
    names = rule.targets + tuple(n for t in rule.targets for n in RELIED_ON.get(t, ()))
    changed = [n for n in names if _digest(ORIGINALS[n]) != ORIGINAL_DIGESTS[n]]
    if changed:
        return (
            f"Keras {keras.__version__} changed {', '.join(changed)} since keras_amp's op rule for "
            f"{rule.op} was written against 3.15.1; that rule is not installed."
        )
    return None


def install(compute_dtype: str) -> None:
    """Installs the rules for a 16-bit `compute_dtype` ("float16" or "bfloat16"); idempotent.

    Called by `keras_amp.enable()` through a config listener; tests call it directly. A rule
    whose Keras source changed is skipped with an `AmpWarning`.
    """
    global _installed
    validation.check_choice("compute_dtype", compute_dtype, LOW_PRECISION)
    with _lock:
        if _installed == compute_dtype:
            return
        uninstall()
        for rule in RULES:
            if rule.by != "keras_amp" or compute_dtype not in rule.dtypes:
                continue
            why = why_not_installed(rule)
            pending = [n for n in rule.targets if n not in _active]  # two rows may share a target
            if why is None and any(_own(*_TARGETS[n][:2]) is not ORIGINALS[n] for n in pending):
                why = f"another library replaced a Keras function of keras_amp's op rule for {rule.op}; skipped."
            if why:
                warnings.warn(why, amp_policy.AmpWarning, stacklevel=2)
                continue
            for name in pending:
                owner, attr, _ = _TARGETS[name]
                setattr(owner, attr, _REPLACEMENTS[name])
                _active.append(name)
        _installed = compute_dtype
    logging.info("keras_amp: op rules installed for %s (%d Keras objects replaced)", compute_dtype, len(_active))


def uninstall() -> None:
    """Restores every Keras object the rules replaced (the same objects); a no-op when none."""
    global _installed
    with _lock:
        for name in _active:
            owner, attr, _ = _TARGETS[name]
            setattr(owner, attr, ORIGINALS[name])
        _active.clear()
        _installed = None


def installed() -> str | None:
    """The compute dtype the rules are installed for, or None."""
    return _installed


def rule_installed(op: str) -> bool:
    """Whether the rule for `op` (a `Rule.op`, e.g. "softmax") is in effect now: its overrides are
    installed, for one of its dtypes (two rows may share a target)."""
    rule = next((r for r in RULES if r.op == op), None)
    if rule is None:
        raise ValueError(f"Unknown `op`. Received: op={op!r}. Allowed: {', '.join(r.op for r in RULES)}")
    return bool(rule.targets) and _installed in rule.dtypes and all(name in _active for name in rule.targets)


def replaced() -> tuple[str, ...]:
    """Qualified names of the Keras objects replaced now."""
    return tuple(_active)


def _sync(config: amp_policy.AmpConfig | None) -> None:
    """Config listener: rules installed under a 16-bit compute dtype, removed otherwise."""
    if config is not None and config.compute_dtype in LOW_PRECISION:
        install(config.compute_dtype)
    else:
        uninstall()


amp_policy.add_config_listener(_sync)
_sync(amp_policy.config())

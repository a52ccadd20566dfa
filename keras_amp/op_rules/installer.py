"""Installing the op rules: replace the Keras objects while a 16-bit policy is in force, restore them after.

Keras's public ops (`keras.ops.softmax`, ...) call the TensorFlow backend by attribute at call
time (`backend.nn.softmax(x)`), in eager execution, inside `tf.function` and from each op's
`Operation.call`. The rules replace those backend attributes, so every route reaches them; the
symbolic route (`compute_output_spec`, used while a functional model is built) is replaced too
where a rule changes the output dtype, so symbolic and eager dtypes agree.

Each replacement is written against Keras 3.15.1: it is installed only when keras_amp._compat
finds the version tested and every object the rule replaces or relies on unchanged (its pinned
source digest); otherwise that rule is skipped with an `AmpWarning` naming what changed, since a
rule written for other code could be wrong there. `keras_amp.enable()` / `disable()` call `sync`
in a plain call (nothing is registered at import): the rules are installed under a 16-bit compute
dtype and removed otherwise.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

from absl import logging

from keras_amp import _compat
from keras_amp import policy as amp_policy
from keras_amp import validation
from keras_amp.op_rules.attention import dot_product_attention_rule, mha_attention_rule
from keras_amp.op_rules.bias_add import float32_bias_gradient
from keras_amp.op_rules.conv_gradient import (
    conv_with_depthwise_groups,
    float32_conv_gradients,
    float32_depthwise_conv_gradients,
    float32_separable_conv_gradients,
)
from keras_amp.op_rules.einsum_rows import einsum_rows
from keras_amp.op_rules.float32_ops import (
    float32_batch_normalization,
    float16_arange,
    float32_input_dtype,
    float32_loss_rule,
    float32_loss_spec,
    float32_logsumexp,
    float32_probabilities,
    float32_root,
    float32_softmax_exp,
)
from keras_amp.op_rules.fused_batch_norm import fused_batch_normalization, fused_moments, round_trip_cast
from keras_amp.op_rules.upcast_recompute import (
    upcast_recompute_batch_normalization,
    upcast_recompute_gelu,
    upcast_recompute_layer_normalization,
    upcast_recompute_moments,
    upcast_recompute_sparse_categorical_crossentropy,
)
from keras_amp.op_rules.dropout import DROPOUT, packed_dropout
from keras_amp.op_rules.dropout import RELIED_ON as DROPOUT_RELIED_ON
from keras_amp.op_rules.matmul import matmul16
from keras_amp.op_rules.silu import graph_freeing_silu
from keras_amp.op_rules.table import (
    ADD,
    CAST,
    DPA,
    EINSUM,
    EXP,
    LAYER_CALL,
    LAYER_OPEN_SCOPE,
    LOGSUMEXP,
    LOW_PRECISION,
    MATMUL,
    MHA_CALL,
    MHA_COMPUTE,
    RELIED_ON,
    RSQRT,
    RULES,
    SQRT,
    TF_NN,
    XLA_CONTEXT,
    Rule,
)

_OPS_NN = "keras.src.ops.nn"
# qualified name (a keras_amp._compat pin) -> factory(original) -> replacement, or None if relied on only.
_FACTORIES: dict[str, Callable | None] = {
    f"{TF_NN}.softmax": float32_probabilities,
    f"{TF_NN}.log_softmax": float32_probabilities,
    LOGSUMEXP: float32_logsumexp,
    EXP: float32_softmax_exp,
    MHA_COMPUTE: mha_attention_rule,
    MHA_CALL: None,
    f"{TF_NN}.batch_normalization": lambda f: fused_batch_normalization(
        upcast_recompute_batch_normalization(float32_batch_normalization(f))),
    f"{TF_NN}.moments": lambda f: fused_moments(upcast_recompute_moments(f)),
    CAST: round_trip_cast,
    f"{_OPS_NN}._layer_normalization": upcast_recompute_layer_normalization,
    f"{_OPS_NN}._normalize": float32_input_dtype,
    "keras.src.backend.tensorflow.numpy.std": float32_input_dtype,
    "keras.src.backend.tensorflow.linalg.norm": float32_input_dtype,
    "keras.src.backend.tensorflow.numpy.arange": float16_arange,
    f"{TF_NN}.gelu": upcast_recompute_gelu,
    f"{TF_NN}.silu": graph_freeing_silu,
    f"{TF_NN}.conv": lambda f: conv_with_depthwise_groups(f, _compat.original(f"{TF_NN}.depthwise_conv")),
    f"{TF_NN}.depthwise_conv": float32_depthwise_conv_gradients,
    f"{TF_NN}.separable_conv": float32_separable_conv_gradients,
    f"{TF_NN}.conv_transpose": float32_conv_gradients,
    XLA_CONTEXT: None,
    "tensorflow.python.ops.nn_impl.swish": None,
    DROPOUT: packed_dropout,
    **{name: None for name in DROPOUT_RELIED_ON},
    f"{TF_NN}.categorical_crossentropy": float32_loss_rule("Softmax"),
    f"{_OPS_NN}.CategoricalCrossentropy.compute_output_spec": float32_loss_spec,
    f"{TF_NN}.sparse_categorical_crossentropy": lambda f, xla_scores: upcast_recompute_sparse_categorical_crossentropy(
        float32_loss_rule("Softmax")(f), xla_scores=xla_scores),
    f"{_OPS_NN}.SparseCategoricalCrossentropy.compute_output_spec": float32_loss_spec,
    f"{TF_NN}.binary_crossentropy": float32_loss_rule("Sigmoid"),
    f"{_OPS_NN}.BinaryCrossentropy.compute_output_spec": float32_loss_spec,
    RSQRT: float32_root,
    SQRT: float32_root,
    DPA: dot_product_attention_rule,
    f"{TF_NN}._apply_masks": None,
    MATMUL: matmul16,
    ADD: float32_bias_gradient,
    EINSUM: einsum_rows,
    LAYER_CALL: None,
    LAYER_OPEN_SCOPE: None,
    "keras.src.backend.tensorflow.core.name_scope": None,
    "keras.src.backend.common.name_scope.name_scope": None,
}


def _owner(name: str) -> tuple[Any, str] | None:
    """(the object holding `name`'s last attribute, that attribute), or None when not found."""
    parent, _, attr = name.rpartition(".")
    try:
        return _compat.lookup(parent), attr
    except (LookupError, ImportError):
        return None


_TARGETS: dict[str, tuple[Any, str] | None] = {name: _owner(name) for name in _FACTORIES}


def _own(owner: Any, attr: str) -> Any:
    # A class's own attribute (the plain function), so restoring it restores identity.
    return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


# As Keras defines them (captured by keras_amp._compat at import, before any replacement).
ORIGINALS: dict[str, Callable] = {name: _compat.original(name) for name in _FACTORIES if _compat.original(name)}

# The rules with XLA kernels (attention scores, the sparse cross-entropy, gelu, silu) take the trace-time option
# `xla_scores` (`keras_amp.enable(xla_scores=...)`) as an argument, bound when they are built.
_TAKE_XLA_SCORES = (f"{TF_NN}.softmax", f"{TF_NN}.log_softmax", LOGSUMEXP, EXP, MHA_COMPUTE, DPA,
                    f"{TF_NN}.sparse_categorical_crossentropy", f"{TF_NN}.gelu", f"{TF_NN}.silu")


def _build(xla_scores: bool) -> dict[str, Callable]:
    return {
        name: factory(ORIGINALS[name], xla_scores=xla_scores) if name in _TAKE_XLA_SCORES else factory(ORIGINALS[name])
        for name, factory in _FACTORIES.items() if factory is not None and name in ORIGINALS
    }


_REPLACEMENTS: dict[bool, dict[str, Callable]] = {True: _build(True), False: _build(False)}
_lock = threading.RLock()
_installed: str | None = None
_xla_scores: bool | None = None
_active: list[str] = []  # the qualified names replaced now


def source_digests() -> dict[str, str]:
    """The source digest of every original Keras object the rules replace or rely on, now."""
    return {name: _compat.digest(fn) for name, fn in ORIGINALS.items()}


def why_not_installed(rule: Rule) -> str | None:
    """Why `rule`'s override cannot be installed on this Keras, or None when it can."""
    names = rule.targets + tuple(n for t in rule.targets for n in RELIED_ON.get(t, ()))
    found = _compat.problems(names)
    if found:
        return (
            f"keras_amp's op rule for {rule.op} was written against Keras {_compat.TESTED_KERAS}x and is "
            f"not installed: {'; '.join(found)}."
        )
    return None


def install(compute_dtype: str, *, xla_scores: bool = True) -> None:
    """Installs the rules for a 16-bit `compute_dtype` ("float16" or "bfloat16"); idempotent.

    `xla_scores`: whether the float32 attention scores are XLA computations (bound into the
    attention and softmax rules; see `keras_amp.enable`). Called by `keras_amp.enable()`
    (through `sync`); tests call it directly. A rule whose Keras source changed is skipped
    with an `AmpWarning`.
    """
    global _installed, _xla_scores
    validation.check_choice("compute_dtype", compute_dtype, LOW_PRECISION)
    xla_scores = validation.check_bool("xla_scores", xla_scores)
    with _lock:
        if (_installed, _xla_scores) == (compute_dtype, xla_scores):
            return
        uninstall()
        for rule in RULES:
            if rule.by != "keras_amp" or compute_dtype not in rule.dtypes:
                continue
            why = why_not_installed(rule)
            pending = [n for n in rule.targets if n not in _active]  # two rows may share a target
            if why is None and any(_own(*_TARGETS[n]) is not ORIGINALS[n] for n in pending):
                why = f"another library replaced a Keras function of keras_amp's op rule for {rule.op}; skipped."
            if why:
                warnings.warn(why, amp_policy.AmpWarning, stacklevel=2)
                continue
            for name in pending:
                owner, attr = _TARGETS[name]
                setattr(owner, attr, _REPLACEMENTS[xla_scores][name])
                _active.append(name)
        _installed, _xla_scores = compute_dtype, xla_scores
    logging.info("keras_amp: op rules installed for %s (%d Keras objects replaced)", compute_dtype, len(_active))


def uninstall() -> None:
    """Restores every Keras object the rules replaced (the same objects); a no-op when none."""
    global _installed, _xla_scores
    with _lock:
        for name in _active:
            owner, attr = _TARGETS[name]
            setattr(owner, attr, ORIGINALS[name])
        _active.clear()
        _installed = _xla_scores = None


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


def sync(config: amp_policy.AmpConfig | None) -> None:
    """Puts the rules in line with `config`: installed under a 16-bit compute dtype, removed
    otherwise (None: keras_amp disabled)."""
    if config is not None and config.compute_dtype in LOW_PRECISION:
        install(config.compute_dtype, xla_scores=config.xla_scores)
    else:
        uninstall()

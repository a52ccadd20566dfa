"""Op-level float32 rules: numerically sensitive Keras ops compute in float32 under a 16-bit policy.

While `keras_amp.enable()` is in force with a float16 or bfloat16 compute dtype, the ops marked
"keras_amp" in `RULES` compute in float32 whichever layer, model or user function calls them
(Sequential, functional with operator nodes, subclassed, keras-hub). `disable()` restores every
replaced Keras object exactly. `rules_markdown()` prints the table.

How: Keras's public ops (`keras.ops.softmax`, ...) call the TensorFlow backend by attribute at call
time (`backend.nn.softmax(x)`), in eager execution, inside `tf.function` and from each op's
`Operation.call`. The rules replace those backend attributes, so every route reaches them; the
symbolic route (`compute_output_spec`, used while a functional model is built) is replaced too
where a rule changes the output dtype, so symbolic and eager dtypes agree. The attention-score
einsum rule also reads which layer is calling: `Layer.__call__` runs `call` inside
`backend.name_scope(self.name, caller=self)`, so the innermost entry of Keras's (thread-local)
"name_scope_stack" with a caller is the layer whose code runs the einsum. The rule's check is a few
attribute reads; inside `tf.function` it runs while tracing, not at every step.

Output dtype convention (the table's "output" column), in the spirit of TF grappler's
auto-mixed-precision lists and torch.autocast's "fp32" / "promote" policies:

    runs in float32, output "input dtype": inputs cast up, computed, result cast back to the
        caller's dtype, so the next matmul inside the layer stays in the compute dtype (Keras
        promotes float16 + float32 to float32, which would make it a float32 matmul);
    runs in float32, output "float32": losses; their value is reduced and logged in float32;
    runs in "widest input": Keras's own promotion of mixed inputs (no override);
    runs in "compute dtype": left alone, with the reason.

Each replacement is written against Keras 3.15.1: it is installed only for Keras 3.15.x and only
when the replaced function's source digest matches `ORIGINAL_DIGESTS`; otherwise that rule is
skipped with an `AmpWarning`, since a rule written for other code could be wrong there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import threading
import warnings
from typing import Any, Callable

import keras
import tensorflow as tf
from absl import logging
from keras.src.backend.common import global_state
from keras.src.backend.common import name_scope as common_name_scope
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import math as tf_math
from keras.src.backend.tensorflow import nn as tf_nn
from keras.src.backend.tensorflow import numpy as tf_numpy
from keras.src.ops import nn as ops_nn
from keras.src.ops import numpy as ops_numpy

from keras_amp import policy as amp_policy
from keras_amp import validation
from keras_amp.layers import attention as amp_attention

TARGET_KERAS = "3.15."
LOW_PRECISION = ("float16", "bfloat16")
BOTH = LOW_PRECISION
FLOAT16 = ("float16",)
# Hazard kind -> the 16-bit dtypes in which an op of that kind is a hazard (the dynamic audit flags
# it there). Exp-type results and sums overflow float16's range, which bfloat16 shares with float32;
# attention scores, softmax, normalisation statistics and losses lose precision in both.
HAZARD_DTYPES = {
    "attention": BOTH,
    "softmax": BOTH,
    "normalization": BOTH,
    "loss": BOTH,
    "exp": FLOAT16,
    "reduction": FLOAT16,
}
_MHA = keras.layers.MultiHeadAttention


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of the op table.

    Args:
        op: String. The public op(s), as users call them.
        kind: String. Hazard family, shared with the dynamic audit: "softmax", "attention",
            "normalization", "exp", "loss", "reduction" or "" (not sensitive).
        runs_in: String. "float32", "compute dtype" or "widest input".
        output: String. The result's dtype: "input dtype", "float32", "compute dtype", "widest".
        dtypes: Tuple of strings. The 16-bit compute dtypes the rule is for (where the op is a
            hazard); empty when it is not one.
        by: String. "keras_amp" (replaced while enabled), "keras" (Keras 3.15.1 already does
            it) or "none" (left alone on purpose).
        targets: Tuple of strings. Qualified names of the Keras objects replaced while enabled.
        reason: String. Why.
    """

    op: str
    kind: str
    runs_in: str
    output: str
    dtypes: tuple[str, ...]
    by: str
    targets: tuple[str, ...]
    reason: str


_NN = "keras.src.backend.tensorflow.nn"
_EINSUM = "keras.src.backend.tensorflow.numpy.einsum"
_EINSUM_SPEC = "keras.src.ops.numpy.Einsum.compute_output_spec"
ATTENTION_OP = "MultiHeadAttention scores (QK^T, scale, mask, softmax)"
SCORES_EINSUM_OP = "einsum(layer._dot_product_equation, ...) in other attention layers"
RULES: tuple[Rule, ...] = (
    Rule("softmax", "softmax", "float32", "input dtype", BOTH, "keras_amp", (f"{_NN}.softmax",),
         "exp and the normaliser (a sum over the axis) in float32, one rounding at the end; the "
         "backward sum over the axis runs in float32 too"),
    Rule("log_softmax", "softmax", "float32", "input dtype", BOTH, "keras_amp", (f"{_NN}.log_softmax",),
         "the float16 normaliser overflows past 65504 terms: over 70000 classes stock gives -inf"),
    Rule("logsumexp", "softmax", "float32", "input dtype", BOTH, "keras_amp",
         ("keras.src.backend.tensorflow.math.logsumexp",),
         "TF sums exp(x - max) in the input dtype: inf in float16 past 65504 terms"),
    Rule(ATTENTION_OP, "attention", "float32", "compute dtype",
         BOTH, "keras_amp", ("keras.layers.MultiHeadAttention._compute_attention",),
         "QK^T sums key_dim products: entries near 300 overflow float16 (NaN softmax); bfloat16 "
         "rounds logits to 8 bits. Value einsum stays in the compute dtype; subclasses that keep "
         "the stock method (keras-hub) get it too"),
    Rule(SCORES_EINSUM_OP, "attention", "float32", "float32", BOTH, "keras_amp", (_EINSUM, _EINSUM_SPEC),
         "layers that compute QK^T themselves (keras-hub Llama, Mistral, Mixtral, Qwen*, SmolLM3, "
         "GPT-OSS attention; not MultiHeadAttention, covered above): the einsum whose equation is "
         "the innermost calling layer's `_dot_product_equation`, on two 16-bit operands, computes "
         "in float32 (gradient matmuls in the compute dtype). Output float32: a cast back would "
         "keep float16's overflow. In those keras-hub 0.32 layers the scale, mask and softmax "
         "follow (float32 by promotion / a float32 Softmax layer) and the probabilities are cast "
         "to the compute dtype before the value einsum: no other matmul changes dtype"),
    Rule("batch_normalization", "normalization", "float32", "input dtype", BOTH, "keras_amp",
         (f"{_NN}.batch_normalization",),
         "x*inv - mean*inv cancels catastrophically in 16 bits when |mean| >> std; float32 "
         "statistics with 16-bit x are accepted (stock raises on mixed dtypes)"),
    Rule("normalize", "normalization", "float32", "input dtype", BOTH, "keras_amp",
         ("keras.src.ops.nn._normalize",),
         "the sum of squares overflows float16 (|x| ~ 300 over 64 entries): stock returns zeros"),
    Rule("std", "reduction", "float32", "input dtype", FLOAT16, "keras_amp", ("keras.src.backend.tensorflow.numpy.std",),
         "squared deviations overflow float16; Keras upcasts var but not std"),
    Rule("gelu", "exp", "float32", "input dtype", FLOAT16, "keras_amp", (f"{_NN}.gelu",),
         "the tanh approximation evaluates x**3 (Pow): its gradient 3x**2 overflows float16 past "
         "|x| = 256 and stock's gradient is NaN (inf * 0); bfloat16 has the range"),
    Rule("categorical_crossentropy", "loss", "float32", "float32", BOTH, "keras_amp",
         (f"{_NN}.categorical_crossentropy", "keras.src.ops.nn.CategoricalCrossentropy.compute_output_spec"),
         "a loss is reduced, scaled and logged in float32; 16-bit results round to 8-11 bits"),
    Rule("sparse_categorical_crossentropy", "loss", "float32", "float32", BOTH, "keras_amp",
         (f"{_NN}.sparse_categorical_crossentropy",
          "keras.src.ops.nn.SparseCategoricalCrossentropy.compute_output_spec"),
         "as categorical_crossentropy"),
    Rule("binary_crossentropy", "loss", "float32", "float32", BOTH, "keras_amp",
         (f"{_NN}.binary_crossentropy", "keras.src.ops.nn.BinaryCrossentropy.compute_output_spec"),
         "small per-element losses (< 6e-8) flush to 0 in float16"),
    Rule("moments", "normalization", "float32", "input dtype", BOTH, "keras", (),
         "Keras casts 16-bit inputs to float32 (its float16 variance is clipped at 65504)"),
    Rule("layer_normalization, rms_normalization", "normalization", "float32", "input dtype", BOTH, "keras", (),
         "Keras computes them in at least float32"),
    Rule("mean, var", "reduction", "float32", "input dtype", FLOAT16, "keras", (),
         "Keras reduces in float32 and casts back"),
    Rule("ctc_loss; keras.losses.* classes", "loss", "float32", "float32", BOTH, "keras", (),
         "Keras casts to float32 (a Loss casts y_pred to its float32 dtype)"),
    Rule("sum", "reduction", "compute dtype", "input dtype", FLOAT16, "none", (),
         "TF accumulates 16-bit sums in float32; the hazard is a result above 65504, which a "
         "cast back cannot fix and a float32 result would change the op's dtype contract"),
    Rule("exp, expm1", "exp", "compute dtype", "input dtype", FLOAT16, "none", (),
         "TF evaluates them in float32 and rounds once; exp(x > 11.09) overflows the float16 "
         "result itself, so the fix is a float32 layer (the audit names it)"),
    Rule("log, log1p, softplus, log_sigmoid", "", "compute dtype", "input dtype", (), "none", (),
         "the result fits the input's range and TF's kernels round once (measured <= 1 ulp)"),
    Rule("add, multiply, matmul, einsum, ... (mixed inputs)", "", "widest input", "widest", (), "keras", (),
         "Keras promotes float16 + float32 to float32; the next layer casts back to its compute dtype"),
)

# sha256 of inspect.getsource(original)[:16] (tests/keras_guard.py::source_digest), Keras 3.15.1.
# `MultiHeadAttention.call` is not replaced but relied on: it passes `use_causal_mask` only
# when `type(self)._compute_attention is MultiHeadAttention._compute_attention`.
ORIGINAL_DIGESTS = {
    f"{_NN}.softmax": "db2c578ff3a26c2e",
    f"{_NN}.log_softmax": "7877ebb97ae1ce8f",
    "keras.src.backend.tensorflow.math.logsumexp": "715367831b0891ce",
    "keras.layers.MultiHeadAttention._compute_attention": "88168a1a82dd0d31",
    "keras.layers.MultiHeadAttention.call": "fd666cb2fe09b101",
    f"{_NN}.batch_normalization": "1cc80ed9bad6ea79",
    "keras.src.ops.nn._normalize": "6d45ce2adc62638f",
    "keras.src.backend.tensorflow.numpy.std": "06356e76fd7e60f7",
    f"{_NN}.gelu": "edb8d0940a01c8d5",
    f"{_NN}.categorical_crossentropy": "a2cb8f1dacc6a411",
    "keras.src.ops.nn.CategoricalCrossentropy.compute_output_spec": "c729e7e6cb6f7d01",
    f"{_NN}.sparse_categorical_crossentropy": "8dd1e34615666cea",
    "keras.src.ops.nn.SparseCategoricalCrossentropy.compute_output_spec": "1d2704fea7e2f6f6",
    f"{_NN}.binary_crossentropy": "3fb0e94214714db1",
    "keras.src.ops.nn.BinaryCrossentropy.compute_output_spec": "4dd48a4bb5ef1272",
    _EINSUM: "9eb60d0ed811e577",
    _EINSUM_SPEC: "c3b23b632d2aafaa",
    # Relied on by the scores-einsum rule: `Layer.__call__` calls `call` inside
    # `_open_name_scope()`, which enters `backend.name_scope(self.name, caller=self)`; the
    # TensorFlow backend's name_scope (and its common base) push the entry, `.caller` included,
    # onto the global "name_scope_stack" and pop it on exit.
    "keras.layers.Layer.__call__": "4fb7e42e4ffd9b1a",
    "keras.layers.Layer._open_name_scope": "9197bac9543ef95a",
    "keras.src.backend.tensorflow.core.name_scope": "bff9a1de6e491b0d",
    "keras.src.backend.common.name_scope.name_scope": "957dcd2ff7532ae8",
}
_NAME_SCOPE_STACK = (
    "keras.layers.Layer.__call__",
    "keras.layers.Layer._open_name_scope",
    "keras.src.backend.tensorflow.core.name_scope",
    "keras.src.backend.common.name_scope.name_scope",
)
_RELIED_ON = {
    "keras.layers.MultiHeadAttention._compute_attention": ("keras.layers.MultiHeadAttention.call",),
    _EINSUM: _NAME_SCOPE_STACK,
    _EINSUM_SPEC: _NAME_SCOPE_STACK,
}

# What no op-level rule reaches (README "what op-level rules cannot reach").
NOT_REACHED = (
    "raw `tf.*` calls (`tf.nn.softmax`, `tf.exp`, ...): they bypass Keras's backend functions; "
    "`keras_amp.diagnostics.audit_model` still sees them and names the layer",
    "fused kernels that take the whole computation: `ops.dot_product_attention` / flash attention "
    "(QK^T in the compute dtype; MultiHeadAttention is covered by its own rule unless "
    "`flash_attention=True`), fused RNN kernels",
    "attention layers that compute QK^T themselves, other than as `einsum(self._dot_product_equation, "
    "q, k)` in a layer that is not a MultiHeadAttention: a literal equation or another attribute name "
    "(keras-hub Gemma, Falcon, GPT-NeoX), `matmul`, a helper layer or function doing the einsum "
    "(the caller on the name-scope stack is then not the attention layer), and MultiHeadAttention "
    "subclasses that override `_compute_attention`; their softmax, if it goes through "
    "`keras.ops.softmax` or a Keras Softmax layer, is still float32, their QK^T is not",
    "LSTM/GRU gate and state precision: the recurrence runs in the cell's compute dtype "
    "(`keras_amp.layers.LSTM` / `GRU` keep it float32)",
    "code that casts for itself: a rule sees the dtype it is given, so a value already rounded "
    "(or overflowed) to 16 bits before the op stays rounded; a float32 input stays float32",
    "results whose range is the hazard (exp(x > 11.09), a sum above 65504 in float16): the "
    "output dtype contract is kept, so these need a float32 layer (`apply_recipe` rules)",
    "gradient reductions TensorFlow's autodiff inserts (broadcast `Sum`s) in the compute dtype; "
    "the loss-scale optimizer skips a step whose gradients overflow",
)


def _digest(fn: Callable) -> str:
    """sha256 of `inspect.getsource(fn)`, first 16 hex digits (as tests/keras_guard.py)."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def _low(x: Any, dtypes: tuple[str, ...] = LOW_PRECISION) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and keras.backend.standardize_dtype(dtype) in dtypes


def _up(x: Any) -> Any:
    return tf.cast(x, tf.float32) if _low(x) else x


def _float32_input_dtype(original: Callable) -> Callable:
    """`original(x, ...)` computed on float32 `x`, the result cast back to `x`'s dtype."""

    def rule(x, *args, **kwargs):
        if not _low(x):
            return original(x, *args, **kwargs)
        return tf.cast(original(tf.cast(x, tf.float32), *args, **kwargs), x.dtype)

    rule.__name__ = rule.__qualname__ = original.__name__
    return rule


def _float32_softmax(original: Callable) -> Callable:
    def softmax(x, axis=-1):
        if not _low(x):
            return original(x, axis=axis)
        output = tf.cast(original(tf.cast(x, tf.float32), axis=axis), x.dtype)
        # Keras's contract: a softmax output carries its logits, which the cross-entropies use.
        output._keras_logits = x
        return output

    return softmax


def _float32_batch_normalization(original: Callable) -> Callable:
    def batch_normalization(x, mean, variance, axis, offset=None, scale=None, epsilon=1e-3):
        x = tf.convert_to_tensor(x)
        if not any(_low(t) for t in (x, mean, variance, offset, scale)):
            return original(x, mean, variance, axis, offset, scale, epsilon)
        # x * inv + (offset - mean * inv): two near-equal 16-bit terms when |mean| >> std.
        up = [None if t is None else tf.cast(t, tf.float32) for t in (x, mean, variance, offset, scale)]
        return tf.cast(original(up[0], up[1], up[2], axis, up[3], up[4], epsilon), x.dtype)

    return batch_normalization


def _up_keeping_logits(output: Any, op_type: str) -> Any:
    """`output` in float32, still carrying the logits Keras's cross-entropies look for."""
    if not _low(output):
        return output
    logits = getattr(output, "_keras_logits", None)
    if logits is None and not tf.executing_eagerly() and getattr(output, "op", None) is not None:
        if output.op.type == op_type and len(output.op.inputs) == 1:
            logits = output.op.inputs[0]
    up = tf.cast(output, tf.float32)
    if logits is not None:
        up._keras_logits = tf.cast(logits, tf.float32)
    return up


def _float32_loss(op_type: str) -> Callable:
    def factory(original: Callable) -> Callable:
        def loss(target, output, *args, **kwargs):
            if not (_low(output) or _low(target)):
                return original(target, output, *args, **kwargs)
            return original(_up(target), _up_keeping_logits(output, op_type), *args, **kwargs)

        loss.__name__ = loss.__qualname__ = original.__name__
        return loss

    return factory


def _float32_loss_spec(original: Callable) -> Callable:
    def compute_output_spec(self, target, output):
        spec = original(self, target, output)
        if _low(output) or _low(target):
            return keras.KerasTensor(spec.shape, dtype="float32")
        return spec

    return compute_output_spec


def _float32_attention(original: Callable) -> Callable:
    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
    ):
        # Flash attention is the user's explicit choice of a fused kernel: left to stock.
        if getattr(self, "_flash_attention", False) or not _low(query):
            return original(
                self, query, key, value, attention_mask, training, return_attention_scores, use_causal_mask
            )
        # Scores come back in the layer's compute dtype: stock's output contract (and its
        # compute_output_spec) is unchanged.
        return amp_attention.float32_attention(
            self,
            query,
            key,
            value,
            attention_mask=attention_mask,
            training=training,
            return_attention_scores=return_attention_scores,
            use_causal_mask=use_causal_mask,
            scores_dtype=self.compute_dtype,
        )

    return _compute_attention


def scores_caller(subscripts: Any) -> keras.layers.Layer | None:
    """The innermost calling layer when it computes attention scores as `einsum(subscripts, ...)`.

    That is the innermost entry with a caller on Keras's name-scope stack (`Layer.__call__` runs
    `call` inside `name_scope(self.name, caller=self)`), when it has `_dot_product_equation ==
    subscripts` and is not a `keras.layers.MultiHeadAttention` (whose own rule covers it).
    """
    stack = global_state.get_global_attribute("name_scope_stack")
    caller = next((e.caller for e in reversed(stack or ()) if getattr(e, "caller", None) is not None), None)
    if caller is None or isinstance(caller, _MHA):
        return None
    equation = getattr(caller, "_dot_product_equation", None)
    return caller if isinstance(equation, str) and equation == subscripts else None


def _is_scores_einsum(subscripts: Any, operands: tuple, kwargs: dict) -> bool:
    # Cheap checks first: this runs for every einsum while the rules are installed (in graph
    # mode only while tracing).
    if kwargs or len(operands) != 2 or not isinstance(subscripts, str) or "->" not in subscripts:
        return False
    a, b = operands
    # Mixed 16-bit dtypes (float16 x bfloat16) already promote to float32 in Keras.
    if not (_low(a) and _low(b)):
        return False
    if keras.backend.standardize_dtype(a.dtype) != keras.backend.standardize_dtype(b.dtype):
        return False
    return scores_caller(subscripts) is not None


def _float32_scores_einsum(original: Callable) -> Callable:
    def einsum(subscripts, *operands, **kwargs):
        if not _is_scores_einsum(subscripts, operands, kwargs):
            return original(subscripts, *operands, **kwargs)
        a, b = (tf.convert_to_tensor(t) for t in operands)
        equation = subscripts.replace(" ", "")
        if "." in equation:
            # Broadcast ellipses: no transposed gradient equations; all of it in float32.
            return original(subscripts, tf.cast(a, tf.float32), tf.cast(b, tf.float32))
        # Products of two 16-bit numbers are exact in float32; the float32 sum neither overflows
        # float16 (QK^T entries near 300 do) nor rounds logits to bfloat16's 8 bits. The result
        # stays float32: a cast back would bring float16's overflow back. In keras-hub's
        # LlamaAttention (and its copies) the next ops are the scale multiply (float32 by
        # promotion, elementwise) and a float32 Softmax layer (which casts 16-bit input up
        # anyway); the probabilities are cast to the compute dtype before the value einsum, so no
        # matmul other than this one changes dtype.
        return amp_attention.float32_scores(equation, a, b, 1.0)

    einsum.__name__ = einsum.__qualname__ = original.__name__
    return einsum


def _float32_scores_einsum_spec(original: Callable) -> Callable:
    # Symbolic route (ops.einsum on KerasTensors); a layer's call on KerasTensors runs on TF
    # placeholders and reaches the backend einsum above instead.
    def compute_output_spec(self, *operands):
        spec = original(self, *operands)
        if _is_scores_einsum(self.subscripts, operands, {}):
            return keras.KerasTensor(spec.shape, dtype="float32")
        return spec

    return compute_output_spec


# qualified name -> (owner, attribute, factory(original) -> replacement or None if relied on only).
_TARGETS: dict[str, tuple[Any, str, Callable | None]] = {
    f"{_NN}.softmax": (tf_nn, "softmax", _float32_softmax),
    f"{_NN}.log_softmax": (tf_nn, "log_softmax", _float32_input_dtype),
    "keras.src.backend.tensorflow.math.logsumexp": (tf_math, "logsumexp", _float32_input_dtype),
    "keras.layers.MultiHeadAttention._compute_attention": (_MHA, "_compute_attention", _float32_attention),
    "keras.layers.MultiHeadAttention.call": (_MHA, "call", None),
    f"{_NN}.batch_normalization": (tf_nn, "batch_normalization", _float32_batch_normalization),
    "keras.src.ops.nn._normalize": (ops_nn, "_normalize", _float32_input_dtype),
    "keras.src.backend.tensorflow.numpy.std": (tf_numpy, "std", _float32_input_dtype),
    f"{_NN}.gelu": (tf_nn, "gelu", _float32_input_dtype),
    f"{_NN}.categorical_crossentropy": (tf_nn, "categorical_crossentropy", _float32_loss("Softmax")),
    "keras.src.ops.nn.CategoricalCrossentropy.compute_output_spec": (
        ops_nn.CategoricalCrossentropy, "compute_output_spec", _float32_loss_spec),
    f"{_NN}.sparse_categorical_crossentropy": (
        tf_nn, "sparse_categorical_crossentropy", _float32_loss("Softmax")),
    "keras.src.ops.nn.SparseCategoricalCrossentropy.compute_output_spec": (
        ops_nn.SparseCategoricalCrossentropy, "compute_output_spec", _float32_loss_spec),
    f"{_NN}.binary_crossentropy": (tf_nn, "binary_crossentropy", _float32_loss("Sigmoid")),
    "keras.src.ops.nn.BinaryCrossentropy.compute_output_spec": (
        ops_nn.BinaryCrossentropy, "compute_output_spec", _float32_loss_spec),
    _EINSUM: (tf_numpy, "einsum", _float32_scores_einsum),
    _EINSUM_SPEC: (ops_numpy.Einsum, "compute_output_spec", _float32_scores_einsum_spec),
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
    names = rule.targets + tuple(n for t in rule.targets for n in _RELIED_ON.get(t, ()))
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
            if why is None and any(_own(*_TARGETS[n][:2]) is not ORIGINALS[n] for n in rule.targets):
                why = f"another library replaced a Keras function of keras_amp's op rule for {rule.op}; skipped."
            if why:
                warnings.warn(why, amp_policy.AmpWarning, stacklevel=2)
                continue
            for name in rule.targets:
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
    """Whether the override of the rule for `op` (a `Rule.op`, e.g. "softmax") is in effect now."""
    rule = next((r for r in RULES if r.op == op), None)
    if rule is None:
        raise ValueError(f"Unknown `op`. Received: op={op!r}. Allowed: {', '.join(r.op for r in RULES)}")
    return bool(rule.targets) and all(name in _active for name in rule.targets)


def replaced() -> tuple[str, ...]:
    """Qualified names of the Keras objects replaced now."""
    return tuple(_active)


def rules_markdown() -> str:
    """`RULES` (and what they cannot reach) as a markdown table, for README and BUILD_NOTES."""
    lines = [
        "| op | kind | runs in | output | hazard in | applied by | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in RULES:
        cells = (r.op, r.kind or "-", r.runs_in, r.output, ", ".join(r.dtypes) or "-", r.by, r.reason)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "Op-level rules cannot reach:", ""] + [f"- {item}" for item in NOT_REACHED]
    return "\n".join(lines)


def _sync(config: amp_policy.AmpConfig | None) -> None:
    """Config listener: rules installed under a 16-bit compute dtype, removed otherwise."""
    if config is not None and config.compute_dtype in LOW_PRECISION:
        install(config.compute_dtype)
    else:
        uninstall()


amp_policy.add_config_listener(_sync)
_sync(amp_policy.config())

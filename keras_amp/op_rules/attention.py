"""Float32 attention scores: MultiHeadAttention's class-level rule and the QK^T einsum rule.

`float32_attention` replaces `MultiHeadAttention._compute_attention` (scores, scale, mask and
softmax in float32; the value einsum stays in the compute dtype). `float32_scores_einsum` covers
layers that compute QK^T themselves: it reads which layer is calling. `Layer.__call__` runs
`call` inside `backend.name_scope(self.name, caller=self)`, so the innermost entry of Keras's
(thread-local) "name_scope_stack" with a caller is the layer whose code runs the einsum. The
rule's check is a few attribute reads; inside `tf.function` it runs while tracing, not at every
step.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from keras_amp.layers import attention as amp_attention
from keras_amp.op_rules.float32_ops import is_16bit
from keras_amp.op_rules.matmul import innermost_caller

_MHA = keras.layers.MultiHeadAttention


def float32_attention(original: Callable) -> Callable:
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
        if getattr(self, "_flash_attention", False) or not is_16bit(query):
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
    caller = innermost_caller()
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
    if not (is_16bit(a) and is_16bit(b)):
        return False
    if keras.backend.standardize_dtype(a.dtype) != keras.backend.standardize_dtype(b.dtype):
        return False
    return scores_caller(subscripts) is not None


def float32_scores_einsum(original: Callable) -> Callable:
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


def float32_scores_einsum_spec(original: Callable) -> Callable:
    # Symbolic route (ops.einsum on KerasTensors); a layer's call on KerasTensors runs on TF
    # placeholders and reaches the backend einsum above instead.
    def compute_output_spec(self, *operands):
        spec = original(self, *operands)
        if _is_scores_einsum(self.subscripts, operands, {}):
            return keras.KerasTensor(spec.shape, dtype="float32")
        return spec

    return compute_output_spec



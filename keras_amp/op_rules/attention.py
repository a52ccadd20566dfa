"""Float32 attention scores in MultiHeadAttention and in `ops.dot_product_attention`.

`mha_attention_rule` replaces `MultiHeadAttention._compute_attention` (scores, scale, mask and
softmax in float32, fused into one XLA computation; the value einsum stays in the compute dtype).
`dot_product_attention_rule` replaces the TensorFlow kernel of `ops.dot_product_attention`.
Attention written as ops (an einsum, a matmul, `q @ k` and a softmax) is found by dataflow at the
softmax instead (`keras_amp.op_rules.dataflow`).
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf

from keras_amp.numerics import attention as amp_attention
from keras_amp.op_rules.float32_ops import is_16bit
from keras_amp import _compat

_MHA = keras.layers.MultiHeadAttention
# Keras 3.15.1's mask helper of the kernel above (pinned beside it in the table).
_APPLY_MASKS = _compat.original("keras.src.backend.tensorflow.nn._apply_masks")


def mha_attention_rule(original: Callable, *, xla_scores: bool) -> Callable:
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
            compiled=xla_scores,
        )

    return _compute_attention


def dot_product_attention_rule(original: Callable, *, xla_scores: bool) -> Callable:
    """`ops.dot_product_attention`'s TensorFlow kernel with its QK^T in float32.

    Keras 3.15's `_dot_product_attention_xla(query, key, value, bias, mask, is_causal, scale)`
    runs the QK^T einsum in the inputs' dtype and casts the result up for a float32 softmax: a
    float16 QK^T has already overflowed by then. For 16-bit inputs this computes the scores as
    16-bit products with float32 accumulation and result (`float32_scores`), then the same
    scale, bias, mask and float32 softmax, and the value einsum in the inputs' dtype.
    """

    def dot_product_attention_xla(query, key, value, bias, mask, is_causal, scale):
        if not (is_16bit(query) and query.dtype == key.dtype):
            return original(query, key, value, bias, mask, is_causal, scale)
        logits = amp_attention.float32_scores("BTNH,BSNH->BNTS", query, key, 1.0, compiled=xla_scores)
        logits = logits * tf.cast(scale, tf.float32)
        if bias is not None:
            logits = logits + tf.cast(bias, tf.float32)
        padded = _APPLY_MASKS(logits, mask, is_causal)
        probs = tf.cast(tf.nn.softmax(padded, axis=-1), key.dtype)
        return amp_attention.value_einsum("BNTS,BSNH->BTNH", probs, value)

    dot_product_attention_xla.__name__ = dot_product_attention_xla.__qualname__ = original.__name__
    return dot_product_attention_xla

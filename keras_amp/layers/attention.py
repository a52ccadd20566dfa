"""MultiHeadAttention whose scores and softmax are float32 on every path.

Written against Keras 3.15.1. Stock `keras.layers.MultiHeadAttention` under
`mixed_float16` computes QK^T in float16 on every path (query/key entries near
300 overflow it to inf and the softmax returns NaN) and its softmax is float16
whenever dropout > 0 or scores are returned. This subclass overrides two private
methods, each small:

- `_build_attention`: the softmax and the dropout on the probabilities are
  built as float32 layers.
- `_compute_attention`: always the explicit path (never the fused
  `ops.dot_product_attention`, whose QK^T runs in the compute dtype): the scaled
  QK^T has a float32 result (`float32_scores`: float32 forward matmul, gradient
  matmuls in the compute dtype), masking and softmax are float32, and the
  probabilities-times-value einsum runs in the compute dtype.

`tests/layers/test_attention.py` pins the source of these stock methods (and of
`_masked_softmax` and `call`, which we rely on) so a Keras upgrade that changes
them fails a test instead of silently changing the numerics.
"""

import keras
import tensorflow as tf
from keras import ops

from keras_amp.layers.softmax import Softmax

# Keras version the private overrides below were written against.
KERAS_VERSION = "3.15.1"


def _gradient_equations(equation):
    """Einsum equations of d(key) and d(query) for `equation` "key,query->scores", or None.

    Valid when every index of each operand appears in the other operand or in the output
    (true of every equation MultiHeadAttention builds): then d(key) = einsum(g, query) and
    d(query) = einsum(g, key) with the roles of the subscripts swapped.
    """
    inputs, out = equation.split("->")
    key, query = inputs.split(",")
    if not (set(key) <= set(query + out) and set(query) <= set(key + out)):
        return None
    return f"{out},{query}->{key}", f"{out},{key}->{query}"


def float32_scores(equation, key, query, scale):
    """`einsum(equation, key, query * scale)` with a float32 result, exact for 16-bit inputs.

    The forward matmul runs on float32 copies: the products of two 16-bit numbers are exact
    in float32, and the float32 output neither overflows (float16) nor rounds each logit to
    8 bits (bfloat16). The two gradient matmuls run in the inputs' (compute) dtype, as in the
    stock layer: the gradients of `key` and `query` are rounded to that dtype anyway, and the
    16-bit matmuls are ~2x faster on oneDNN/tensor cores (measured on this CPU: fwd+bwd of the
    scores 19.9 ms in float32, 15.9 ms with 16-bit gradients, 12.3 ms all-bfloat16). A float16
    gradient that overflows becomes inf, which the loss-scale optimizer skips.
    """
    equations = _gradient_equations(equation)
    low = key.dtype
    if low == tf.float32 or equations is None:
        return ops.einsum(equation, ops.cast(key, "float32"), ops.multiply(ops.cast(query, "float32"), scale))
    d_key_eq, d_query_eq = equations

    @tf.custom_gradient
    def scores(key, query):
        result = tf.einsum(equation, tf.cast(key, tf.float32), tf.cast(query, tf.float32) * scale)

        def grad(upstream):
            g = tf.cast(upstream * scale, low)
            return tf.einsum(d_key_eq, g, query), tf.einsum(d_query_eq, g, key)

        return result, grad

    return scores(key, ops.cast(query, low))


@keras.saving.register_keras_serializable(package="keras_amp")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` with float32 attention scores.

    Takes the same arguments as `keras.layers.MultiHeadAttention` and has the
    same weights. On every path (dropout, `return_attention_scores=True`,
    masks, `use_causal_mask=True`): the scaling and QK^T are computed in float32
    (its gradient matmuls in the compute dtype), masking (with a float32 large
    negative number) and softmax are float32; the dropout on the probabilities is float32; the
    probabilities are cast to the compute dtype for the value einsum; the
    projections and output are in the compute dtype. Returned attention
    scores are float32. Flash attention is not used (`flash_attention=True`
    raises), since the fused kernels compute QK^T in the compute dtype.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> mha = keras_amp.layers.MultiHeadAttention(num_heads=2, key_dim=16)
    >>> out, scores = mha(x, x, return_attention_scores=True)
    >>> scores.dtype
    tf.float32
    """

    def __init__(self, num_heads, key_dim, *args, flash_attention=None, **kwargs):
        if flash_attention:
            raise ValueError(
                "keras_amp.layers.MultiHeadAttention computes attention scores "
                "explicitly in float32 and cannot use flash attention. "
                f"Received: flash_attention={flash_attention}, allowed: None, False"
            )
        super().__init__(num_heads, key_dim, *args, flash_attention=False, **kwargs)

    def get_config(self):
        config = super().get_config()
        config["flash_attention"] = None
        return config

    def _build_attention(self, rank):
        super()._build_attention(rank)
        # Float32 islands declared where built: probabilities stay float32
        # through the softmax and the dropout that follows it.
        self._softmax = Softmax(
            axis=self._softmax.axis, dtype="float32", name="attention_softmax"
        )
        self._dropout_layer = keras.layers.Dropout(
            rate=self._dropout, dtype="float32", seed=self.seed
        )

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
        # `use_causal_mask` is never True here: stock `call` (source pinned in
        # tests/layers/test_attention.py) passes it only when `_compute_attention`
        # is the stock method; for a subclass it folds the causal mask into
        # `attention_mask` itself (the "causal" path test checks the result).
        # QK^T sums key_dim products: entries near 300 already exceed float16's
        # 65504, and bfloat16 rounds each logit to 8 bits. Scale, dot product,
        # mask and softmax therefore run in float32.
        attention_scores = float32_scores(
            self._dot_product_equation, key, query, float(self._inverse_sqrt_key_dim)
        )
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        if self._dropout > 0.0:
            final_attn_scores = self._dropout_layer(attention_scores, training=training)
        else:
            final_attn_scores = attention_scores
        # Probabilities are in [0, 1]: the value einsum is safe (and fast) in
        # the compute dtype.
        attention_output = ops.einsum(
            self._combine_equation,
            ops.cast(final_attn_scores, value.dtype),
            value,
        )
        return attention_output, attention_scores

    def compute_output_spec(self, query, value, key=None, *args, **kwargs):
        spec = super().compute_output_spec(query, value, key, *args, **kwargs)
        if isinstance(spec, tuple):
            output_spec, scores_spec = spec
            return output_spec, keras.KerasTensor(scores_spec.shape, dtype="float32")
        return spec

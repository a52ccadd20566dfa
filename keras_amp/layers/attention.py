"""MultiHeadAttention whose scores and softmax are float32 on every path.

Written against Keras 3.15.1. Stock `keras.layers.MultiHeadAttention` under
`mixed_float16` computes QK^T in float16 on every path (query/key entries near
300 overflow it to inf and the softmax returns NaN) and its softmax is float16
whenever dropout > 0 or scores are returned. This subclass overrides two private
methods, each small:

- `_build_attention`: the softmax and the dropout on the probabilities are
  built as float32 layers.
- `_compute_attention`: always the explicit path (never the fused
  `ops.dot_product_attention`, whose QK^T runs in the compute dtype): query and
  key are cast to float32 before scaling and the QK^T einsum, masking and
  softmax are float32, and only the probabilities-times-value einsum runs in the
  compute dtype.

`tests/layers/test_attention.py` pins the source of these stock methods (and of
`_masked_softmax` and `call`, which we rely on) so a Keras upgrade that changes
them fails a test instead of silently changing the numerics.
"""

import keras
from keras import ops

from keras_amp.layers.softmax import Softmax

# Keras version the private overrides below were written against.
KERAS_VERSION = "3.15.1"


@keras.saving.register_keras_serializable(package="keras_amp")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` with float32 attention scores.

    Takes the same arguments as `keras.layers.MultiHeadAttention` and has the
    same weights. On every path (dropout, `return_attention_scores=True`,
    masks, `use_causal_mask=True`): query and key are cast to float32, then
    the scaling, QK^T, masking (with a float32 large negative number) and
    softmax are float32; the dropout on the probabilities is float32; the
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
        # `call` only passes `use_causal_mask` to the stock method; for a
        # subclass it folds the causal mask into `attention_mask` already.
        if use_causal_mask:
            causal_mask = self._compute_causal_mask(query, value)
            attention_mask = (
                causal_mask
                if attention_mask is None
                else ops.logical_and(ops.cast(attention_mask, "bool"), causal_mask)
            )
        # QK^T sums key_dim products: entries near 300 already exceed float16's
        # 65504, and bfloat16 rounds each logit to 8 bits. Scale, dot product,
        # mask and softmax therefore run in float32.
        query = ops.multiply(
            ops.cast(query, "float32"),
            ops.cast(self._inverse_sqrt_key_dim, "float32"),
        )
        key = ops.cast(key, "float32")
        attention_scores = ops.einsum(self._dot_product_equation, key, query)
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

"""`keras_amp.layers.MultiHeadAttention`: `keras.layers.MultiHeadAttention` with float32 scores.

The float32 computation is `keras_amp.numerics.attention.float32_attention`, which the op rules
also call for stock `keras.layers.MultiHeadAttention` and its subclasses.
"""

import keras

from keras_amp import model_graph, validation
from keras_amp import policy as amp_policy
from keras_amp.layers import arguments
from keras_amp.numerics.attention import float32_attention

# Keras version the overrides below were written against.
KERAS_VERSION = "3.15.1"


@keras.saving.register_keras_serializable(package="keras_amp")
class MultiHeadAttention(model_graph.Float32Island, arguments.CheckedArguments, keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` with float32 attention scores.

    Takes the same arguments as `keras.layers.MultiHeadAttention` and has the
    same weights and sublayers. On every path (dropout, `return_attention_scores=True`,
    masks, `use_causal_mask=True`, and `_compute_attention` called directly): the
    scaling and QK^T are computed in float32 (its gradient matmuls in the compute
    dtype), masking and softmax are float32, and so is the dropout on the
    probabilities; the probabilities are cast to the compute dtype for the value
    einsum; the projections and output are in the compute dtype. Returned attention
    scores are float32. Flash attention is not used (`flash_attention=True` raises),
    since the fused kernels compute QK^T in the compute dtype. `dropout`, `use_bias`
    and `attention_axes` are checked when the layer is created (stock checks them at
    build, or not at all).

    `xla_scores` (bool or None, keyword-only): the float32 scores as XLA computations (see
    `keras_amp.enable`). None (default) takes `keras_amp.config().xla_scores` when the layer is
    created (True when keras_amp is not enabled); read once there, never at trace time. Not
    part of the config: a loaded layer takes it from the config in force where it is loaded.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> mha = keras_amp.layers.MultiHeadAttention(num_heads=2, key_dim=16)
    >>> out, scores = mha(x, x, return_attention_scores=True)
    >>> scores.dtype
    tf.float32
    """

    STOCK = keras.layers.MultiHeadAttention
    ARGUMENT_CHECKS = {
        "dropout": arguments.check_rate,
        "use_bias": validation.check_bool,
        "attention_axes": arguments.check_optional_axis,
    }

    def __init__(self, num_heads, key_dim, *args, flash_attention=None, xla_scores=None, **kwargs):
        if xla_scores is None:
            config = amp_policy.config()
            xla_scores = config is None or config.xla_scores
        xla_scores = validation.check_bool("xla_scores", xla_scores)
        if flash_attention:
            raise ValueError(
                "keras_amp.layers.MultiHeadAttention computes attention scores "
                "explicitly in float32 and cannot use flash attention. "
                f"Received: flash_attention={flash_attention!r}. Allowed: None, False"
            )
        super().__init__(num_heads, key_dim, *args, flash_attention=False, **kwargs)
        self._xla_scores = xla_scores

    def get_config(self):
        config = super().get_config()
        config["flash_attention"] = None
        return config

    def _build_attention(self, rank):
        super()._build_attention(rank)
        # Float32 islands declared where built: the stock softmax and dropout sublayers
        # (the same two stock has, one seed generator) get the float32 policy, so the
        # probabilities stay float32 through the dropout, and `_masked_softmax` called
        # directly is float32 too.
        self._softmax.dtype_policy = "float32"
        self._dropout_layer.dtype_policy = "float32"

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
        # Stock `call` folds the causal mask into `attention_mask` for a subclass, but
        # subclasses and tests that call this method directly pass `use_causal_mask`.
        return float32_attention(
            self,
            query,
            key,
            value,
            attention_mask=attention_mask,
            training=training,
            return_attention_scores=return_attention_scores,
            use_causal_mask=use_causal_mask,
            compiled=self._xla_scores,
        )

    def compute_output_spec(self, query, value, key=None, *args, **kwargs):
        spec = super().compute_output_spec(query, value, key, *args, **kwargs)
        if isinstance(spec, tuple):
            output_spec, scores_spec = spec
            return output_spec, keras.KerasTensor(scores_spec.shape, dtype="float32")
        return spec

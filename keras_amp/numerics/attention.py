"""Float32 attention scores for `keras.layers.MultiHeadAttention` and its subclasses.

`float32_attention(layer, query, key, value, ...)` is the attention computation of
`MultiHeadAttention._compute_attention` with the scaled QK^T, the mask and the
softmax in float32. `keras_amp.layers.MultiHeadAttention` calls it from its
`_compute_attention`; the op rules call it for stock `keras.layers.MultiHeadAttention`
and for subclasses that keep the stock `_compute_attention` (keras-hub's
`CachedMultiHeadAttention`, for one).

Written against Keras 3.15.1. It reads three private attributes that stock
`MultiHeadAttention._build_attention` / `__init__` set and that have no public
accessor: `_dot_product_equation`, `_combine_equation` (the einsum equations for
the layer's `attention_axes`) and `_inverse_sqrt_key_dim` (the scale, which a
subclass may change), plus the `_dropout_layer` sublayer. `read_private` checks they
are there; the guard table pins the stock methods that set them.
"""

import keras
import tensorflow as tf
from keras import ops

from keras_amp.custom_gradient import custom_gradient
from keras_amp.numerics.islands import float32_kernels

# Keras version the private reads below were written against.
KERAS_VERSION = "3.15.1"

# Private attributes of a built `keras.layers.MultiHeadAttention` that float32_attention reads.
PRIVATE_ATTRIBUTES = (
    "_dot_product_equation",
    "_combine_equation",
    "_inverse_sqrt_key_dim",
    "_dropout_layer",
)

# Masked logits: far below any float32 logit, as stock Softmax uses for float32.
_MASKED_LOGIT = -1e9


def read_private(layer, name):
    """`layer.<name>` for one of PRIVATE_ATTRIBUTES; a clear error when Keras renamed it."""
    try:
        return getattr(layer, name)
    except AttributeError:
        raise TypeError(
            f"float32 attention needs a built keras.layers.MultiHeadAttention with the "
            f"`{name}` attribute of Keras {KERAS_VERSION}. Received: layer={layer.name!r} "
            f"of type {type(layer).__name__} (built={layer.built}) without it, "
            f"Keras {keras.__version__}"
        ) from None


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


def _einsum16(equation, a, b):
    """`einsum(equation, a, b)` of two operands of one 16-bit dtype, in that dtype.

    Through Keras's einsum, which runs MultiHeadAttention's equations as transposes and
    `tf.matmul` (BatchMatMulV2), as stock's own products; TF's Einsum kernel is several times
    slower for bfloat16 on a CPU without AVX-512 (BUILD_NOTES, "Op rules": MultiHeadAttention).
    Where the device's 16-bit matmul kernels are Eigen's (`islands.float32_kernels`: slower than
    or as slow as its float32 ones, and truncating their sums), float32 kernels on exact upcasts,
    rounded once: the product asked for, correctly rounded. `b`'s upcast is made once `a` exists:
    in a gradient, `a` is the incoming gradient and `b` a tensor kept from the forward pass, whose
    float32 copy would otherwise be made as soon as `b` exists and live through the forward pass.
    """
    if not float32_kernels(a.dtype):
        return ops.einsum(equation, a, b)
    with tf.control_dependencies([a]):
        b32 = tf.cast(b, tf.float32)
    return ops.cast(ops.einsum(equation, ops.cast(a, "float32"), b32), a.dtype)


def _gradient_matmuls(d_key_eq, d_query_eq, g, key, query):
    """d(key), d(query) from the 16-bit d(scores) `g`: two 16-bit matmuls (`_einsum16`)."""
    return _einsum16(d_key_eq, g, query), _einsum16(d_query_eq, g, key)


def value_einsum(equation, probs, value):
    """`einsum(equation, probs, value)` (attention's value product) in their 16-bit dtype.

    Keras's einsum, as stock's, except where the device's 16-bit kernels are Eigen's
    (`_einsum16`): then the product and its two gradients come from float32 kernels on exact
    upcasts, each rounded once, and the upcasts are made again in the backward pass, not kept.
    """
    equations = _gradient_equations(equation)
    if probs.dtype != value.dtype or equations is None or not float32_kernels(value.dtype):
        return ops.einsum(equation, probs, value)
    d_probs_eq, d_value_eq = equations

    @custom_gradient
    def product(probs, value):
        def grad(upstream):
            return _gradient_matmuls(d_probs_eq, d_value_eq, ops.cast(upstream, value.dtype), probs, value)

        return _einsum16(equation, probs, value), grad

    return product(probs, value)


@tf.function(jit_compile=True, autograph=False)
def _scores_float32_out(equation, key, query, scale):
    """`einsum(equation, key, query) * scale` of 16-bit operands, float32 accumulation and result.

    XLA folds the casts into a 16-bit dot with float32 accumulation: the result equals the float32
    einsum of the float32 copies (products of 16-bit numbers are exact in float32). A GPU runs it
    at the 16-bit matmul's speed; XLA's CPU dot computes in float32 (its oneDNN, XNNPACK and YNN
    options did not change that in TF 2.21). Without XLA, TensorFlow 2.21 runs that einsum as a
    float32 matmul on the CPU (no 16-bit x 16-bit -> float32 kernel there).
    """
    return tf.einsum(equation, tf.cast(key, tf.float32), tf.cast(query, tf.float32)) * scale


def float32_scores(equation, key, query, scale, *, compiled: bool):
    """`einsum(equation, key, query * scale)` with a float32 result, exact for 16-bit inputs.

    The forward matmul multiplies the 16-bit operands with float32 accumulation and a float32
    result (`_scores_float32_out`, XLA-compiled; with `compiled=False`, what
    `keras_amp.enable(xla_scores=False)` passes, a float32 matmul of float32 copies): the products of two 16-bit numbers are exact
    in float32, and the float32 output neither overflows (float16) nor rounds each logit to 8
    bits (bfloat16). The scale multiplies the float32 sum. The two gradient matmuls run in the
    inputs' (compute) dtype, as in the stock layer: the gradients of `key` and `query` are
    rounded to that dtype anyway, and 16-bit matmuls are the speed of mixed precision. A float16
    gradient that overflows becomes inf, which the loss-scale optimizer skips.
    """
    equations = _gradient_equations(equation)
    low = key.dtype
    if low == tf.float32 or equations is None:
        return ops.einsum(equation, ops.cast(key, "float32"), ops.multiply(ops.cast(query, "float32"), scale))
    d_key_eq, d_query_eq = equations

    @custom_gradient
    def scores(key, query):
        if compiled:
            # stop_gradient: the gradient is `grad` below; without it a tape would also build
            # TF's own gradient of the compiled call.
            result = _scores_float32_out(
                equation, tf.stop_gradient(key), tf.stop_gradient(query), tf.constant(scale, tf.float32)
            )
        else:
            result = tf.einsum(equation, tf.cast(key, tf.float32), tf.cast(query, tf.float32) * scale)

        def grad(upstream):
            g = tf.cast(upstream * scale, low)
            return _gradient_matmuls(d_key_eq, d_query_eq, g, key, query)

        return result, grad

    return scores(key, ops.cast(query, low))


def _causal_mask(query, value):
    """(1, T, S) lower-triangular bool mask, as stock `_compute_causal_mask` builds it."""
    rows = ops.reshape(ops.arange(ops.shape(query)[1], dtype="int32"), (1, -1, 1))
    cols = ops.reshape(ops.arange(ops.shape(value)[1], dtype="int32"), (1, 1, -1))
    return ops.greater_equal(rows, cols)


def _num_attention_axes(layer):
    axes = layer.attention_axes
    return 1 if isinstance(axes, int) else len(axes)


def _masked_softmax(scores, mask, num_axes):
    """Stock `_masked_softmax` + `Softmax.call` semantics, in float32, over the last `num_axes` axes."""
    axes = tuple(range(len(scores.shape) - num_axes, len(scores.shape)))
    if mask is not None:
        # Stock expands a (B, T, S) mask from the heads axis on: (B, 1, T, S).
        for _ in range(len(scores.shape) - len(mask.shape)):
            mask = ops.expand_dims(mask, axis=-num_axes * 2 - 1)
        if keras.backend.standardize_dtype(mask.dtype) != "bool":
            mask = ops.greater(mask, ops.cast(0.5, mask.dtype))
        scores = ops.where(mask, scores, _MASKED_LOGIT)
    if num_axes == 1:
        # One attention axis (the usual case): the fused float32 softmax kernel, forward and
        # backward. Five separate elementwise/reduction ops cost ~30% of the layer on the CPU.
        probs = ops.softmax(scores, axis=-1)
    else:
        # exp and the normaliser in float32; shift by the max (softmax is shift-invariant) so
        # several axes at once lose nothing either (stock uses exp(x - logsumexp(x)) there).
        scores = scores - ops.stop_gradient(ops.max(scores, axis=axes, keepdims=True))
        exp = ops.exp(scores)
        probs = exp / ops.sum(exp, axis=axes, keepdims=True)
    if mask is not None:
        # A fully masked row would be uniform: stock zeroes masked positions.
        probs = ops.where(mask, probs, 0.0)
    return probs


@tf.function(jit_compile=True, autograph=False)
def _probabilities_compiled(equation, key, query, scale, mask, num_axes, dtype):
    """`_masked_softmax(einsum(equation, key, query) * scale)` in float32, returned in `dtype`.

    One XLA computation: the 16-bit dot with float32 accumulation, the scale, the mask and the
    softmax fuse, so the float32 scores and probabilities are never written to memory.
    """
    scores = _scores_float32_out.python_function(equation, key, query, scale)
    return tf.cast(_masked_softmax(scores, mask, num_axes), dtype)


@tf.function(jit_compile=True, autograph=False)
def _scores_gradient_compiled(probs, upstream, scale, axes):
    """d(scaled scores) from the 16-bit probabilities: p * (g - sum(g * p)) * scale in float32,
    rounded to the probabilities' dtype for the two gradient matmuls (one fused XLA kernel)."""
    p = tf.cast(probs, tf.float32)
    g = tf.cast(upstream, tf.float32)
    return tf.cast(p * (g - tf.reduce_sum(g * p, axis=axes, keepdims=True)) * scale, probs.dtype)


def compute_dtype_probabilities(equation, key, query, scale, mask, num_axes):
    """Attention probabilities softmax(mask(einsum(equation, key, query) * scale)) for 16-bit
    `key`/`query`, computed in float32 and rounded once to their dtype; None when `equation` has
    no gradient equations of the closed form (see `_gradient_equations`).

    Forward: the 16-bit dot with float32 accumulation, the scale, the mask and the softmax in
    float32, then one rounding. Backward: d(scaled scores) = p * (g - sum(g * p)) * scale in
    float32 from the 16-bit probabilities (no float32 copy of a (B, N, T, S) tensor is kept for
    it; masked positions have p = 0 and get no gradient), rounded to the compute dtype, and the
    two gradient matmuls in the compute dtype, as stock's. The forward and the softmax gradient
    are XLA computations (`_probabilities_compiled`, `_scores_gradient_compiled`): fused, the
    float32 scores are never written to memory (the dot's speed: `_scores_float32_out`). Run
    uncompiled, this custom gradient measured a higher TF allocator peak than TF's own gradient
    of the unfused ops (283.5 vs 265 MiB on the benchmark Transformer), so without XLA
    (`enable(xla_scores=False)`) `float32_attention` uses the unfused ops instead.
    """
    equations = _gradient_equations(equation)
    if equations is None:
        return None
    d_key_eq, d_query_eq = equations
    low = key.dtype
    rank = len(equation.split("->")[1])
    axes = tuple(range(rank - num_axes, rank))
    scale_t = tf.constant(scale, tf.float32)

    @custom_gradient
    def probabilities(key, query):
        # stop_gradient: the gradient is `grad` below, not TF's own through the compiled call.
        probs = _probabilities_compiled(
            equation, tf.stop_gradient(key), tf.stop_gradient(query), scale_t, mask, num_axes, low
        )

        def grad(upstream):
            g = _scores_gradient_compiled(probs, tf.cast(upstream, low), scale_t, axes)
            return _gradient_matmuls(d_key_eq, d_query_eq, g, key, query)

        return probs, grad

    return probabilities(key, ops.cast(query, low))


def float32_attention(
    layer,
    query,
    key,
    value,
    attention_mask=None,
    training=None,
    return_attention_scores=False,
    use_causal_mask=False,
    scores_dtype=None,
    *,
    compiled: bool,
):
    """`MultiHeadAttention._compute_attention` with float32 scores; returns (output, scores).

    `compiled`: the scores as XLA computations (`keras_amp.enable(xla_scores=...)`, passed by
    the op rule and the layer; nothing here reads the global config).

    `layer` is a built `keras.layers.MultiHeadAttention` (stock, ours or a subclass);
    `query`/`key`/`value` are its projected `(B, T, N, H)` tensors. QK^T, the scale, the
    mask (`attention_mask`, and the causal mask when `use_causal_mask`) and the softmax are
    float32; the layer's own dropout is applied to the probabilities (with the layer's
    seed generator, so the random stream is stock's); the value einsum runs in `value`'s
    (compute) dtype. The returned scores are the pre-dropout probabilities in
    `scores_dtype` (default float32), or None when `return_attention_scores` is False.
    When `scores_dtype` is the 16-bit compute dtype (stock's contract, under the op rule)
    and the dropout, if any, computes in it, the probabilities are rounded to that dtype
    once, after the float32 softmax, and only that copy is kept for the backward pass
    (`compute_dtype_probabilities`): the memory stock uses.
    Flash attention is never used: its fused kernels compute QK^T in the compute dtype.
    """
    del return_attention_scores  # the probabilities exist anyway; the caller drops them
    # QK^T sums key_dim products: entries near 300 already exceed float16's 65504, and
    # bfloat16 rounds each logit to 8 bits. Scale, dot product, mask and softmax are float32.
    scale = float(read_private(layer, "_inverse_sqrt_key_dim"))
    equation = read_private(layer, "_dot_product_equation")
    if use_causal_mask:
        causal = _causal_mask(query, value)
        attention_mask = (
            causal if attention_mask is None else ops.logical_and(ops.cast(attention_mask, "bool"), causal)
        )
    num_axes = _num_attention_axes(layer)
    dropout = read_private(layer, "_dropout_layer") if layer.dropout > 0.0 else None
    low = keras.backend.standardize_dtype(value.dtype)
    if (
        scores_dtype == low != "float32"
        and keras.backend.standardize_dtype(key.dtype) == low
        and (dropout is None or dropout.compute_dtype == low)
    ):
        # Stock's contract (the op rule): probabilities leave in the compute dtype, and the
        # dropout, if any, runs there. Only the 16-bit probabilities are kept for the backward
        # pass, as stock keeps them: no float32 copy of a (B, N, T, S) tensor.
        probs = None
        if compiled:
            probs = compute_dtype_probabilities(equation, key, query, scale, attention_mask, num_axes)
        if probs is None:  # no XLA, or an equation without closed-form gradients: unfused
            probs = ops.cast(_masked_softmax(float32_scores(equation, key, query, scale, compiled=compiled),
                                             attention_mask, num_axes), low)
        dropped = probs if dropout is None else dropout(probs, training=training)
        return value_einsum(read_private(layer, "_combine_equation"), dropped, value), probs
    scores = float32_scores(equation, key, query, scale, compiled=compiled)
    probs = _masked_softmax(scores, attention_mask, num_axes)
    dropped = probs
    if dropout is not None:
        # A float32 Dropout (ours) keeps the probabilities float32 until the einsum; a
        # stock mixed-policy one casts them to the compute dtype first (one more rounding
        # of values in [0, 1 / (1 - rate)], where they are going anyway).
        dropped = dropout(probs, training=training)
    # Probabilities are in [0, 1]: the value einsum is safe (and fast) in the compute dtype.
    output = value_einsum(read_private(layer, "_combine_equation"), ops.cast(dropped, value.dtype), value)
    return output, ops.cast(probs, scores_dtype or "float32")

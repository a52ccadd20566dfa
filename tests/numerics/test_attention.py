"""keras_amp.numerics.attention: float32 scores of 16-bit operands (exact forward, compute-dtype gradients),
float32_attention on a stock layer and a keras-hub subclass, and the fused compute-dtype probabilities
with their float32 softmax gradient, against float64 references."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.numerics import attention
from tests.helpers import (
    MHA_SHAPE,
    MIXED,
    causal_mask,
    compiled_calls,
    identity_mha,
    mha_inputs,
    mha_projections,
    mha_reference,
    np64,
    u,
)

HEADS, KEY_DIM, DIM, T = MHA_SHAPE


@pytest.mark.parametrize("xla_scores", [True, False], ids=["xla", "float32_matmul"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_scores_exact_forward_and_compute_dtype_gradients(dtype, xla_scores):
    keras_amp.enable("mixed_" + dtype, xla_scores=xla_scores)
    # MultiHeadAttention's own equation and layout: key (B, S, H, D), query (B, T, H, D).
    equation = "aecd,abcd->acbe"
    rng = np.random.default_rng(7)
    # Integers up to 300 (exact in float16; bfloat16 rounds them, so the reference uses the
    # rounded values): their products (~9e4) overflow float16.
    key = tf.constant(rng.integers(-300, 301, (2, 6, 2, 16)), tf.float32)
    query = tf.constant(rng.integers(-300, 301, (2, 5, 2, 16)), tf.float32)
    key16, query16 = tf.cast(key, dtype), tf.cast(query, dtype)
    scale = 0.25
    # The forward runs as an XLA-compiled call, or (xla_scores=False) as plain graph ops.
    compiled = compiled_calls(lambda k, q: attention.float32_scores(equation, k, q, scale, compiled=xla_scores),
                               key16, query16)
    assert len(compiled) == (1 if xla_scores else 0)
    with tf.GradientTape() as tape:
        tape.watch([key16, query16])
        scores = attention.float32_scores(equation, key16, query16, scale, compiled=xla_scores)
        loss = tf.reduce_sum(tf.sin(scores / 1e4))
    d_key, d_query = tape.gradient(loss, [key16, query16])
    k64, q64 = np64(key16), np64(query16)
    ref = np.einsum(equation, k64, q64) * scale
    assert scores.dtype == tf.float32
    assert np.abs(ref).max() > 65504  # the float16 overflow case was really reached
    np.testing.assert_allclose(np64(scores), ref, rtol=1e-6)  # float32 accumulation of exact products
    # Gradients come back in the compute dtype and match float64 to its precision.
    assert d_key.dtype == dtype and d_query.dtype == dtype
    g = np.cos(ref / 1e4) / 1e4 * scale
    ref_d_query = np.einsum("acbe,aecd->abcd", g, k64)
    ref_d_key = np.einsum("acbe,abcd->aecd", g, q64)
    for got, want in ((d_query, ref_d_query), (d_key, ref_d_key)):
        np.testing.assert_allclose(np64(got), want, atol=8 * u("mixed_" + dtype) * np.abs(want).max())


def test_float32_scores_gradient_equations():
    # Closed form: d(key) contracts the upstream gradient with query, d(query) with key.
    assert attention._gradient_equations("aecd,abcd->acbe") == ("acbe,abcd->aecd", "acbe,aecd->abcd")
    # An index summed away from one operand alone has no einsum gradient of this form.
    assert attention._gradient_equations("aecdz,abcd->acbe") is None


@pytest.mark.parametrize("causal", [False, True], ids=["unmasked", "causal"])
@pytest.mark.parametrize("mixed_policy", MIXED, ids=lambda p: p)
def test_float32_attention_on_stock_layer(mixed_policy, causal):
    keras.config.set_dtype_policy(mixed_policy)
    q, k, v = mha_inputs()
    stock = identity_mha(keras.layers.MultiHeadAttention)
    pq, pk, pv = mha_projections(stock, q, k, v)
    out, scores = attention.float32_attention(
        stock, pq, pk, pv, return_attention_scores=True, use_causal_mask=causal, compiled=True
    )
    ref_out, ref_probs, ref_logits = mha_reference(np64(q), np64(k), np64(v), causal_mask() if causal else None)
    assert np.abs(ref_logits[np.isfinite(ref_logits)]).max() > 65504  # guard: overflows float16
    assert scores.dtype == tf.float32
    np.testing.assert_allclose(np64(scores), ref_probs, atol=1e-6)
    # Same bound as the subclass: value einsum in the compute dtype (before the output dense).
    split = lambda x: x.reshape(2, T, HEADS, KEY_DIM)  # noqa: E731
    assert keras.backend.standardize_dtype(out.dtype) == keras.dtype_policies.get(mixed_policy).compute_dtype
    np.testing.assert_allclose(np64(out), split(ref_out), atol=8 * u(mixed_policy) * 3 + 1e-5)
    # The stock layer's own computation on the same projections: QK^T overflows float16
    # (NaN) or rounds bfloat16 logits near 1e5 to spacing 512.
    stock_out, _ = stock._compute_attention(pq, pk, pv, return_attention_scores=True, use_causal_mask=causal)
    stock_err = np.abs(np64(stock_out) - split(ref_out)).max()
    assert not (stock_err < 0.1), stock_err


@pytest.mark.parametrize("mixed_policy", MIXED, ids=lambda p: p)
def test_float32_attention_scores_dtype_and_dropout_stream(mixed_policy):
    keras.config.set_dtype_policy(mixed_policy)
    q, k, v = mha_inputs()
    stock = identity_mha(keras.layers.MultiHeadAttention, dropout=0.5, seed=4)
    pq, pk, pv = mha_projections(stock, q, k, v)
    cdt = keras.dtype_policies.get(mixed_policy).compute_dtype
    out, scores = attention.float32_attention(
        stock, pq, pk, pv, training=True, return_attention_scores=True, scores_dtype=cdt, compiled=True
    )
    assert keras.backend.standardize_dtype(scores.dtype) == cdt
    ref_probs = mha_reference(np64(q), np64(k), np64(v))[1]
    np.testing.assert_allclose(np64(scores), ref_probs, atol=2 * u(mixed_policy))
    # The layer's dropout ran on the probabilities: the output is the value einsum of
    # probabilities that are 0 or p / (1 - rate), with at least one zeroed.
    no_drop, _ = attention.float32_attention(stock, pq, pk, pv, training=False, compiled=True)
    assert np.abs(np64(out) - np64(no_drop)).max() > 1e-2  # guard: dropout applied
    assert np.all(np.isfinite(np64(out)))


@pytest.mark.parametrize("causal", [False, True], ids=["unmasked", "causal"])
@pytest.mark.parametrize("mixed_policy", MIXED, ids=lambda p: p)
def test_compute_dtype_probabilities_and_their_float32_gradient(mixed_policy, causal):
    keras.config.set_dtype_policy(mixed_policy)
    # Stock's contract (the op rule): probabilities of the float32 scores rounded once to the
    # compute dtype; the gradient through the softmax computed in float32 from them, zero where
    # masked (a fully masked row too), then the gradient matmuls in the compute dtype.
    dtype = keras.dtype_policies.get(mixed_policy).compute_dtype
    rng = np.random.default_rng(11)
    key = tf.cast(tf.constant(rng.standard_normal((2, T, 3, KEY_DIM)) * 3), dtype)
    query = tf.cast(tf.constant(rng.standard_normal((2, T, 3, KEY_DIM)) * 3), dtype)
    upstream = rng.standard_normal((2, 3, T, T))
    mask = np.ones((2, T, T), bool) if not causal else np.broadcast_to(np.tril(np.ones((T, T), bool)), (2, T, T)).copy()
    mask[1, 2, :] = False  # a fully masked row
    equation, scale = "aecd,abcd->acbe", 0.3
    with tf.GradientTape() as tape:
        tape.watch([key, query])
        probs = attention.compute_dtype_probabilities(equation, key, query, scale, tf.constant(mask), 1)
        loss = tf.reduce_sum(tf.cast(probs, tf.float32) * upstream)
    d_key, d_query = tape.gradient(loss, [key, query])
    k64, q64 = np64(key), np64(query)
    m = mask[:, None]
    logits = np.where(m, np.einsum(equation, k64, q64) * scale, -np.inf)
    exp = np.where(m, np.exp(logits - np.max(np.where(m, logits, -1e300), axis=-1, keepdims=True)), 0.0)
    total = exp.sum(-1, keepdims=True)
    p64 = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
    d_scores = p64 * (upstream - (upstream * p64).sum(-1, keepdims=True)) * scale
    ref_d_query = np.einsum("acbe,aecd->abcd", d_scores, k64)
    ref_d_key = np.einsum("acbe,abcd->aecd", d_scores, q64)
    assert keras.backend.standardize_dtype(probs.dtype) == dtype
    np.testing.assert_allclose(np64(probs), p64, atol=u(mixed_policy))  # one rounding of p <= 1
    assert not np64(probs)[1, :, 2].any()  # the fully masked row: zeros
    assert d_key.dtype == dtype and d_query.dtype == dtype
    for got, want in ((d_query, ref_d_query), (d_key, ref_d_key)):
        np.testing.assert_allclose(np64(got), want, atol=8 * u(mixed_policy) * np.abs(want).max())
    # The forward is one XLA computation (no float32 matmul, no float32 scores in memory).
    calls = compiled_calls(
        lambda k, q: attention.compute_dtype_probabilities(equation, k, q, scale, tf.constant(mask), 1), key, query)
    assert len(calls) == 1


@pytest.mark.parametrize("causal", [False, True], ids=["unmasked", "causal"])
@pytest.mark.parametrize("mixed_policy", MIXED, ids=lambda p: p)
def test_fused_probabilities_equal_the_unfused_ops(mixed_policy, causal):
    # The XLA-fused forward does the float32 arithmetic of the unfused ops (float32 QK^T, mask,
    # float32 softmax, one rounding): the probabilities agree to within one 16-bit rounding. The
    # fused softmax gradient starts from the 16-bit probabilities, TF's from float32 ones: the
    # input gradients agree to a few 16-bit roundings (the bound of the float64 test above).
    keras_amp.enable(mixed_policy)
    dtype = keras.dtype_policies.get(mixed_policy).compute_dtype
    rng = np.random.default_rng(2)
    key = tf.cast(tf.constant(rng.standard_normal((2, T, HEADS, KEY_DIM)) * 3), dtype)
    query = tf.cast(tf.constant(rng.standard_normal((2, T, HEADS, KEY_DIM)) * 3), dtype)
    mask = tf.constant(np.tril(np.ones((T, T), bool))[None]) if causal else None
    upstream = tf.cast(tf.constant(rng.standard_normal((2, HEADS, T, T))), tf.float32)
    equation, scale = "aecd,abcd->acbe", 0.3
    results = []
    for fused in (True, False):
        with tf.GradientTape() as tape:
            tape.watch([key, query])
            if fused:
                probs = attention.compute_dtype_probabilities(equation, key, query, scale, mask, 1)
            else:
                scores = attention.float32_scores(equation, key, query, scale, compiled=False)  # unfused
                probs = tf.cast(attention._masked_softmax(scores, mask, 1), dtype)
            loss = tf.reduce_sum(tf.cast(probs, tf.float32) * upstream)
        results.append([probs] + tape.gradient(loss, [key, query]))
    for i, (fused, unfused) in enumerate(zip(*results)):
        assert fused.dtype == unfused.dtype == dtype
        bound = (2 if i == 0 else 8) * u(mixed_policy) * np.abs(np64(unfused)).max()
        np.testing.assert_allclose(np64(fused), np64(unfused), atol=bound)


def test_float32_attention_needs_built_layer():
    layer = keras.layers.MultiHeadAttention(HEADS, KEY_DIM)  # not built: no einsum equations yet
    x = tf.zeros((1, T, HEADS, KEY_DIM))
    with pytest.raises(TypeError, match="_dot_product_equation"):
        attention.float32_attention(layer, x, x, x, compiled=True)


@pytest.mark.parametrize("mixed_policy", MIXED, ids=lambda p: p)
def test_float32_attention_on_keras_hub_cached_attention(mixed_policy):
    """A keras-hub subclass that calls `_compute_attention` with its KV cache."""
    keras.config.set_dtype_policy(mixed_policy)
    cached_mha = pytest.importorskip("keras_hub.src.layers.modeling.cached_multi_head_attention")
    stock_cls = cached_mha.CachedMultiHeadAttention

    class Float32Cached(stock_cls):
        def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                               return_attention_scores=False, use_causal_mask=False):
            return attention.float32_attention(
                self, query, key, value, attention_mask, training, return_attention_scores, use_causal_mask,
                compiled=True,
            )

    q, k, v = mha_inputs()
    ref_out = mha_reference(np64(q), np64(k), np64(v), causal_mask())[0]
    results = {}
    for cls in (stock_cls, Float32Cached):
        layer = identity_mha(cls)
        cache = tf.zeros((2, 2, T, HEADS, KEY_DIM), layer.compute_dtype)
        out, cache = layer(q, v, k, attention_mask=causal_mask(), cache=cache, cache_update_index=0)
        results[cls] = np64(out)
        assert cache.shape == (2, 2, T, HEADS, KEY_DIM)
    assert np.isnan(results[stock_cls]).any() or np.abs(results[stock_cls] - ref_out).max() > 0.1
    np.testing.assert_allclose(results[Float32Cached], ref_out, atol=8 * u(mixed_policy) * 3 + 1e-5)


def test_guard_private_attributes_of_a_built_stock_layer():
    """float32_attention reads these private attributes of a built stock layer (Keras 3.15.1)."""
    layer = keras.layers.MultiHeadAttention(HEADS, KEY_DIM)
    layer.build((2, T, DIM), (2, T, DIM))
    for name in attention.PRIVATE_ATTRIBUTES:
        assert attention.read_private(layer, name) is getattr(layer, name)
    assert isinstance(layer._dot_product_equation, str) and "->" in layer._dot_product_equation
    assert isinstance(layer._combine_equation, str) and "->" in layer._combine_equation
    assert layer._inverse_sqrt_key_dim == pytest.approx(1 / np.sqrt(KEY_DIM))
    assert isinstance(layer._dropout_layer, keras.layers.Dropout)


@pytest.mark.parametrize("mixed_policy", MIXED, ids=lambda p: p)
def test_masks_of_different_ranks_in_one_process(mixed_policy):
    # The compiled score functions once relaxed their input shapes across calls (reduce_retracing):
    # after a rank-3 mask, a rank-4 mask reached `_masked_softmax` with an unknown rank and failed
    # (keras-hub SAM3 after another family in the same process). Each rank traces its own now.
    keras_amp.enable(mixed_policy)
    dtype = keras.dtype_policies.get(mixed_policy).compute_dtype
    rng = np.random.default_rng(3)
    key = tf.cast(tf.constant(rng.standard_normal((2, T, HEADS, KEY_DIM))), dtype)
    query = tf.cast(tf.constant(rng.standard_normal((2, T, HEADS, KEY_DIM))), dtype)
    causal = np.tril(np.ones((T, T), bool))
    for mask in (causal[None], causal[None, None], np.broadcast_to(causal, (2, 1, T, T)), causal[None]):
        probs = tf.function(lambda k, q, m: attention.compute_dtype_probabilities(
            "aecd,abcd->acbe", k, q, 0.3, m, 1))(key, query, tf.constant(mask))
        assert probs.shape == (2, HEADS, T, T)
        np.testing.assert_array_equal(np64(probs)[..., ~causal], 0.0)  # the mask holds on every call

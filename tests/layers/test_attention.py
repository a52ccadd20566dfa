"""MultiHeadAttention: float32 QK^T/softmax on every path vs float64; stock float16 gives NaN."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.layers import MultiHeadAttention
from keras_amp.layers import attention
from tests.keras_guard import source_digest
from tests.layers.conftest import MIXED, np64, softmax, u

HEADS, KEY_DIM, DIM, T = 2, 4, 8, 5


def _inputs():
    """Query/key entries of 256 (exact in float16 and bfloat16) so the scaled QK^T is
    0.5 * (a_t * b_s + 3 * 256**2) ~ 1e5 > 65504; only the first coordinate of each
    head varies (a_t in {+-1, +-2}, b_s small integers), giving O(1) logit differences.
    Every logit is exact in float32."""
    rng = np.random.default_rng(0)
    q = np.full((2, T, DIM), 256.0)
    k = np.full((2, T, DIM), 256.0)
    for h in range(HEADS):
        q[:, :, h * KEY_DIM] = rng.choice([-2.0, -1.0, 1.0, 2.0], size=(2, T))
        k[:, :, h * KEY_DIM] = rng.integers(-3, 4, size=(2, T))
    v = rng.standard_normal((2, T, DIM))
    return q.astype("float32"), k.astype("float32"), v.astype("float32")


def _make(cls, **kwargs):
    layer = cls(HEADS, KEY_DIM, kernel_initializer="zeros", **kwargs)
    q, k, v = _inputs()
    layer.build(q.shape, v.shape, k.shape)
    eye = np.eye(DIM, dtype="float32")
    for dense in (layer._query_dense, layer._key_dense, layer._value_dense):
        dense.kernel.assign(eye.reshape(DIM, HEADS, KEY_DIM))
    layer._output_dense.kernel.assign(eye.reshape(HEADS, KEY_DIM, DIM))
    return layer


def reference(q, k, v, mask=None):
    split = lambda x: x.reshape(x.shape[0], x.shape[1], HEADS, KEY_DIM)  # noqa: E731
    logits = np.einsum("bsnh,btnh->bnts", split(k), split(q)) / np.sqrt(KEY_DIM)
    if mask is not None:
        logits = np.where(mask[:, None], logits, -np.inf)
    probs = softmax(logits)
    out = np.einsum("bnts,bsnh->btnh", probs, split(v))
    return out.reshape(out.shape[0], T, DIM), probs, logits


PATHS = {
    "default": dict(),
    "dropout": dict(layer=dict(dropout=0.3, seed=1), call=dict(training=True)),
    "scores": dict(call=dict(return_attention_scores=True)),
    "attention_mask": dict(mask=True),
    "causal": dict(call=dict(use_causal_mask=True)),
}


def _run(cls, path):
    spec = PATHS[path]
    q, k, v = _inputs()
    layer = _make(cls, **spec.get("layer", {}))
    call = dict(spec.get("call", {}))
    mask = None
    if spec.get("mask"):
        mask = np.random.default_rng(3).uniform(size=(2, T, T)) > 0.4
        mask[:, :, 0] = True  # every query sees at least one key
        call["attention_mask"] = mask
    if path == "causal":
        mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (2, T, T))
    call["return_attention_scores"] = True if path in ("scores", "dropout") else call.get(
        "return_attention_scores", False
    )
    result = layer(q, v, k, **call)
    out, scores = result if isinstance(result, tuple) else (result, None)
    return out, scores, reference(np64(q), np64(k), np64(v), mask)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p)
def test_matches_float64_reference(policy, path):
    out, scores, (ref_out, ref_probs, ref_logits) = _run(MultiHeadAttention, path)
    assert np.abs(ref_logits[np.isfinite(ref_logits)]).max() > 65504  # guard: overflows float16
    assert keras.backend.standardize_dtype(out.dtype) == keras.dtype_policies.get(policy).compute_dtype
    if scores is not None:
        assert scores.dtype == tf.float32
        # Logits exact in float32, softmax float32.
        np.testing.assert_allclose(np64(scores), ref_probs, atol=1e-6)
    if path != "dropout":
        # Value/output projections and the probabilities-times-value einsum run in
        # the compute dtype: ~u relative error on values of size <= 3, twice.
        np.testing.assert_allclose(np64(out), ref_out, atol=8 * u(policy) * 3 + 1e-5)
    assert np.all(np.isfinite(np64(out)))


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p)
@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_stock_breaks_ours_holds(p, path):
    keras.config.set_dtype_policy(p)
    stock_out, stock_scores, (ref_out, ref_probs, _) = _run(keras.layers.MultiHeadAttention, path)
    ours_out, ours_scores, _ = _run(MultiHeadAttention, path)
    stock_err = np.abs(np64(stock_out) - ref_out).max()
    if p == "mixed_float16":
        assert np.isnan(np64(stock_out)).any()  # QK^T overflows float16 on every path
    elif path != "dropout":
        assert stock_err > 0.1, stock_err  # bfloat16 logits near 1e5 have spacing 512
    else:
        # Dropout makes the output random, but the returned scores are pre-dropout
        # probabilities: stock's bfloat16 ones are wrong, ours match float64.
        assert np.abs(np64(stock_scores) - ref_probs).max() > 0.1
    if path != "dropout":
        assert np.abs(np64(ours_out) - ref_out).max() < 8 * u(p) * 3 + 1e-5
    else:
        assert ours_scores.dtype == tf.float32
        np.testing.assert_allclose(np64(ours_scores), ref_probs, atol=1e-6)
    assert np.all(np.isfinite(np64(ours_out)))


def test_symbolic_scores_dtype_and_flash_attention(mixed_policy):
    x = keras.Input((T, DIM))
    out, scores = MultiHeadAttention(HEADS, KEY_DIM)(x, x, return_attention_scores=True)
    assert scores.dtype == "float32"
    assert out.dtype == keras.dtype_policies.get(mixed_policy).compute_dtype
    with pytest.raises(ValueError, match="flash_attention"):
        MultiHeadAttention(HEADS, KEY_DIM, flash_attention=True)


def test_gradients_match_float32(mixed_policy):
    # O(1) inputs: the projection kernels' gradients are compute-dtype matmuls
    # (as in stock); with entries of 256 they would cancel catastrophically.
    rng = np.random.default_rng(5)
    q, k, v = (tf.constant(rng.standard_normal((2, T, DIM)), tf.float32) for _ in range(3))
    grads = {}
    for p in ("float32", mixed_policy):
        layer = _make(MultiHeadAttention, dtype=p)
        with tf.GradientTape() as tape:
            tape.watch([q, v])
            loss = tf.reduce_sum(tf.cast(layer(q, v, k), tf.float32))
        grads[p] = tape.gradient(loss, [q, v] + layer.trainable_variables)
    # One scale for all gradients: the key bias's gradient is exactly 0 by
    # softmax shift-invariance, so only rounding noise of the others' size is left.
    scale = max(np.abs(np64(g)).max() for g in grads["float32"])
    for g32, gm in zip(grads["float32"], grads[mixed_policy]):
        np.testing.assert_allclose(np64(gm), np64(g32), atol=16 * u(mixed_policy) * scale)


STOCK = keras.layers.MultiHeadAttention
PINNED_SHA256 = {
    "_compute_attention": "88168a1a82dd0d31",
    "_build_attention": "26399b12f2810501",
    "_masked_softmax": "f2b05c4b4388a750",
    "call": "fd666cb2fe09b101",
}


def test_guard_stock_keras_unchanged():
    assert keras.__version__.startswith("3.15"), keras.__version__
    assert attention.KERAS_VERSION == "3.15.1"
    digests = {
        name: source_digest(getattr(STOCK, name))
        for name in PINNED_SHA256
    }
    assert digests == PINNED_SHA256, (
        "Stock MultiHeadAttention changed: re-check keras_amp/layers/attention.py "
        f"against it, then update PINNED_SHA256. Now: {digests}"
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_scores_exact_forward_and_compute_dtype_gradients(dtype):
    # MultiHeadAttention's own equation and layout: key (B, S, H, D), query (B, T, H, D).
    equation = "aecd,abcd->acbe"
    rng = np.random.default_rng(7)
    # Integers up to 300 (exact in float16; bfloat16 rounds them, so the reference uses the
    # rounded values): their products (~9e4) overflow float16.
    key = tf.constant(rng.integers(-300, 301, (2, 6, 2, 16)), tf.float32)
    query = tf.constant(rng.integers(-300, 301, (2, 5, 2, 16)), tf.float32)
    key16, query16 = tf.cast(key, dtype), tf.cast(query, dtype)
    scale = 0.25
    with tf.GradientTape() as tape:
        tape.watch([key16, query16])
        scores = attention.float32_scores(equation, key16, query16, scale)
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
    assert attention._gradient_equations("aecd,abcd->acbe") == ("acbe,abcd->aecd", "acbe,aecd->abcd")
    # An index summed away from one operand alone has no einsum gradient of this form.
    assert attention._gradient_equations("aecdz,abcd->acbe") is None

"""MultiHeadAttention: float32 QK^T/softmax on every path vs float64; stock float16 gives NaN."""


import keras
import keras_amp
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.layers import MultiHeadAttention
from keras_amp.numerics import attention
from tests.helpers import MIXED, np64, softmax, u

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


def _compiled_calls(fn, *args):
    """Function-call ops that XLA must compile, in the traced graph of `fn(*args)`."""
    graph = tf.function(fn).get_concrete_function(*args).graph
    return [op for op in graph.get_operations() if "_XlaMustCompile" in op.node_def.attr]


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
    compiled = _compiled_calls(lambda k, q: attention.float32_scores(equation, k, q, scale, compiled=xla_scores),
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


# --- float32_attention: the one float32 attention computation, for stock layers and subclasses.


def _projected(layer, q, k, v):
    """The layer's own (B, T, N, H) projections, as `call` feeds `_compute_attention`."""
    return layer._query_dense(q), layer._key_dense(k), layer._value_dense(v)


def _causal(batch=2):
    return np.broadcast_to(np.tril(np.ones((T, T), bool)), (batch, T, T))


@pytest.mark.parametrize("causal", [False, True], ids=["unmasked", "causal"])
def test_float32_attention_on_stock_layer(mixed_policy, causal):
    q, k, v = _inputs()
    stock = _make(keras.layers.MultiHeadAttention)
    pq, pk, pv = _projected(stock, q, k, v)
    out, scores = attention.float32_attention(
        stock, pq, pk, pv, return_attention_scores=True, use_causal_mask=causal, compiled=True
    )
    ref_out, ref_probs, ref_logits = reference(np64(q), np64(k), np64(v), _causal() if causal else None)
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


def test_float32_attention_scores_dtype_and_dropout_stream(mixed_policy):
    q, k, v = _inputs()
    stock = _make(keras.layers.MultiHeadAttention, dropout=0.5, seed=4)
    pq, pk, pv = _projected(stock, q, k, v)
    cdt = keras.dtype_policies.get(mixed_policy).compute_dtype
    out, scores = attention.float32_attention(
        stock, pq, pk, pv, training=True, return_attention_scores=True, scores_dtype=cdt, compiled=True
    )
    assert keras.backend.standardize_dtype(scores.dtype) == cdt
    ref_probs = reference(np64(q), np64(k), np64(v))[1]
    np.testing.assert_allclose(np64(scores), ref_probs, atol=2 * u(mixed_policy))
    # The layer's dropout ran on the probabilities: the output is the value einsum of
    # probabilities that are 0 or p / (1 - rate), with at least one zeroed.
    no_drop, _ = attention.float32_attention(stock, pq, pk, pv, training=False, compiled=True)
    assert np.abs(np64(out) - np64(no_drop)).max() > 1e-2  # guard: dropout applied
    assert np.all(np.isfinite(np64(out)))


@pytest.mark.parametrize("causal", [False, True], ids=["unmasked", "causal"])
def test_compute_dtype_probabilities_and_their_float32_gradient(mixed_policy, causal):
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
    calls = _compiled_calls(
        lambda k, q: attention.compute_dtype_probabilities(equation, k, q, scale, tf.constant(mask), 1), key, query)
    assert len(calls) == 1


@pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning")
@pytest.mark.parametrize("xla_scores", [True, False], ids=["xla", "uncompiled"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "dropout"])
def test_stock_layer_under_the_op_rule_gradients_match_float32(mixed_policy, dropout, xla_scores, monkeypatch):
    # The op rule's path (stock MultiHeadAttention, compute-dtype probabilities kept for the
    # backward pass): same bound as our layer's gradients against float32. Inference mode:
    # dropout is then the identity, so the two runs compare like for like.
    keras_amp.enable(mixed_policy, xla_scores=xla_scores)
    ran = []
    original = attention.compute_dtype_probabilities
    monkeypatch.setattr(attention, "compute_dtype_probabilities", lambda *a: ran.append("fused") or original(*a))
    rng = np.random.default_rng(5)
    q, k, v = (tf.constant(rng.standard_normal((2, T, DIM)), tf.float32) for _ in range(3))
    grads = {}
    for p in ("float32", mixed_policy):
        layer = _make(keras.layers.MultiHeadAttention, dtype=p, dropout=dropout)
        with tf.GradientTape() as tape:
            tape.watch([q, v])
            loss = tf.reduce_sum(tf.cast(layer(q, v, k, use_causal_mask=True), tf.float32))
        grads[p] = tape.gradient(loss, [q, v] + layer.trainable_variables)
    assert ran == (["fused"] if xla_scores else [])  # guard: the fused path ran (once) only with XLA
    scale = max(np.abs(np64(g)).max() for g in grads["float32"])
    for g32, gm in zip(grads["float32"], grads[mixed_policy]):
        np.testing.assert_allclose(np64(gm), np64(g32), atol=16 * u(mixed_policy) * scale)


@pytest.mark.parametrize("causal", [False, True], ids=["unmasked", "causal"])
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


@pytest.mark.parametrize("cls", [MultiHeadAttention, keras.layers.MultiHeadAttention], ids=["ours", "stock"])
def test_compute_attention_honours_use_causal_mask(mixed_policy, cls):
    """Called directly (as subclasses and Keras's tests do), `use_causal_mask` is applied."""
    q, k, v = _inputs()
    layer = _make(cls) if cls is MultiHeadAttention else _make(cls, dropout=0.1)  # stock: explicit path
    pq, pk, pv = _projected(layer, q, k, v)
    _, scores = layer._compute_attention(pq, pk, pv, return_attention_scores=True, use_causal_mask=True)
    future = ~np.tril(np.ones((T, T), bool))
    leak = np64(scores)[..., future]
    if cls is MultiHeadAttention:
        assert np.all(leak == 0)
        ref_probs = reference(np64(q), np64(k), np64(v), _causal())[1]
        np.testing.assert_allclose(np64(scores), ref_probs, atol=1e-6)
    else:
        assert np.all(leak[np.isfinite(leak)] == 0)  # stock masks too, in 16 bits


def _sublayers(layer):
    # Class names (stock's own classes) in order; layer names get per-session suffixes.
    return [type(s).__name__ for s in layer._flatten_layers(include_self=False)]


def test_same_sublayers_and_variables_as_stock(mixed_policy):
    """No dead sublayers: stock's softmax and dropout, made float32; one seed generator."""
    x = _inputs()[0]
    stock = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, dropout=0.2, seed=1)
    ours = MultiHeadAttention(HEADS, KEY_DIM, dropout=0.2, seed=1)
    stock(x, x)
    ours(x, x)
    assert _sublayers(ours) == _sublayers(stock)
    assert [v.path.split("/")[-1] for v in ours.variables] == [v.path.split("/")[-1] for v in stock.variables]
    assert sum("seed_generator" in v.path for v in ours.variables) == 1
    assert ours._softmax.compute_dtype == "float32" and ours._dropout_layer.compute_dtype == "float32"
    assert stock._softmax.compute_dtype == keras.dtype_policies.get(mixed_policy).compute_dtype
    # Same seed, same dropout stream: with equal weights, ours and stock drop the same entries.
    ours.set_weights(stock.get_weights())
    keras.config.set_dtype_policy("float32")
    s32 = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, dropout=0.5, seed=3)
    o32 = MultiHeadAttention(HEADS, KEY_DIM, dropout=0.5, seed=3)
    s32(x, x)
    o32(x, x)
    o32.set_weights(s32.get_weights())
    a, b = s32(x, x, training=True), o32(x, x, training=True)
    assert np.abs(np64(a) - np64(s32(x, x, training=False))).max() > 1e-3  # guard: dropout ran
    np.testing.assert_allclose(np64(b), np64(a), rtol=1e-5, atol=1e-5)


def test_float32_attention_on_keras_hub_cached_attention(mixed_policy):
    """A keras-hub subclass that calls `_compute_attention` with its KV cache."""
    cached_mha = pytest.importorskip("keras_hub.src.layers.modeling.cached_multi_head_attention")
    stock_cls = cached_mha.CachedMultiHeadAttention

    class Float32Cached(stock_cls):
        def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                               return_attention_scores=False, use_causal_mask=False):
            return attention.float32_attention(
                self, query, key, value, attention_mask, training, return_attention_scores, use_causal_mask,
                compiled=True,
            )

    q, k, v = _inputs()
    ref_out = reference(np64(q), np64(k), np64(v), _causal())[0]
    results = {}
    for cls in (stock_cls, Float32Cached):
        layer = _make(cls)
        cache = tf.zeros((2, 2, T, HEADS, KEY_DIM), layer.compute_dtype)
        out, cache = layer(q, v, k, attention_mask=_causal(), cache=cache, cache_update_index=0)
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


def test_xla_scores_is_read_once_when_the_layer_is_created_never_at_trace_time(mixed_policy):
    # Issue 25: trace-time options are passed, not read from the global config.
    keras_amp.enable(mixed_policy, xla_scores=False)
    unfused = MultiHeadAttention(HEADS, KEY_DIM)
    explicit = MultiHeadAttention(HEADS, KEY_DIM, xla_scores=True)
    keras_amp.enable(mixed_policy)  # xla_scores=True now: the layers keep what they were made with
    x = tf.constant(np.ones((1, T, DIM)), keras.dtype_policies.get(mixed_policy).compute_dtype)
    assert _compiled_calls(lambda a: unfused(a, a), x) == []
    assert len(_compiled_calls(lambda a: explicit(a, a), x)) >= 1
    with pytest.raises(TypeError, match="xla_scores"):
        MultiHeadAttention(HEADS, KEY_DIM, xla_scores="yes")


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

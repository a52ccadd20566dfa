"""keras_amp.layers.MultiHeadAttention: float32 QK^T/softmax on every path vs float64; stock float16 gives
NaN. (The float32 computation itself, `keras_amp.numerics.attention`, is tested in
tests/numerics/test_attention.py; the op rule for stock layers in tests/op_rules/test_attention.py.)"""


import keras
import keras_amp
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.layers import MultiHeadAttention
from tests.helpers import MHA_SHAPE, MIXED, causal_mask, compiled_calls, identity_mha, mha_inputs, np64, u
from tests.helpers import mha_projections, mha_reference

HEADS, KEY_DIM, DIM, T = MHA_SHAPE


PATHS = {
    "default": dict(),
    "dropout": dict(layer=dict(dropout=0.3, seed=1), call=dict(training=True)),
    "scores": dict(call=dict(return_attention_scores=True)),
    "attention_mask": dict(mask=True),
    "causal": dict(call=dict(use_causal_mask=True)),
}


def _run(cls, path):
    spec = PATHS[path]
    q, k, v = mha_inputs()
    layer = identity_mha(cls, **spec.get("layer", {}))
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
    return out, scores, mha_reference(np64(q), np64(k), np64(v), mask)


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
        layer = identity_mha(MultiHeadAttention, dtype=p)
        with tf.GradientTape() as tape:
            tape.watch([q, v])
            loss = tf.reduce_sum(tf.cast(layer(q, v, k), tf.float32))
        grads[p] = tape.gradient(loss, [q, v] + layer.trainable_variables)
    # One scale for all gradients: the key bias's gradient is exactly 0 by
    # softmax shift-invariance, so only rounding noise of the others' size is left.
    scale = max(np.abs(np64(g)).max() for g in grads["float32"])
    for g32, gm in zip(grads["float32"], grads[mixed_policy]):
        np.testing.assert_allclose(np64(gm), np64(g32), atol=16 * u(mixed_policy) * scale)


@pytest.mark.parametrize("cls", [MultiHeadAttention, keras.layers.MultiHeadAttention], ids=["ours", "stock"])
def test_compute_attention_honours_use_causal_mask(mixed_policy, cls):
    """Called directly (as subclasses and Keras's tests do), `use_causal_mask` is applied."""
    q, k, v = mha_inputs()
    layer = identity_mha(cls) if cls is MultiHeadAttention else identity_mha(cls, dropout=0.1)  # stock: explicit path
    pq, pk, pv = mha_projections(layer, q, k, v)
    _, scores = layer._compute_attention(pq, pk, pv, return_attention_scores=True, use_causal_mask=True)
    future = ~np.tril(np.ones((T, T), bool))
    leak = np64(scores)[..., future]
    if cls is MultiHeadAttention:
        assert np.all(leak == 0)
        ref_probs = mha_reference(np64(q), np64(k), np64(v), causal_mask())[1]
        np.testing.assert_allclose(np64(scores), ref_probs, atol=1e-6)
    else:
        assert np.all(leak[np.isfinite(leak)] == 0)  # stock masks too, in 16 bits


def _sublayers(layer):
    # Class names (stock's own classes) in order; layer names get per-session suffixes.
    return [type(s).__name__ for s in layer._flatten_layers(include_self=False)]


def test_same_sublayers_and_variables_as_stock(mixed_policy):
    """No dead sublayers: stock's softmax and dropout, made float32; one seed generator."""
    x = mha_inputs()[0]
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


def test_xla_scores_is_read_once_when_the_layer_is_created_never_at_trace_time(mixed_policy):
    # Issue 25: trace-time options are passed, not read from the global config.
    keras_amp.enable(mixed_policy, xla_scores=False)
    unfused = MultiHeadAttention(HEADS, KEY_DIM)
    explicit = MultiHeadAttention(HEADS, KEY_DIM, xla_scores=True)
    keras_amp.enable(mixed_policy)  # xla_scores=True now: the layers keep what they were made with
    x = tf.constant(np.ones((1, T, DIM)), keras.dtype_policies.get(mixed_policy).compute_dtype)
    assert compiled_calls(lambda a: unfused(a, a), x) == []
    assert len(compiled_calls(lambda a: explicit(a, a), x)) >= 1
    with pytest.raises(TypeError, match="xla_scores"):
        MultiHeadAttention(HEADS, KEY_DIM, xla_scores="yes")

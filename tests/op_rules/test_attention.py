"""keras_amp.op_rules.attention: MultiHeadAttention's scores in float32 under the op rule, where stock
16-bit QK^T overflows (float16) or loses the logits' differences (bfloat16), with stock's output
contract and gradients; and the attention scores of a keras-hub Llama, found at its softmax."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import op_rules
from keras_amp.diagnostics import audit
from keras_amp.numerics import attention
from tests.helpers import MHA_SHAPE, MIXED, causal_mask, identity_mha, mha_reference, np64, u

pytestmark = [
    pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning"),
    pytest.mark.usefixtures("no_op_rules"),
]
HEADS, KEY_DIM, DIM, T = MHA_SHAPE


def _mha_input(batch=2, length=5, seed=0, choices=(-2, -1, 0, 1, 2)):
    # Rows = 300 + deviations (u, -u, v, -v) per head of 4: q.k ~ 180000 per head overflows
    # float16, while c.dev = 0 keeps the logits' *differences* small, so the softmax is smooth.
    u, v = np.random.RandomState(seed).choice(choices, (2, batch, length, 2))
    dev = np.stack([u, -u, v, -v], axis=-1).reshape(batch, length, 8)
    return 300.0 + dev.astype(np.float64)  # exact in float16 (and in bfloat16 for even choices)


class PlainSubclass(keras.layers.MultiHeadAttention):
    """Keeps the stock `_compute_attention`, as keras-hub's CachedMultiHeadAttention does."""



@pytest.mark.parametrize(
    "case, kwargs, call",
    [
        ("dropout", {"dropout": 0.5}, {}),
        ("scores", {}, {"return_attention_scores": True}),
        ("causal", {}, {"use_causal_mask": True}),
        ("subclass", {"cls": PlainSubclass}, {}),
    ],
)
def test_attention_kind_multi_head_attention_near_300(case, kwargs, call):
    keras_amp.enable("mixed_float16")
    x = _mha_input()
    layer = identity_mha(**kwargs)
    op_rules.uninstall()
    stock = keras.tree.flatten(layer(x, x, **call))
    assert np.isnan(stock[0].numpy()).any()  # stock float16 QK^T overflows: NaN
    op_rules.install("float16")
    result = keras.tree.flatten(layer(x, x, **call))
    ref_out, ref_probs, _ = mha_reference(x, x, x, causal_mask() if call.get("use_causal_mask") else None)
    assert (ref_probs.max(-1) < 0.9).mean() > 0.3  # guard: a smooth softmax, not one-hot rows
    assert result[0].dtype == tf.float16  # the stock output contract
    # float32 logits near 1.8e5 carry ~0.01 absolute error; outputs near 300 have float16 ulp 0.25.
    np.testing.assert_allclose(result[0].numpy().astype(np.float64), ref_out, atol=0.25, rtol=0)
    if case == "scores":
        assert result[1].dtype == tf.float16
        np.testing.assert_allclose(result[1].numpy().astype(np.float64), ref_probs, atol=5e-3, rtol=0)
    if case == "dropout":
        trained = layer(x, x, training=True)
        assert np.isfinite(trained.numpy()).all()
        assert not np.allclose(trained.numpy(), result[0].numpy())  # guard: dropout really applied


def test_attention_symbolic_and_eager_dtypes_match():
    keras_amp.enable("mixed_float16")
    inp = keras.Input((5, 8))
    out, scores = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)(inp, inp, return_attention_scores=True)
    model = keras.Model(inp, [out, scores])
    eager = model(_mha_input())
    assert [t.dtype for t in model.outputs] == ["float16", "float16"]
    assert [t.dtype.name for t in eager] == ["float16", "float16"]
    assert all(np.isfinite(t.numpy()).all() for t in eager)


def test_attention_kind_bfloat16_logits_keep_their_differences():
    keras_amp.enable("mixed_bfloat16")
    x = _mha_input(choices=(-2, 0, 2))  # exact in bfloat16 (ulp 2 at 300)
    layer = identity_mha()
    ref_probs = mha_reference(x, x, x)[1]
    assert (ref_probs.max(-1) < 0.9).mean() > 0.3  # guard: a smooth softmax, not one-hot rows
    op_rules.uninstall()
    _, stock = layer(x, x, return_attention_scores=True)
    # bfloat16 logits near 1.8e5 have an ulp of 1024: their differences (~10) are lost.
    assert np.abs(tf.cast(stock, tf.float64).numpy() - ref_probs).max() > 0.1
    op_rules.install("bfloat16")
    _, ours = layer(x, x, return_attention_scores=True)
    assert ours.dtype == tf.bfloat16
    np.testing.assert_allclose(tf.cast(ours, tf.float64).numpy(), ref_probs, atol=8e-3, rtol=0)  # bf16 ulp at 1: 8e-3



@pytest.mark.parametrize("xla_scores", [True, False], ids=["xla", "uncompiled"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("mixed_policy", MIXED, ids=lambda p: p)
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
        layer = identity_mha(keras.layers.MultiHeadAttention, dtype=p, dropout=dropout)
        with tf.GradientTape() as tape:
            tape.watch([q, v])
            loss = tf.reduce_sum(tf.cast(layer(q, v, k, use_causal_mask=True), tf.float32))
        grads[p] = tape.gradient(loss, [q, v] + layer.trainable_variables)
    assert ran == (["fused"] if xla_scores else [])  # guard: the fused path ran (once) only with XLA
    scale = max(np.abs(np64(g)).max() for g in grads["float32"])
    for g32, gm in zip(grads["float32"], grads[mixed_policy]):
        np.testing.assert_allclose(np64(gm), np64(g32), atol=16 * u(mixed_policy) * scale)


def _scores_matmul_dtypes(model, x):
    """The dtype of each QK^T matmul feeding a Softmax, in the traced forward graph (inside calls)."""
    graph = tf.function(lambda x: model(x, training=False)).get_concrete_function(x).graph
    found = [audit.scores_matmul(op) for op in graph.get_operations() if op.type == "Softmax"]
    return [audit.op_dtype(matmul) for _, matmul in filter(None, found)]


def _tiny_llama():
    import keras_hub

    return keras_hub.models.LlamaBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
        intermediate_dim=32,
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_scores_keras_hub_llama(policy):
    keras_amp.enable(policy)
    compute = keras_amp.config().compute_dtype
    model = _tiny_llama()
    tokens = np.random.RandomState(0).randint(1, 50, (2, 6)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    op_rules.uninstall()
    assert _scores_matmul_dtypes(model, x) == [compute]  # stock: QK^T in 16 bits
    op_rules.install(compute)
    assert _scores_matmul_dtypes(model, x) == ["float32"]
    report = audit.audit_model(model, x)
    assert any(r.category == "softmax" for r in report.records)  # guard: the audit ran the attention
    assert not [r for r in report.low_precision() if r.category == "attention"], str(report)
    assert np.isfinite(np64(model(x))).all()

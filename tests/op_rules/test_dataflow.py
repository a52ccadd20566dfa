"""Attention scores and normalisation statistics found by dataflow (keras_amp/op_rules/dataflow.py).

Each form a model may write its scores in (a literal einsum, `ops.matmul`, `@`, `tf.matmul`,
three disentangled terms, `ops.dot_product_attention`) and each hand-written norm is checked
against a float64 NumPy reference, beside stock Keras on the same inputs: stock overflows
(float16) or rounds (bfloat16), ours holds. The checks run inside `tf.function`, where the
rules read the graph; nothing in a layer here has a name or attribute a rule could key on.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_amp
from keras_amp import hardware, op_rules
from keras_amp.op_rules import dataflow
from tests.helpers import live_ops, np64, softmax

MIXED = {"mixed_float16": tf.float16, "mixed_bfloat16": tf.bfloat16}
pytestmark = pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning")


def _near_300(shape, choices=(-2, 0, 2), seed=0):
    # 300 + small even integers: exact in float16 (ulp 0.25) and bfloat16 (ulp 2); q.k over 8
    # entries is ~7.2e5, past float16's 65504.
    rng = np.random.RandomState(seed)
    return 300.0 + rng.choice(choices, shape).astype(np.float64)


def _scores(form, q, k):
    """q (b, t, h), k (b, s, h) -> (b, t, s), written as a model might."""
    if form == "einsum":
        return ops.einsum("bth,bsh->bts", q, k)
    if form == "einsum_heads_first":  # keras-hub Falcon / GPT-NeoX style: another literal equation
        return ops.transpose(ops.einsum("bsh,bth->bst", k, q), (0, 2, 1))
    if form == "ops_matmul":  # Bloom
        return ops.matmul(q, ops.transpose(k, (0, 2, 1)))
    if form == "at_operator":  # SegFormer's MiT: q @ k on tensors
        return q @ tf.transpose(k, (0, 2, 1))
    if form == "tf_matmul":
        return tf.matmul(q, k, transpose_b=True)
    raise ValueError(form)


FORMS = ("einsum", "einsum_heads_first", "ops_matmul", "at_operator", "tf_matmul")


def _attention(form, q, k, v, scale):
    # Scale, a reshape round trip and a mask add on the way, as attention layers write them.
    s = _scores(form, q, k) * scale
    s = ops.reshape(ops.reshape(s, (-1,)), ops.shape(s))
    s = s + ops.zeros_like(s)
    p = ops.softmax(s, axis=-1)
    return p, ops.matmul(p, v)


def _reference(q, k, v, scale):
    p = softmax(np.einsum("bth,bsh->bts", q, k) * scale)
    return p, p @ v


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("policy", MIXED)
def test_scores_however_written_are_float32_stock_is_not(policy, form):
    dtype = MIXED[policy]
    q, k = _near_300((2, 5, 8)), _near_300((2, 6, 8), seed=1)
    v = np.random.RandomState(2).normal(size=(2, 6, 4))
    scale = 1.0 / 4096  # logits ~176 with differences ~1: smooth rows; float16 QK^T is inf
    ref_p, ref_out = _reference(q, k, v, scale)
    assert (ref_p.max(-1) < 0.95).mean() > 0.3  # guard: smooth rows, where rounding shows
    args = [tf.constant(a, dtype) for a in (q, k, v)]
    keras_amp.enable(policy)
    step = tf.function(lambda q, k, v: _attention(form, q, k, v, scale))
    op_rules.uninstall()
    stock_p, _ = step(*args)
    stock_error = np.nan_to_num(np.abs(np64(stock_p) - ref_p), nan=1.0).max()
    # float16: the logits overflow (NaN rows); bfloat16: 8-bit logits ~1e4 lose their differences.
    assert stock_error > 0.05, stock_error
    op_rules.install(dtype.name)
    step = tf.function(lambda q, k, v: _attention(form, q, k, v, scale))
    p, out = step(*args)
    assert p.dtype == out.dtype == dtype  # the layer's code gets the dtypes it was written for
    ulp = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype.name]
    np.testing.assert_allclose(np64(p), ref_p, atol=2 * ulp, rtol=0)  # one rounding of p
    np.testing.assert_allclose(np64(out), ref_out, atol=8 * ulp * np.abs(v).max(), rtol=0)


def _live_matmuls(graph_fn, *args):
    """(op type, output dtype) of each matmul a traced function's outputs depend on."""
    graph = tf.function(graph_fn).get_concrete_function(*args).graph
    return sorted((op.type, op.outputs[0].dtype.name) for op in live_ops(graph) if op.type in dataflow.MATMULS)


def test_value_matmul_and_dense_layers_keep_the_compute_dtype(monkeypatch):
    # A device with float16 matmul kernels (on one without, the Dense's product is float32 kernels':
    # tests/numerics/test_float32_kernels.py).
    monkeypatch.setattr(hardware, "emulated", lambda dtype: False)
    keras_amp.enable("mixed_float16")
    dense = keras.layers.Dense(4)
    dense.build((None, 8))
    q, k, v = (tf.constant(np.ones((2, 5, 8)), tf.float16) for _ in range(3))

    def block(q, k, v):
        p = ops.softmax(ops.einsum("bth,bsh->bts", q, k))
        return dense(ops.matmul(p, v))

    found = _live_matmuls(block, q, k, v)
    # The score term runs as a float32-output einsum inside the compiled call; the value matmul
    # and the Dense kernel's matmul stay float16.
    assert ("Einsum", "float32") in found
    assert ("BatchMatMulV2", "float16") in found and ("MatMul", "float16") in found, found
    assert ("Einsum", "float16") not in found, found  # the 16-bit original is left dead


def test_a_dense_head_feeding_a_softmax_is_not_a_score():
    keras_amp.enable("mixed_bfloat16")
    head = keras.layers.Dense(4, activation="softmax")
    x = tf.constant(np.ones((2, 8)), tf.bfloat16)
    head.build((None, 8))
    # Its matmul has a weight operand: a classifier head, not attention (Logits / the recipe's
    # float32 head are for that). The softmax itself still runs in float32.
    assert _live_matmuls(lambda x: head(x), x) == [("MatMul", "bfloat16")]


@pytest.mark.parametrize("policy", MIXED)
def test_three_disentangled_score_terms_are_each_float32(policy):
    dtype = MIXED[policy]
    rng = np.random.RandomState(0)
    q, k = _near_300((2, 4, 8)), _near_300((2, 4, 8), seed=1)
    pos_k, pos_q = _near_300((7, 8), seed=2), _near_300((7, 8), seed=3)  # relative embeddings
    index = (np.arange(4)[:, None] - np.arange(4)[None, :] + 3).astype(np.int32)  # (t, s) -> bucket
    scale = 1.0 / 12288

    def deberta(q, k, pos_k, pos_q):
        c2c = ops.einsum("bth,bsh->bts", q, k)
        c2p = ops.take_along_axis(ops.einsum("bth,rh->btr", q, pos_k), ops.broadcast_to(index, (2, 4, 4)), axis=-1)
        p2c = ops.transpose(
            ops.take_along_axis(ops.einsum("bsh,rh->bsr", k, pos_q), ops.broadcast_to(index, (2, 4, 4)), axis=-1),
            (0, 2, 1),
        )
        return ops.softmax((c2c + c2p + p2c) * scale)

    c2c = np.einsum("bth,bsh->bts", q, k)
    c2p = np.take_along_axis(np.einsum("bth,rh->btr", q, pos_k), np.broadcast_to(index, (2, 4, 4)), -1)
    p2c = np.take_along_axis(np.einsum("bsh,rh->bsr", k, pos_q), np.broadcast_to(index, (2, 4, 4)), -1)
    ref = softmax((c2c + c2p + p2c.transpose(0, 2, 1)) * scale)
    assert (ref.max(-1) < 0.95).mean() > 0.3  # guard: smooth rows
    args = [tf.constant(a, dtype) for a in (q, k, pos_k, pos_q)]
    keras_amp.enable(policy)
    found = _live_matmuls(deberta, *args)
    # TensorFlow lowers some einsums to BatchMatMulV2 inside the compiled call: count by dtype.
    assert [d for _, d in found] == ["float32"] * 3, found
    p = tf.function(deberta)(*args)
    ulp = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype.name]
    np.testing.assert_allclose(np64(p), ref, atol=2 * ulp, rtol=0)
    del rng


def test_float16_mask_constant_stays_finite_stock_gives_nan():
    # keras-hub T5: `(1.0 - mask) * -1e9` in the compute dtype, then added to the scores.
    q, k = (tf.constant(np.ones((1, 3, 4)), tf.float16) for _ in range(2))
    mask = tf.constant([[[1.0, 1.0, 0.0]]], tf.float16)

    def masked(q, k, mask):
        bias = (1.0 - mask) * -1e9  # TF's operator: -1e9 becomes float16 -inf, 0 * -inf is NaN
        return ops.softmax(ops.einsum("bth,bsh->bts", q, k) + bias)

    keras_amp.enable("mixed_float16")
    op_rules.uninstall()
    stock = tf.function(masked)(q, k, mask).numpy()
    # Stock: the kept positions are NaN in every row (oneDNN's softmax gives 0 at the -inf
    # position where it is on, NaN there too where it is off).
    assert np.isnan(stock[..., :2]).all(), stock
    op_rules.install("float16")
    p = tf.function(masked)(q, k, mask).numpy()
    np.testing.assert_allclose(p, np.broadcast_to([0.5, 0.5, 0.0], (1, 3, 3)), atol=0, rtol=0)


def test_float16_mask_constant_stays_below_float32_scores_past_65504():
    # Scores of 5e4-2e5 in float32: float16's -65504 as the mask value had left the future positions
    # winning the softmax (all probability masked, finite: no signal). Reference: float64.
    t, d = 4, 8
    q = np.full((1, t, d), 30.0)
    k = np.arange(1, t + 1, dtype=np.float64)[None, :, None] * np.full((1, t, d), 600.0)
    causal = np.tril(np.ones((t, t)))

    def masked(q, k):
        m = ops.cast(causal, q.dtype)
        return ops.softmax(ops.matmul(q, ops.transpose(k, (0, 2, 1))) / np.sqrt(d) + (1.0 - m) * -1e9)

    s = q @ k.transpose(0, 2, 1) / np.sqrt(d) + (1.0 - causal) * -1e9
    ref = np.exp(s - s.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    keras_amp.enable("mixed_float16")
    args = [tf.constant(v, tf.float16) for v in (q, k)]
    op_rules.uninstall()
    assert np.isnan(tf.function(masked)(*args).numpy()).all()  # stock: the scores overflow
    op_rules.install("float16")
    np.testing.assert_allclose(tf.function(masked)(*args).numpy(), ref, rtol=0, atol=1e-3)


def _rms_norm(h):
    variance = ops.mean(ops.square(h), axis=-1, keepdims=True)  # keras-hub T5LayerNorm
    return h * ops.rsqrt(variance + 1e-6)


def _standardise(h):
    mean = ops.mean(h, axis=-1, keepdims=True)
    var = ops.mean(ops.square(h - mean), axis=-1, keepdims=True)
    return (h - mean) / ops.sqrt(var + 1e-6)


def _pow_magnitude(h):
    # keras-hub Gemma3n's AltUp: `x ** 2` (a Pow op) and a floor on the mean before the root.
    return h / ops.sqrt(ops.maximum(ops.mean(h**2, axis=-1, keepdims=True), 1e-6))


@pytest.mark.parametrize("norm", [_rms_norm, _standardise, _pow_magnitude],
                         ids=["rsqrt_mean_square", "centred_sqrt_var", "sqrt_max_mean_pow"])
def test_hand_written_norm_statistics_float32_stock_overflows(norm):
    # |h| ~ 300 to 600: float16 squares pass 65504 (inf), so stock's statistic is inf.
    rng = np.random.RandomState(0)
    h = (rng.choice([-1.0, 1.0], (2, 3, 64)) * rng.choice([300.0, 450.0, 600.0], (2, 3, 64)))
    h16 = tf.constant(h, tf.float16)
    c = h - (h.mean(-1, keepdims=True) if norm is _standardise else 0.0)
    ref = c / np.sqrt((c**2).mean(-1, keepdims=True) + 1e-6)
    keras_amp.enable("mixed_float16")
    op_rules.uninstall()
    stock = tf.function(norm)(h16).numpy().astype(np.float64)
    assert np.abs(np.nan_to_num(stock, nan=9.0) - ref).max() > 0.5  # stock: zeros or NaN
    op_rules.install("float16")
    ours = tf.function(norm)(h16)
    assert ours.dtype == tf.float16  # the layer's code keeps the dtype it expects
    # The statistic in float32, rounded once to float16; times h (float16): ~2 ulps at |ref| <= 2.
    np.testing.assert_allclose(ours.numpy().astype(np.float64), ref, atol=2 * 2.0**-11 * 2, rtol=0)


def test_norm_gradient_is_float32_and_matches_float64():
    rng = np.random.RandomState(1)
    h = rng.choice([-1.0, 1.0], (2, 32)) * rng.choice([280.0, 400.0], (2, 32))
    hv = tf.Variable(tf.constant(h, tf.float16))
    w = rng.normal(size=(2, 32))
    keras_amp.enable("mixed_float16")

    @tf.function
    def grad():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(_rms_norm(hv), tf.float32) * w)
        return tape.gradient(loss, hv)

    g = grad()
    ms = (h**2).mean(-1, keepdims=True)
    # d/dh of sum(w * h / sqrt(ms)) = w / sqrt(ms) - h * sum(w * h) / (n * ms^1.5)
    ref = w / np.sqrt(ms) - h * (w * h).sum(-1, keepdims=True) / (32 * ms**1.5)
    assert np.isfinite(g.numpy()).all()
    np.testing.assert_allclose(g.numpy().astype(np.float64), ref, atol=4e-3 * np.abs(ref).max(), rtol=0)


def test_float32_chains_and_eager_tensors_are_left_alone():
    keras_amp.enable("mixed_bfloat16")
    seen = []

    @tf.function
    def f(x16, x32):
        # Keras's LayerNormalization computes in float32 from a cast input: nothing to rebuild.
        stat32 = ops.mean(ops.square(tf.cast(x16, tf.float32)), axis=-1) + 1e-6
        seen.append(dataflow.float32_statistic(stat32))
        seen.append(dataflow.float32_logits(ops.einsum("ij,kj->ik", x32, x32), xla_scores=True))  # float32 scores
        seen.append(dataflow.float32_statistic(x16 + 1.0))  # no reduction: not a statistic
        seen.append(dataflow.float32_logits(ops.einsum("ij,kj->ik", x16, x16), xla_scores=True))  # 16-bit scores
        return x16

    f(tf.ones((2, 4), tf.bfloat16), tf.ones((2, 4)))
    assert seen[:3] == [None, None, None]
    assert seen[3] is not None and seen[3].dtype == tf.float32
    eager = ops.einsum("ij,kj->ik", tf.ones((2, 4), tf.bfloat16), tf.ones((2, 4), tf.bfloat16))
    assert dataflow.float32_logits(eager, xla_scores=True) is None  # eager: no graph to read (documented)


def test_rules_run_while_tracing_not_per_step(monkeypatch):
    keras_amp.enable("mixed_float16")
    calls = []
    original = dataflow.float32_logits
    monkeypatch.setattr(dataflow, "float32_logits", lambda x, **kw: calls.append(1) or original(x, **kw))
    q = tf.constant(_near_300((2, 5, 8)), tf.float16)
    step = tf.function(lambda q: _attention("einsum", q, q, q, 1.0 / 4096)[0])
    first = step(q).numpy()
    assert len(calls) == 1  # guard: the rule ran during the trace
    for _ in range(3):
        np.testing.assert_array_equal(step(q).numpy(), first)
    assert len(calls) == 1  # the graph holds only TF ops


class ScoresBlock(keras.layers.Layer):
    """QK^T as `q @ k^T` on tensors, a scale and a softmax: nothing a name-based rule could key on."""

    def build(self, shape):
        self.q = keras.layers.Dense(8)
        self.k = keras.layers.Dense(8)

    def call(self, x):
        s = self.q(x) @ tf.transpose(self.k(x), (0, 2, 1))
        return ops.matmul(ops.softmax(s * 0.01), x)


class SubclassedScores(keras.Model):
    def __init__(self):
        super().__init__()
        self.scores = ScoresBlock()
        self.head = keras.layers.Dense(1, dtype="float32")

    def call(self, x):
        return self.head(self.scores(x))


def _scores_model(kind):
    if kind == "subclassed":
        model = SubclassedScores()
        model(np.zeros((1, 5, 8), "float32"))
        return model, model.scores
    inputs = keras.Input((5, 8))
    scores = ScoresBlock()
    return keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(scores(inputs))), scores


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_fit_and_a_custom_loop_train_through_the_rebuilt_scores(jit_compile, kind):
    keras_amp.enable("mixed_float16")
    model, scores = _scores_model(kind)
    x = np.random.RandomState(0).normal(size=(4, 5, 8)).astype("float32") * 30
    y = np.ones((4, 5, 1), "float32")
    model.compile(optimizer=keras_amp.wrap(keras.optimizers.SGD(1e-3)), loss="mse", jit_compile=jit_compile)
    history = model.fit(x, y, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert scores.q.compute_dtype == "float16"  # guard: the layer really runs in 16 bits
    q_kernel = scores.q.kernel
    before = q_kernel.numpy().copy()

    x, y = tf.constant(x), tf.constant(y)

    @tf.function(jit_compile=jit_compile)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, grads

    loss, grads = step()
    assert all(g is not None for g in grads)  # the rebuilt chain is on the tape: q and k train
    assert np.isfinite(loss.numpy()) and np.abs(grads[0].numpy()).max() > 0
    assert np.array_equal(before, q_kernel.numpy())


@pytest.mark.parametrize("policy", MIXED)
def test_dot_product_attention_scores_float32_stock_is_not(policy):
    dtype = MIXED[policy]
    q, k = _near_300((2, 5, 1, 8)), _near_300((2, 6, 1, 8), seed=1)
    v = np.random.RandomState(2).normal(size=(2, 6, 1, 4))
    scale = 1.0 / 4096
    ref_p = softmax(np.einsum("btnh,bsnh->bnts", q, k) * scale)
    ref = np.einsum("bnts,bsnh->btnh", ref_p, v)
    args = [tf.constant(a, dtype) for a in (q, k, v)]
    keras_amp.enable(policy)
    op_rules.uninstall()
    stock = ops.dot_product_attention(*args, scale=scale)
    ulp = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype.name]
    assert np.nan_to_num(np.abs(np64(stock) - ref), nan=9.0).max() > 0.05
    op_rules.install(dtype.name)
    assert op_rules.rule_installed(op_rules.DOT_PRODUCT_ATTENTION_OP)
    for fn in (ops.dot_product_attention, tf.function(ops.dot_product_attention)):
        out = fn(*args, scale=scale)
        assert out.dtype == dtype
        np.testing.assert_allclose(np64(out), ref, atol=8 * ulp * np.abs(v).max(), rtol=0)


def _graph_op_count(model, x):
    graph = tf.function(lambda x: model(x, training=True)).get_concrete_function(x).graph
    return len(graph.get_operations())


@pytest.mark.parametrize("policy", MIXED)
def test_no_new_ops_for_multi_head_attention_and_keras_norms(policy, monkeypatch):
    # MultiHeadAttention's own rule computes its scores in one compiled call, and Keras's
    # LayerNormalization computes in float32: the dataflow rules find nothing to rebuild there,
    # so the traced step is op for op the one without them (no new cost).
    keras_amp.enable(policy)
    inputs = keras.Input((6, 16))
    h = keras.layers.LayerNormalization()(inputs)
    h = keras.layers.MultiHeadAttention(2, 8)(h, h)
    model = keras.Model(inputs, keras.layers.Dense(4)(h))
    x = tf.ones((2, 6, 16))
    with_rules = _graph_op_count(model, x)
    monkeypatch.setattr(dataflow, "float32_logits", lambda x: None)
    monkeypatch.setattr(dataflow, "float32_statistic", lambda x: None)
    assert _graph_op_count(model, x) == with_rules

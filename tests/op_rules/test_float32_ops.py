"""keras_amp.op_rules.float32_ops: the single-op float32 rules (softmax, log_softmax, logsumexp, a
softmax written as exp(s - logsumexp(s)), normalisation, std, the losses, arange with dtype float16): stock 16-bit Keras fails, the rule holds;
symbolic and eager dtypes agree. (The gelu rule's float32 forward and backward is
`keras_amp.op_rules.upcast_recompute.upcast_recompute_gelu`; its overflow case is checked here with
the other rule kinds.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_amp
from keras_amp import op_rules
from tests.helpers import live_ops

pytestmark = [
    pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning"),
    pytest.mark.usefixtures("no_op_rules"),
]


def _table(n):
    # keras-hub's pattern (Flux's timestep embedding, SAM3's box coordinates): a float16 range, scaled.
    return ops.arange(0, n, dtype="float16") / n


def test_float16_arange_traces_stock_fails():
    keras_amp.enable("mixed_float16")
    op_rules.uninstall()
    with pytest.raises(ValueError, match="Range"):  # stock: no float16 Range kernel in a graph
        tf.function(_table).get_concrete_function(100)
    op_rules.install("float16")
    out = tf.function(_table)(100)
    assert out.dtype == tf.float16
    # float64 reference, rounded once to float16 (the range is exact; the division rounds in float16).
    ref = (np.arange(100, dtype=np.float64).astype(np.float16) / np.float16(100)).astype(np.float64)
    np.testing.assert_array_equal(out.numpy().astype(np.float64), ref)


def test_other_dtypes_are_left_to_keras():
    keras_amp.enable("mixed_float16")
    assert op_rules.rule_installed("arange with dtype float16")
    for dtype in ("float32", "int32", "bfloat16"):
        out = tf.function(lambda: ops.arange(1, 9, 2, dtype=dtype))()
        assert out.dtype == tf.as_dtype(dtype)
        np.testing.assert_array_equal(out.numpy().astype(np.float64), [1, 3, 5, 7])



def f16(a):
    return tf.constant(np.asarray(a, np.float64), tf.float16)


def test_softmax_kind_long_normaliser():
    x = tf.zeros([1, 70000], tf.float16)  # the normaliser, a sum of 70000 ones, exceeds 65504
    ref = -np.log(70000.0)
    stock_lsm, stock_lse = ops.log_softmax(x)[0, 0], ops.logsumexp(x)
    assert np.isneginf(stock_lsm.numpy()) and np.isposinf(stock_lse.numpy())  # stock float16 fails
    op_rules.install("float16")
    ours = ops.log_softmax(x)
    assert ours.dtype == tf.float16  # the caller's dtype: the next matmul stays in float16
    np.testing.assert_allclose(float(ours[0, 0]), ref, atol=8e-3)  # float16 ulp at 11 is 7.8e-3
    np.testing.assert_allclose(float(ops.logsumexp(x)), -ref, atol=8e-3)
    # Inside tf.function (the fit path) too.
    np.testing.assert_allclose(float(tf.function(ops.logsumexp)(x)), -ref, atol=8e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_softmax_is_correctly_rounded_and_keeps_its_logits(dtype):
    logits = np.random.RandomState(0).normal(0, 4, (4, 1000))
    x = tf.cast(tf.constant(logits), dtype)
    op_rules.install(dtype)
    p = ops.softmax(x)
    ref = tf.nn.softmax(tf.cast(x, tf.float64)).numpy()
    assert p.dtype == x.dtype and p._keras_logits is x  # Keras's contract for the cross-entropies
    eps = 2.0**-11 if dtype == "float16" else 2.0**-8  # half an ulp, relative (normal range)
    normal = ref > 1e-4
    np.testing.assert_allclose(tf.cast(p, tf.float64).numpy()[normal], ref[normal], rtol=eps, atol=0)


def test_normalization_kind_large_mean():
    rng = np.random.RandomState(0)
    x = 1000.0 + np.round(rng.normal(0, 1.4, (64, 4)) * 2) / 2  # exact in float16 (ulp 0.5)
    # The statistics as the op receives them: rounded to float16 (ulp 0.5 at 1000).
    mean, var = x.mean(0).astype(np.float16).astype(np.float64), x.var(0).astype(np.float16).astype(np.float64)
    ref = (x - mean) / np.sqrt(var + 1e-3)
    stock = ops.batch_normalization(f16(x), f16(mean), f16(var), axis=-1).numpy().astype(np.float64)
    assert np.abs(stock - ref).max() > 0.1  # x*inv - mean*inv cancels in float16
    op_rules.install("float16")
    ours = ops.batch_normalization(f16(x), f16(mean), f16(var), axis=-1)
    assert ours.dtype == tf.float16
    np.testing.assert_allclose(ours.numpy().astype(np.float64), ref, atol=4e-3)  # float16 ulp at 2: 2e-3
    # float32 statistics with 16-bit x (stock raises on the mixed dtypes) give the same.
    mixed = ops.batch_normalization(f16(x), tf.constant(mean, tf.float32), tf.constant(var, tf.float32), axis=-1)
    np.testing.assert_allclose(mixed.numpy().astype(np.float64), ref, atol=4e-3)


def test_normalization_kind_normalize_sum_of_squares():
    x = 300.0 + np.arange(64, dtype=np.float64).reshape(1, 64)  # sum of squares ~ 7e6 > 65504
    ref = x / np.linalg.norm(x)
    assert np.all(ops.normalize(f16(x)).numpy() == 0)  # stock float16: rsqrt(inf) = 0
    op_rules.install("float16")
    ours = ops.normalize(f16(x))
    assert ours.dtype == tf.float16
    np.testing.assert_allclose(ours.numpy().astype(np.float64), ref, rtol=1e-3)


def test_reduction_kind_std():
    x = 1000.0 + np.round(np.random.RandomState(1).normal(0, 1, 512) * 2) / 2  # exact in float16
    assert np.isinf(ops.std(f16(x)).numpy())  # stock float16: squared values overflow
    op_rules.install("float16")
    np.testing.assert_allclose(float(ops.std(f16(x))), x.std(), rtol=1e-3)  # float16 ulp at 1: 1e-3


def test_reduction_kind_norm():
    x = 300.0 + np.arange(64, dtype=np.float64).reshape(1, 64)  # sum of squares ~ 7e6 > 65504
    ref = np.linalg.norm(x, axis=-1)
    assert np.isinf(ops.norm(f16(x), axis=-1).numpy()).all()  # stock float16: the sum of squares overflows
    op_rules.install("float16")
    ours = ops.norm(f16(x), axis=-1)
    assert ours.dtype == tf.float16
    np.testing.assert_allclose(ours.numpy().astype(np.float64), ref, rtol=2.0**-11)  # one float16 rounding


def test_loss_kind_float32_results():
    # float16: a per-element loss below 6e-8 flushes to 0; bfloat16 rounds it to 8 bits.
    ref = np.log1p(np.exp(-20.0))
    assert ops.binary_crossentropy(f16([1.0]), f16([20.0]), from_logits=True).numpy()[0] == 0
    logits = np.random.RandomState(2).normal(0, 1, (4, 1000))
    labels = np.array([1, 7, 300, 999])
    bf16 = tf.constant(logits, tf.bfloat16)
    logits64 = tf.cast(bf16, tf.float64).numpy()
    lse = np.log(np.exp(logits64).sum(-1))
    sparse_ref = lse - logits64[np.arange(4), labels]
    stock = ops.sparse_categorical_crossentropy(labels, bf16, from_logits=True)
    assert np.abs(tf.cast(stock, tf.float64).numpy() - sparse_ref).max() > 1e-3
    op_rules.install("float16")
    ours = ops.binary_crossentropy(f16([1.0]), f16([20.0]), from_logits=True)
    assert ours.dtype == tf.float32
    np.testing.assert_allclose(ours.numpy()[0], ref, rtol=1e-4)
    ours = ops.sparse_categorical_crossentropy(labels, bf16, from_logits=True)
    assert ours.dtype == tf.float32
    np.testing.assert_allclose(ours.numpy(), sparse_ref, rtol=1e-5)
    # From a softmax output: the logits it carries are used, in float32 (no log(0) clipping).
    probs = ops.softmax(f16([[0.0, 30.0]]))
    ours = ops.categorical_crossentropy(tf.constant([[1.0, 0.0]]), probs)
    np.testing.assert_allclose(ours.numpy(), [30.0], rtol=1e-6)  # -log softmax(...)[0] = 30


def test_exp_kind_gelu_gradient():
    x = tf.Variable(f16([300.0, -2.0, 0.5]))

    def grad():
        with tf.GradientTape() as tape:
            y = ops.gelu(x, approximate=True)
        return tape.gradient(y, x).numpy()

    assert np.isnan(grad()[0])  # stock float16: 3x**2 overflows, inf * 0 = NaN
    op_rules.install("float16")
    g = grad()
    xs = np.array([300.0, -2.0, 0.5])
    inner = np.sqrt(2 / np.pi) * (xs + 0.044715 * xs**3)
    ref = 0.5 * (1 + np.tanh(inner)) + 0.5 * xs * (1 - np.tanh(inner) ** 2) * np.sqrt(2 / np.pi) * (
        1 + 3 * 0.044715 * xs**2
    )
    np.testing.assert_allclose(g.astype(np.float64), ref, atol=2e-3)


def test_symbolic_and_eager_dtypes_match_for_every_rule():
    keras_amp.enable("mixed_float16")
    inp = keras.Input((4, 8), dtype="float16")
    target = keras.Input((4, 8), dtype="float16")
    sparse = keras.Input((4,), dtype="int32")
    outs = [
        ops.softmax(inp), ops.log_softmax(inp), ops.logsumexp(inp, axis=-1), ops.std(inp, axis=-1),
        ops.gelu(inp), ops.categorical_crossentropy(target, inp, from_logits=True),
        ops.binary_crossentropy(target, inp, from_logits=True),
        ops.sparse_categorical_crossentropy(sparse, inp, from_logits=True),
        ops.batch_normalization(inp, ops.zeros((8,), "float16"), ops.ones((8,), "float16"), axis=-1),
    ]
    model = keras.Model([inp, target, sparse], outs)
    rng = np.random.RandomState(0)
    eager = model([rng.rand(2, 4, 8).astype("float16"), rng.rand(2, 4, 8).astype("float16"), rng.randint(0, 8, (2, 4))])
    symbolic = [t.dtype for t in model.outputs]
    # Stock Keras 3.15.1's Logsumexp spec has no dtype (floatx) while it runs in the input dtype;
    # the rule keeps stock's eager dtype, so that one pre-existing difference remains.
    assert symbolic[2] == "float32" and eager[2].dtype == tf.float16
    del symbolic[2], eager[2]
    assert symbolic == [t.dtype.name for t in eager]
    assert symbolic == ["float16"] * 4 + ["float32"] * 3 + ["float16"]  # losses float32, the rest the input's


MIXED = {"mixed_float16": tf.float16, "mixed_bfloat16": tf.bfloat16}
SCALE = 1.0 / 4096  # q.k ~7.2e5 (past float16's 65504), logits ~176 with differences ~1: smooth rows


def _near_300(shape, seed):
    # 300 + small even integers: exact in float16 and bfloat16.
    return 300.0 + np.random.RandomState(seed).choice([-2, 0, 2], shape).astype(np.float64)


def _over_two_axes(q, k):
    # `keras.layers.Softmax` over two axes computes exp(s - logsumexp(s, axes, keepdims=True)).
    return keras.layers.Softmax(axis=(-2, -1))(ops.einsum("bth,bsh->bts", q, k) * SCALE)


def _softmax_over_two_axes(z):
    e = np.exp(z - z.max(axis=(-2, -1), keepdims=True))
    return e / e.sum(axis=(-2, -1), keepdims=True)


@pytest.mark.parametrize("policy", MIXED)
def test_softmax_written_as_exp_minus_logsumexp_is_float32_stock_is_not(policy):
    dtype = MIXED[policy]
    q, k = _near_300((2, 3, 8), 0), _near_300((2, 4, 8), 1)
    ref = _softmax_over_two_axes(np.einsum("bth,bsh->bts", q, k) * SCALE)
    assert (ref.max((-2, -1)) < 0.5).all()  # guard: smooth, where rounding shows
    args = [tf.constant(a, dtype) for a in (q, k)]
    keras_amp.enable(policy)
    op_rules.uninstall()
    stock = tf.function(_over_two_axes)(*args)
    # float16: QK^T is inf, inf - inf NaN; bfloat16: logits ~176 round to multiples of 1.
    assert np.nan_to_num(np.abs(stock.numpy().astype(np.float64) - ref), nan=1.0).max() > 0.2 * ref.max()
    op_rules.install(dtype.name)
    assert op_rules.rule_installed(op_rules.table.SOFTMAX_EXP_OP)
    step = tf.function(_over_two_axes)
    ours = step(*args)
    assert ours.dtype == dtype
    ulp = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype.name]
    np.testing.assert_allclose(ours.numpy().astype(np.float64), ref, atol=ulp * ref.max(), rtol=0)  # one rounding
    live = [op for op in live_ops(step.get_concrete_function(*args).graph) if op.type == "Exp"]
    assert live and all(op.outputs[0].dtype == tf.float32 for op in live)  # the 16-bit exp is pruned


def test_softmax_written_out_gradient_matches_float64():
    q, k = _near_300((2, 3, 8), 0), _near_300((2, 4, 8), 1)
    w = np.random.RandomState(2).normal(size=(2, 3, 4))
    keras_amp.enable("mixed_float16")

    @tf.function
    def grad(q16, k16):  # activations, not variables: a matmul by a variable is a layer's, no score
        with tf.GradientTape() as tape:
            tape.watch(q16)
            loss = tf.reduce_sum(tf.cast(_over_two_axes(q16, k16), tf.float32) * w)
        return tape.gradient(loss, q16)

    g = grad(tf.constant(q, tf.float16), tf.constant(k, tf.float16)).numpy().astype(np.float64)
    p = _softmax_over_two_axes(np.einsum("bth,bsh->bts", q, k) * SCALE)
    dz = p * (w - (w * p).sum(axis=(-2, -1), keepdims=True))  # through the softmax over both axes
    ref = SCALE * np.einsum("bts,bsh->bth", dz, k)
    assert np.abs(ref).max() > 1e-3  # guard: a gradient to compare
    np.testing.assert_allclose(g, ref, atol=4e-3 * np.abs(ref).max(), rtol=0)


def test_other_exps_and_eager_ones_are_the_original():
    x = f16([[1.0, 2.0, 11.5], [0.5, -3.0, 4.0]])
    other = f16([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    forms = {
        "plain": lambda x: ops.exp(x),  # exp(11.5) overflows float16: a range hazard, left alone
        "another tensor's logsumexp": lambda x: ops.exp(x - ops.logsumexp(other, axis=-1, keepdims=True)),
        "without keepdims": lambda x: ops.exp(x - ops.expand_dims(ops.logsumexp(x, axis=-1), -1)),
    }
    stock = {name: tf.function(f)(x).numpy() for name, f in forms.items()}
    assert np.isposinf(stock["plain"][0, 2])
    op_rules.install("float16")
    for name, f in forms.items():
        ours = tf.function(f)(x)
        assert ours.dtype == tf.float16
        np.testing.assert_array_equal(ours.numpy(), stock[name], err_msg=name)
    eager = ops.exp(x - ops.logsumexp(x, axis=-1, keepdims=True))  # no graph to read: the original exp
    np.testing.assert_array_equal(eager.numpy(), np.exp(x.numpy() - ops.logsumexp(x, axis=-1, keepdims=True).numpy()))

"""keras_amp.op_rules.bias_add: bfloat16 bias gradients summed with float32 accumulation."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import hardware
from keras_amp.diagnostics import audit
from keras_amp.custom_gradient import custom_gradient
from keras_amp.op_rules import bias_add
from tests.helpers import as_matmul_result, matmul_roundoff

pytestmark = pytest.mark.usefixtures("no_op_rules")

NATIVE_BF16 = hardware.detect().cpu_fast_bfloat16


def _reference(dy: tf.Tensor, channel_axis: int) -> np.ndarray:
    """float64 sum of the bfloat16 values over every axis but the channel's."""
    d = np.asarray(tf.cast(dy, tf.float64))
    return d.sum(axis=tuple(a for a in range(d.ndim) if a != channel_axis % d.ndim))


def _bound(dy: tf.Tensor, channel_axis: int) -> np.ndarray:
    """One bfloat16 rounding of the result plus float32 accumulation over the rows."""
    d = np.abs(np.asarray(tf.cast(dy, tf.float64)))
    axes = tuple(a for a in range(d.ndim) if a != channel_axis % d.ndim)
    rows = d.size // d.shape[channel_axis]
    return 2.0**-8 * np.abs(_reference(dy, channel_axis)) + rows * 2.0**-24 * d.sum(axis=axes)


def test_tensorflows_bfloat16_bias_gradient_stops_at_256_and_its_sum_does_not():
    # What the rule fixes, and what its "sum" kernel rests on.
    ones = tf.ones([16384, 4], tf.bfloat16)
    np.testing.assert_array_equal(tf.raw_ops.BiasAddGrad(out_backprop=ones).numpy(), [256] * 4)
    np.testing.assert_array_equal(tf.reduce_sum(tf.ones([65536, 4], tf.bfloat16), 0).numpy(), [65536] * 4)
    np.testing.assert_array_equal(bias_add.bias_gradient(ones, -1).numpy(), [16384] * 4)


@pytest.mark.parametrize("method", bias_add.METHODS)
@pytest.mark.parametrize("shape,axis", [((65536, 8), -1), ((32, 16, 16, 24), -1), ((4096, 2048), -1),
                                        ((64, 12, 100), 1)], ids=["rows", "nhwc", "wide", "channels_first"])
def test_bias_gradient_matches_float64(method, shape, axis):
    if method == "matmul" and not NATIVE_BF16:
        pytest.skip("the matmul kernel is chosen only where oneDNN runs bfloat16 natively")
    rng = np.random.default_rng(0)
    # A mean far from zero: a bfloat16 running sum stalls early on such values.
    dy = tf.cast(rng.standard_normal(shape) + 3.0, tf.bfloat16)
    got = np.asarray(tf.cast(bias_add.bias_gradient(dy, axis, method), tf.float64))
    ref = _reference(dy, axis)
    assert np.all(np.abs(got - ref) <= _bound(dy, axis)), np.max(np.abs(got - ref) / _bound(dy, axis))
    stock = np.asarray(tf.cast(tf.raw_ops.BiasAddGrad(
        out_backprop=dy, data_format="NHWC" if axis == -1 else "NCHW"), tf.float64))
    assert np.any(np.abs(stock - ref) > _bound(dy, axis))  # guard: stock's kernel fails the same bound


def test_method_follows_the_device():
    cpu = dict(cpu_model="x", onednn_enabled=True)
    assert bias_add.method_for(hardware.DeviceInfo(cpu_flags={"avx512_bf16"}, **cpu)) == "matmul"
    assert bias_add.method_for(hardware.DeviceInfo(cpu_flags={"amx_bf16"}, **cpu)) == "matmul"
    assert bias_add.method_for(hardware.DeviceInfo(cpu_flags={"avx2"}, **cpu)) == "sum"
    assert bias_add.method_for(hardware.DeviceInfo(cpu_flags={"avx512_bf16"}, onednn_enabled=False)) == "sum"
    gpu = hardware.GpuInfo(name="A100", compute_capability=(8, 0))
    assert bias_add.method_for(hardware.DeviceInfo(gpus=(gpu,), cpu_flags={"avx512_bf16"}, **cpu)) == "float32"
    assert bias_add.gradient_method() == bias_add.method_for(hardware.detect())


def test_unknown_method_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`method`.*method='fast'.*Allowed: matmul, sum, float32"):
        bias_add.bias_gradient(tf.ones([4, 2], tf.bfloat16), -1, "fast")


def _layer_gradients(layer, x, upstream, graph, kernel=False):
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
        return [y] + tape.gradient(loss, [x, layer.bias] + ([layer.kernel] if kernel else []))

    f = tf.function(f) if graph else f
    return [np.asarray(tf.cast(t, tf.float64)) for t in f(x)]


def _stock_and_ours(make, shape, graph, seed, *, shift=0.0, bias=False, kernel=False):
    """A layer built under mixed_bfloat16, its input, an upstream gradient (mean `shift`), and the
    output and gradients (`_layer_gradients`) under stock Keras, then under keras_amp; with `bias`, the
    bias set to values that matter (Keras starts it at zero)."""
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.standard_normal(shape), tf.float32)
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    layer = make()
    layer.build(shape)
    if bias:
        layer.bias.assign(4.0 * rng.standard_normal(layer.bias.shape))
    upstream = tf.constant(rng.standard_normal(layer.compute_output_shape(shape)) + shift, tf.float32)
    stock = _layer_gradients(layer, x, upstream, graph, kernel)
    keras_amp.enable("mixed_bfloat16")
    return layer, x, upstream, stock, _layer_gradients(layer, x, upstream, graph, kernel)


LAYERS = {
    "dense": (lambda: keras.layers.Dense(8), (32, 40, 16)),
    "conv2d": (lambda: keras.layers.Conv2D(8, 3, padding="same"), (32, 24, 24, 4)),
    "einsum_dense": (lambda: keras.layers.EinsumDense("btc,cd->btd", output_shape=(40, 8), bias_axes="d"),
                     (32, 40, 16)),
}


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("name", LAYERS)
def test_layer_bias_gradient_matches_float64_where_stock_is_far_off(name, graph, monkeypatch):
    # The bias rule alone: a convolution's own gradients stay TensorFlow's (the conv-gradient rule's tests).
    monkeypatch.setattr(hardware, "emulated", lambda dtype: False)
    make, shape = LAYERS[name]
    _, _, upstream, stock, ours = _stock_and_ours(make, shape, graph, 1, shift=2.0)
    for a, b in zip(stock[:2], ours[:2]):  # the output and the input's gradient: stock's, bit for bit
        np.testing.assert_array_equal(a, b)
    dy = tf.cast(upstream, tf.bfloat16)  # the gradient reaching the bias add
    ref = _reference(dy, -1)
    assert np.all(np.abs(ours[2] - ref) <= _bound(dy, -1)), np.max(np.abs(ours[2] - ref) / _bound(dy, -1))
    assert np.max(np.abs(stock[2] - ref) / np.abs(ref)) > 0.5  # guard: stock is far off


# Projections whose bias add TF's kernels kept from their matmul: (layer, input shape, its einsum).
PROJECTIONS = {
    "dense_on_a_sequence": (lambda: keras.layers.Dense(256), (16, 64, 128), "abc,cd->abd"),
    "einsum_dense_splitting_heads": (lambda: keras.layers.EinsumDense(
        "abc,cde->abde", output_shape=(64, 4, 64), bias_axes="de"), (16, 64, 128), "abc,cde->abde"),
    "einsum_dense_merging_heads": (lambda: keras.layers.EinsumDense(
        "abcd,cde->abe", output_shape=(64, 256), bias_axes="e"), (16, 64, 4, 32), "abcd,cde->abe"),
}


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("name", PROJECTIONS)
def test_projection_adds_the_bias_beside_a_2d_matmul_one_rounding_where_fused(name, graph):
    make, shape, equation = PROJECTIONS[name]
    layer, x, upstream, stock, ours = _stock_and_ours(make, shape, graph, 3, bias=True, kernel=True)
    # float64 references from the bfloat16 operands; the unfused path's bounds: a matmul's float32
    # accumulation, then two roundings (the matmul kernel's result: unit roundoff 2^-8, or a whole ulp
    # where the kernel truncates; the sum with the bias: 2^-8).
    eps = matmul_roundoff("bfloat16")
    as64 = lambda t: np.asarray(tf.cast(tf.cast(t, tf.bfloat16), tf.float64))  # noqa: E731
    lhs, out = equation.split("->")
    lhs, kernel = lhs.split(",")
    terms = np.prod([shape[lhs.index(c)] for c in set(lhs) & set(kernel)])
    xw = np.einsum(equation, as64(x), as64(layer.kernel))
    ref = xw + as64(layer.bias)
    bound = eps * 1.01 * np.abs(xw) + 2.0**-8 * np.abs(ref) + terms * 2.0**-24 * np.einsum(
        equation, np.abs(as64(x)), np.abs(as64(layer.kernel)))
    assert np.all(np.abs(ours[0] - ref) <= bound), np.max(np.abs(ours[0] - ref) / bound)
    if not graph:  # eager: no graph to rebuild the matmul in; the kernel's gradient is stock's
        np.testing.assert_array_equal(ours[3], stock[3])
        return
    # The kernel's gradient: one matmul over every row, float32 accumulation, the kernel's one rounding.
    dy = as64(upstream)
    kernel_ref = np.einsum(f"{lhs},{out}->{kernel}", as64(x), dy)
    rows = np.prod(shape) // terms
    kernel_bound = eps * np.abs(kernel_ref) + rows * 2.0**-24 * np.einsum(
        f"{lhs},{out}->{kernel}", np.abs(as64(x)), np.abs(dy))
    assert np.all(np.abs(ours[3] - kernel_ref) <= kernel_bound), np.max(np.abs(ours[3] - kernel_ref) / kernel_bound)
    once = as_matmul_result(kernel_ref, "bfloat16")
    assert np.mean(ours[3] == once) > 0.99, np.mean(ours[3] == once)
    if name.startswith("einsum"):  # stock: a batched matmul by the broadcast kernel, summed from rounded parts
        assert np.any(np.abs(stock[3] - kernel_ref) > kernel_bound)
    graph_def = tf.function(lambda x: layer(x)).get_concrete_function(x).graph
    feeds = [op.inputs[0].op.type for op in graph_def.get_operations() if op.type == "BiasAdd"]
    assert feeds == ["MatMul"], feeds  # beside a 2-D matmul, which oneDNN fuses it into
    if NATIVE_BF16:  # oneDNN's fused bfloat16 kernel: the bias added in float32, one rounding
        rounded = as64(ref)
        assert np.mean(ours[0] == rounded) > 0.999, np.mean(ours[0] == rounded)
        assert np.mean(stock[0] == rounded) < 0.95  # stock: two roundings (a reshape or a 2-D bias between)


def test_channels_first_add_and_xla():
    rng = np.random.default_rng(2)
    x = tf.cast(rng.standard_normal((64, 12, 100)), tf.bfloat16)  # a bias along axis 1 (Keras: NCHW)
    bias = tf.cast(rng.standard_normal(12), tf.bfloat16)
    upstream = tf.cast(rng.standard_normal((64, 12, 100)) + 2.0, tf.bfloat16)

    def f(x, bias):
        with tf.GradientTape() as tape:
            tape.watch(bias)
            y = keras.ops.add(x, bias)
        return y, tape.gradient(y, bias, output_gradients=upstream)

    stock_y, _ = tf.function(f)(x, bias)
    keras_amp.enable("mixed_bfloat16")
    for jit in (False, True):
        y, grad = tf.function(f, jit_compile=jit)(x, bias)
        np.testing.assert_array_equal(y.numpy(), stock_y.numpy())
        got = np.asarray(tf.cast(grad, tf.float64))
        assert np.all(np.abs(got - _reference(upstream, 1)) <= _bound(upstream, 1)), jit


def test_fit_trains_the_bias_on_its_whole_gradient():
    # mean(y) over 16384 x 4 outputs: each bias's gradient is 1/4 exactly; stock's stops at 256 rows.
    x = np.zeros((16384, 3), np.float32)

    def bias_after_one_step():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, kernel_initializer="zeros")])
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=lambda y, p: keras.ops.mean(p))
        model.fit(x, x[:, :1], batch_size=16384, epochs=1, verbose=0)
        return model.layers[-1].bias.numpy()

    keras.config.set_dtype_policy("mixed_bfloat16")
    stock = bias_after_one_step()
    keras_amp.enable("mixed_bfloat16")
    ours = bias_after_one_step()
    np.testing.assert_allclose(ours, [-0.25] * 4, rtol=2.0**-8)
    np.testing.assert_allclose(stock, [-0.25 * 256 / 16384] * 4, rtol=2.0**-8)  # stock: 1/64 of it


def test_other_adds_are_the_original():
    keras_amp.enable("mixed_bfloat16")

    @tf.function
    def ops_of(x, b):
        with tf.GradientTape() as tape:
            tape.watch(b)
            y = keras.ops.add(x, b)
        tape.gradient(y, b)
        return y

    def types(x, b):
        return {op.type for op in ops_of.get_concrete_function(x, b).graph.get_operations()}

    for dtype in ("float16", "float32"):  # their kernel accumulates in float32
        assert "BiasAddGrad" in types(tf.ones([8, 4], dtype), tf.ones([4], dtype)), dtype
    bf16 = types(tf.ones([8, 4], tf.bfloat16), tf.ones([4], tf.bfloat16))
    assert "BiasAdd" in bf16 and "BiasAddGrad" not in bf16
    # Not a bias: a broadcast add keeps TF's AddV2 and its Sum gradient.
    other = types(tf.ones([8, 4, 4], tf.bfloat16), tf.ones([4, 4], tf.bfloat16))
    assert "AddV2" in other and "BiasAdd" not in other


def test_sparse_and_unknown_rank_adds_are_kerass():
    keras_amp.enable("mixed_bfloat16")
    sparse = tf.SparseTensor([[0, 1], [2, 3]], tf.constant([1.0, 2.0], tf.bfloat16), [3, 4])
    dense = keras.ops.add(sparse, tf.ones([3, 4], tf.bfloat16))
    np.testing.assert_array_equal(tf.convert_to_tensor(dense).numpy()[[0, 2], [1, 3]], [2.0, 3.0])

    @tf.function(input_signature=[tf.TensorSpec(None, tf.bfloat16), tf.TensorSpec([4], tf.bfloat16)])
    def unknown_rank(x, b):
        return keras.ops.add(x, b)

    with pytest.raises(ValueError, match="unknown rank"):  # Keras's own error, as without the rule
        unknown_rank(tf.ones([2, 4], tf.bfloat16), tf.ones([4], tf.bfloat16))


def _key_bias_attention(q, k, key_bias, scale, custom=None):
    """softmax(q k^T * scale + key_bias * scale): a learned bias per key, added with Keras's `add` (the bias
    rule's bias add, on the scores' path); `custom` wraps the scores in a user's tf.custom_gradient first."""
    s = keras.ops.multiply(keras.ops.einsum("bth,bsh->bts", q, k), scale)
    if custom is not None:
        s = custom(s)
    return keras.ops.softmax(keras.ops.add(s, keras.ops.multiply(key_bias, scale)), axis=-1)


def test_scores_are_found_through_the_bias_add_stock_rounds_them():
    """The bias rule's custom gradient is transparent to the scores walk: QK^T + a key bias is a float32
    chain (rebuilt with float32 gradients); 16-bit logits ~176 with differences ~1 are stock's error."""
    from tests.helpers import np64, softmax  # noqa: PLC0415

    rng = np.random.RandomState(0)
    q, k = 300.0 + rng.choice([-2, 0, 2], (2, 5, 8)), 300.0 + rng.choice([-2, 0, 2], (2, 6, 8))
    key_bias = np.array([0.0, 2.0, -2.0, 4.0, 0.0, 2.0])
    scale = 1.0 / 4096
    ref = softmax((np.einsum("bth,bsh->bts", q, k) + key_bias) * scale)
    args = [tf.constant(a, tf.bfloat16) for a in (q, k, key_bias)]

    def step(q, k, key_bias):
        with tf.GradientTape() as tape:
            tape.watch([q, key_bias])
            p = _key_bias_attention(q, k, key_bias, scale)
            loss = tf.reduce_sum(tf.cast(p, tf.float32) * tf.range(6, dtype=tf.float32))
        return p, *tape.gradient(loss, [q, key_bias])

    stock_p, *_ = tf.function(step)(*args)
    keras_amp.enable("mixed_bfloat16")
    graph = tf.function(step).get_concrete_function(*args).graph
    assert "BiasAdd" in {op.type for op in graph.get_operations()}  # guard: the bias rule made the add
    # The audit's own walk passes the bias add too: it finds QK^T, in float32.
    found = [audit.scores_matmul(op) for op in graph.get_operations() if op.type == "Softmax"]
    assert found and all(f is not None and audit.op_dtype(f[1]) == "float32" for f in found), found
    p, grad_q, grad_bias = tf.function(step)(*args)
    assert np.abs(np64(stock_p) - ref).max() > 0.05  # stock: 8-bit logits lose their differences
    np.testing.assert_allclose(np64(p), ref, atol=2 * 2.0**-8, rtol=0)  # ours: one rounding of p
    # The gradients of the rebuilt chain against float64 (the upstream sum(p * [0..5]) through softmax).
    g = ref * (np.arange(6) - (ref * np.arange(6)).sum(-1, keepdims=True))
    ref_bias = g.sum((0, 1)) * scale
    np.testing.assert_allclose(np64(grad_bias), ref_bias, atol=2.0**-8 * np.abs(ref_bias).max() + 1e-9, rtol=0)
    ref_q = np.einsum("bts,bsh->bth", g, k) * scale
    # The QK^T gradient matmuls take the logits' gradient in 16 bits (by design): a rounding of each g * k
    # term, and the terms cancel (g sums to 0 over the keys).
    bound = 2.0**-7 * np.einsum("bts,bsh->bth", np.abs(g), np.abs(k)) * scale
    assert np.all(np.abs(np64(grad_q) - ref_q) <= bound), np.max(np.abs(np64(grad_q) - ref_q) / bound)


def test_a_custom_gradient_not_declared_transparent_stops_the_walk():
    """Only custom gradients declared transparent are looked through: any other (here keras_amp's own
    `custom_gradient` without the declaration) is kept, so the scores under it are left as written and
    its gradient runs."""
    calls = []

    @custom_gradient
    def clipped(s):
        def grad(dy):
            calls.append(1)
            return tf.clip_by_value(dy, -1.0, 1.0)

        return tf.identity(s), grad

    args = [tf.constant(np.full(shape, 3.0), tf.bfloat16) for shape in ((2, 5, 8), (2, 6, 8), (6,))]

    def step(q, k, key_bias):
        with tf.GradientTape() as tape:
            tape.watch(q)
            p = _key_bias_attention(q, k, key_bias, 0.125, custom=clipped)
            loss = tf.reduce_sum(tf.cast(p, tf.float32) * tf.range(6, dtype=tf.float32))
        return tape.gradient(loss, q)

    keras_amp.enable("mixed_bfloat16")
    graph = tf.function(step).get_concrete_function(*args).graph
    assert calls  # its gradient was built into the step
    einsums = [op for op in graph.get_operations() if op.type == "Einsum"]
    assert einsums and all(op.outputs[0].dtype == tf.bfloat16 for op in einsums)  # left as written
    assert not any(op.type in ("PartitionedCall", "StatefulPartitionedCall") for op in graph.get_operations())

"""The convolution-gradient rule: 16-bit convolutions differentiated with float32 kernels, rounded once,
where the CPU has no 16-bit convolution kernels (Eigen's); Keras's convolution everywhere else."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import hardware, op_rules
from keras_amp.numerics import islands
from keras_amp.op_rules import conv_gradient
from tests.helpers import UNIT_ROUNDOFF, ZEN4, gpus, np64

# (layer, input shape): strides, dilation, 1-D and 3-D, grouped (Keras's XLA path). Not channels first:
# TensorFlow's CPU kernels do not train it in any dtype.
LAYERS = {
    "conv2d_strided": (lambda p: keras.layers.Conv2D(16, 3, strides=2, padding="same", dtype=p), (8, 17, 17, 12)),
    "conv2d_dilated": (lambda p: keras.layers.Conv2D(8, 3, dilation_rate=2, dtype=p), (4, 16, 16, 16)),
    "conv1d": (lambda p: keras.layers.Conv1D(16, 5, strides=2, padding="same", dtype=p), (8, 40, 24)),
    "conv3d": (lambda p: keras.layers.Conv3D(8, 3, dtype=p), (2, 8, 8, 8, 8)),
    "conv2d_grouped": (lambda p: keras.layers.Conv2D(16, 3, groups=4, dtype=p), (4, 12, 12, 16)),
}


@pytest.fixture
def rule_on(monkeypatch):
    """The rule installed and taken, as on a CPU without 16-bit convolution kernels (any machine)."""
    monkeypatch.setattr(hardware, "emulated", lambda dtype: True)


def _gradients(layer, x, upstream, jit_compile=False):
    @tf.function(jit_compile=jit_compile)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return (y, *tape.gradient(y, [x, layer.kernel], output_gradients=tf.cast(upstream, y.dtype)))

    return [np64(t) for t in step(x)], step.get_concrete_function(x).graph


def _reference(layer, x, upstream, dtype):
    """float64 gradients of the float64 convolution of the 16-bit operands (Keras's conv in float64)."""
    x64, k64 = tf.constant(np64(x)), tf.constant(np64(tf.cast(layer.kernel, dtype)))
    with tf.GradientTape() as tape:
        tape.watch([x64, k64])
        y = layer.convolution_op(x64, k64)
    dy = tf.constant(np64(tf.cast(upstream, dtype)))  # the upstream gradient enters in 16 bits
    dx, dk = tape.gradient(y, [x64, k64], output_gradients=dy)
    sums = tape_abs(layer, x64, k64, dy)
    return np.asarray(dx), np.asarray(dk), sums


def tape_abs(layer, x64, k64, dy):
    """The same gradients of |x|, |k|, |dy|: what bounds the float32 accumulation error."""
    ax, ak = tf.abs(x64), tf.abs(k64)
    with tf.GradientTape() as tape:
        tape.watch([ax, ak])
        y = layer.convolution_op(ax, ak)
    return [np.asarray(g) for g in tape.gradient(y, [ax, ak], output_gradients=tf.abs(dy))]


def _stock_then_ours(make, shape, dtype, gradients, *, seed, scale):
    """The layer under mixed_`dtype` with random weights, a batch and an upstream gradient; `gradients` of it
    with the rules installed, once the forward pass is checked to be stock's, bit for bit."""
    rng = np.random.default_rng(seed)
    keras.utils.set_random_seed(seed)
    layer = make(f"mixed_{dtype}")
    layer.build(shape)
    for w in layer.trainable_weights:
        w.assign(rng.standard_normal(w.shape) * scale)
    x = tf.cast(rng.standard_normal(shape), dtype)
    upstream = tf.constant(rng.standard_normal(layer.compute_output_shape(shape)), tf.float32)
    stock, _ = gradients(layer, x, upstream)
    op_rules.install(dtype)
    ours, graph = gradients(layer, x, upstream)
    np.testing.assert_array_equal(ours[0], stock[0])  # the forward convolution is Keras's
    return layer, x, upstream, ours, graph


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", LAYERS)
def test_gradients_are_float32_sums_rounded_once_forward_is_kerass(name, dtype, rule_on):
    make, shape = LAYERS[name]
    layer, x, upstream, ours, graph = _stock_then_ours(make, shape, dtype, _gradients, seed=0, scale=0.2)
    backprops = {op.type: op.outputs[0].dtype.name for op in graph.get_operations() if "Backprop" in op.type}
    if name != "conv2d_grouped":  # (grouped: Keras's XLA computation, its ops inside)
        assert backprops and set(backprops.values()) == {"float32"}, backprops
    dx_ref, dk_ref, (dx_abs, dk_abs) = _reference(layer, x, upstream, dtype)
    u = UNIT_ROUNDOFF[dtype]
    for got, ref, size in ((ours[1], dx_ref, dx_abs), (ours[2], dk_ref, dk_abs)):
        terms = 2.0**-24 * np.prod(layer.kernel.shape) * size  # float32 accumulation, a generous count
        assert np.all(np.abs(got - ref) <= u * np.abs(ref) + terms), np.max(np.abs(got - ref) - u * np.abs(ref))
        once = np64(tf.cast(tf.constant(ref), dtype))
        assert np.mean(got == once) > 0.99, np.mean(got == once)


# Layers whose convolution is another backend function (depthwise_conv, separable_conv, conv_transpose); no
# bias, so every trainable weight is a convolution operand.
OTHER_LAYERS = {
    "depthwise2d": (lambda p: keras.layers.DepthwiseConv2D(3, 2, "same", depth_multiplier=2, use_bias=False, dtype=p),
                    (4, 13, 13, 8)),
    "depthwise1d": (lambda p: keras.layers.DepthwiseConv1D(5, dilation_rate=2, use_bias=False, dtype=p), (4, 30, 8)),
    "separable2d": (lambda p: keras.layers.SeparableConv2D(16, 3, padding="same", use_bias=False, dtype=p),
                    (4, 12, 12, 8)),
    "separable1d": (lambda p: keras.layers.SeparableConv1D(8, 3, strides=2, use_bias=False, dtype=p), (4, 24, 8)),
    "transpose2d": (lambda p: keras.layers.Conv2DTranspose(8, 3, 2, "same", use_bias=False, dtype=p), (4, 8, 8, 12)),
    "transpose1d": (lambda p: keras.layers.Conv1DTranspose(8, 4, 2, use_bias=False, dtype=p), (4, 10, 6)),
}


def _all_gradients(layer, x, upstream):
    """The output and the gradients of x and of every weight, with the traced graph."""
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return (y, *tape.gradient(y, [x, *layer.trainable_weights], output_gradients=tf.cast(upstream, y.dtype)))

    return [np64(t) for t in step(x)], step.get_concrete_function(x).graph


def _float64_gradients(make, shape, weights, x, dy):
    """The float64 layer's gradients of x and every weight, at the given values."""
    layer = make("float64")
    layer.build(shape)
    layer.set_weights(weights)
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
    return [np.asarray(g) for g in tape.gradient(y, [x, *layer.trainable_weights], output_gradients=tf.constant(dy))]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", OTHER_LAYERS)
def test_depthwise_separable_and_transposed_gradients_are_float32_sums_rounded_once(name, dtype, rule_on):
    make, shape = OTHER_LAYERS[name]
    layer, x, upstream, ours, graph = _stock_then_ours(make, shape, dtype, _all_gradients, seed=3, scale=0.3)
    backward = {op.type: op.outputs[0].dtype.name for op in graph.get_operations()
                if op.name.startswith("gradient_tape/") and ("Backprop" in op.type or op.type.startswith("Conv"))}
    assert backward and set(backward.values()) == {"float32"}, backward
    weights = [np64(tf.cast(w, dtype)) for w in layer.trainable_weights]
    dy = np64(tf.cast(upstream, dtype))  # the upstream gradient enters in 16 bits
    refs = _float64_gradients(make, shape, weights, np64(x), dy)
    sizes = _float64_gradients(make, shape, [np.abs(w) for w in weights], np.abs(np64(x)), np.abs(dy))
    terms = 2.0**-24 * sum(w.size for w in weights)  # float32 accumulation through both kernels, generously
    u = UNIT_ROUNDOFF[dtype]
    for got, ref, size in zip(ours[1:], refs, sizes, strict=True):
        assert np.all(np.abs(got - ref) <= u * np.abs(ref) + terms * size), np.max(np.abs(got - ref) - u * np.abs(ref))
        once = np64(tf.cast(tf.constant(ref), dtype))
        assert np.mean(got == once) > 0.99, np.mean(got == once)


def test_stock_eigen_kernels_are_far_off_where_the_rule_is_taken():
    if not hardware.detect().emulates("bfloat16"):
        pytest.skip("this CPU runs bfloat16 convolutions natively (oneDNN): stock's kernels are not Eigen's")
    make, shape = LAYERS["conv2d_strided"]
    rng = np.random.default_rng(1)
    layer = make("mixed_bfloat16")
    layer.build(shape)
    x = tf.cast(rng.standard_normal(shape), tf.bfloat16)
    upstream = tf.constant(rng.standard_normal(layer.compute_output_shape(shape)), tf.float32)
    stock, _ = _gradients(layer, x, upstream)
    op_rules.install("bfloat16")
    ours, _ = _gradients(layer, x, upstream)
    dx_ref, dk_ref, _ = _reference(layer, x, upstream, "bfloat16")
    for s, o, ref in ((stock[1], ours[1], dx_ref), (stock[2], ours[2], dk_ref)):
        once = np64(tf.cast(tf.constant(ref), tf.bfloat16))
        assert np.mean(o == once) > 0.99 and np.mean(s == once) < 0.9, (np.mean(o == once), np.mean(s == once))


def _bfloat16_layer(make, shape):
    """The layer under mixed_bfloat16, a bfloat16 batch and an upstream gradient of ones; the rules installed."""
    layer = make("mixed_bfloat16")
    layer.build(shape)
    x = tf.cast(tf.random.stateless_normal(shape, (1, 2)), tf.bfloat16)
    op_rules.install("bfloat16")
    return layer, x, tf.ones(layer.compute_output_shape(shape))


def test_left_to_keras_with_16bit_kernels_under_xla_and_for_two_dtypes(monkeypatch):
    cpu = dict(cpu_model="AMD EPYC", onednn_enabled=True)
    assert hardware.DeviceInfo(cpu_flags={"avx2"}, **cpu).emulates("bfloat16")
    assert hardware.DeviceInfo(cpu_flags={"avx512_bf16"}, onednn_enabled=False).emulates("bfloat16")
    assert not ZEN4.emulates("bfloat16") and ZEN4.emulates("float16")
    xeon = hardware.DeviceInfo(cpu_flags={"amx_bf16", "avx512_fp16"}, **cpu)  # float16 not measured there: Keras's
    assert not xeon.emulates("bfloat16") and not xeon.emulates("float16")
    assert not any(gpus((8, 0)).emulates(d) for d in ("bfloat16", "float16"))
    assert not hardware.DeviceInfo(tpu_count=8).emulates("bfloat16")
    assert hardware.emulated("bfloat16") == hardware.detect().emulates("bfloat16")
    with pytest.raises(ValueError, match="`dtype`.*'float32'.*Allowed: 'bfloat16', 'float16'"):
        ZEN4.emulates("float32")
    with pytest.raises(TypeError, match="`dtype`"):
        ZEN4.emulates(tf.bfloat16)

    layer, x, upstream = _bfloat16_layer(*LAYERS["conv2d_strided"])

    def backprop_dtypes(graph):
        return {op.outputs[0].dtype.name for op in graph.get_operations() if "Conv2DBackprop" in op.type}

    monkeypatch.setattr(hardware, "emulated", lambda dtype: False)  # a CPU with native bfloat16, a GPU
    assert backprop_dtypes(_gradients(layer, x, upstream)[1]) == {"bfloat16"}
    monkeypatch.setattr(hardware, "emulated", lambda dtype: True)
    assert backprop_dtypes(_gradients(layer, x, upstream)[1]) == {"float32"}  # guard: taken here
    xla = _gradients(layer, x, upstream, jit_compile=True)[1]  # XLA: its own kernels
    assert backprop_dtypes(xla) == {"bfloat16"}
    with pytest.raises(tf.errors.InvalidArgumentError):  # two dtypes: Keras's error, as without keras_amp
        keras.ops.conv(tf.cast(x, tf.float32), tf.cast(layer.kernel, tf.bfloat16), 2, "same")


@pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning")  # a CPU without bfloat16
def test_eager_gradients_are_the_graphs_and_a_cnn_fits(rule_on):
    keras_amp.enable("mixed_bfloat16")
    rng = np.random.default_rng(2)
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Conv2D(8, 3, strides=2), keras.layers.GlobalAveragePooling2D(),
                              keras.layers.Dense(4)])
    x = rng.standard_normal((32, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 4, 32)

    def grads():
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
        return tape.gradient(loss, model.trainable_variables)

    eager = [np64(g) for g in grads()]
    graph = [np64(g) for g in tf.function(grads)()]
    for a, b in zip(eager, graph, strict=True):
        np.testing.assert_array_equal(a, b)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(True))
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, epochs=5, batch_size=32, verbose=0)
    assert model.evaluate(x, y, verbose=0) < before  # it learns


# Depthwise convolutions where oneDNN runs bfloat16 natively: its bfloat16 gradients are fast only for a
# 2-D 3x3 kernel at stride 1 without dilation; every other shape gets the float32 gradients.
ONEDNN_DEPTHWISE = {
    "3x3": (lambda p: keras.layers.DepthwiseConv2D(3, 1, "same", use_bias=False, dtype=p), (4, 12, 12, 8), "bfloat16"),
    "3x3_stride2": (lambda p: keras.layers.DepthwiseConv2D(3, 2, "same", use_bias=False, dtype=p), (4, 13, 13, 8),
                    "float32"),
    "5x5": (lambda p: keras.layers.DepthwiseConv2D(5, 1, "same", use_bias=False, dtype=p), (4, 12, 12, 8), "float32"),
    "3x3_dilated": (lambda p: keras.layers.DepthwiseConv2D(3, dilation_rate=2, use_bias=False, dtype=p),
                    (4, 12, 12, 8), "float32"),
    "1d_3": (lambda p: keras.layers.DepthwiseConv1D(3, use_bias=False, dtype=p), (4, 20, 8), "float32"),
    "separable_3x3": (lambda p: keras.layers.SeparableConv2D(8, 3, padding="same", use_bias=False, dtype=p),
                      (4, 12, 12, 8), "bfloat16"),
    "separable_5x5_stride2": (lambda p: keras.layers.SeparableConv2D(8, 5, 2, "same", use_bias=False, dtype=p),
                              (4, 13, 13, 8), "float32"),
}


@pytest.fixture
def native_bfloat16(monkeypatch):
    """As on a CPU alone whose oneDNN runs bfloat16 natively (Zen 4, a Xeon with AMX), on any machine."""
    monkeypatch.setattr(hardware, "emulated", lambda dtype: dtype == "float16")
    monkeypatch.setattr(islands, "native_bfloat16_cpu", lambda: True)


def _backprop_dtypes(graph):
    return {op.outputs[0].dtype.name for op in graph.get_operations()
            if op.name.startswith("gradient_tape/") and "Backprop" in op.type}


@pytest.mark.parametrize("name", ONEDNN_DEPTHWISE)
def test_onednn_bfloat16_depthwise_gradients_are_float32_except_at_3x3_stride_1(name, native_bfloat16):
    make, shape, backprop = ONEDNN_DEPTHWISE[name]
    layer, x, upstream, ours, graph = _stock_then_ours(make, shape, "bfloat16", _all_gradients, seed=4, scale=0.3)
    assert _backprop_dtypes(graph) == {backprop}
    if backprop == "float32":  # float32 sums rounded once, as everywhere the rule is taken
        weights = [np64(tf.cast(w, tf.bfloat16)) for w in layer.trainable_weights]
        refs = _float64_gradients(make, shape, weights, np64(x), np64(tf.cast(upstream, tf.bfloat16)))
        for got, ref in zip(ours[1:], refs, strict=True):
            once = np64(tf.cast(tf.constant(ref), tf.bfloat16))
            assert np.mean(got == once) > 0.99, np.mean(got == once)


def test_onednn_depthwise_exception_is_bfloat16_on_a_native_cpu_outside_xla(native_bfloat16, monkeypatch):
    make, shape, _ = ONEDNN_DEPTHWISE["5x5"]
    layer, x, upstream, _, graph = _stock_then_ours(make, shape, "bfloat16", _all_gradients, seed=5, scale=0.3)
    assert _backprop_dtypes(graph) == {"float32"}  # guard: taken here
    xla = _gradients(layer, x, upstream, jit_compile=True)[1]
    assert _backprop_dtypes(xla) == {"bfloat16"}  # XLA: its own kernels
    monkeypatch.setattr(hardware, "emulated", lambda dtype: False)  # float16 instructions too (a Xeon with AMX)
    *_, graph16 = _stock_then_ours(make, shape, "float16", _all_gradients, seed=5, scale=0.3)
    assert _backprop_dtypes(graph16) == {"float16"}  # the exception is oneDNN's bfloat16 kernels' only
    monkeypatch.setattr(islands, "native_bfloat16_cpu", lambda: False)  # a GPU: Keras's
    layer, x, upstream, _, graph = _stock_then_ours(make, shape, "bfloat16", _all_gradients, seed=5, scale=0.3)
    assert _backprop_dtypes(graph) == {"bfloat16"}


# Depthwise convolutions written as `Conv(groups=channels)` (keras.applications' ConvNeXt, keras-hub's MobileNet):
# Keras runs a grouped convolution as an XLA computation on a CPU; the rule runs it as TF's depthwise one.
GROUPED = {
    "3x3": (lambda p: keras.layers.Conv2D(16, 3, padding="same", groups=16, use_bias=False, dtype=p), (4, 12, 12, 16)),
    "5x5_stride2_multiplier2": (lambda p: keras.layers.Conv2D(32, 5, 2, "same", groups=16, use_bias=False, dtype=p),
                                (4, 13, 13, 16)),
    "7x7_valid": (lambda p: keras.layers.Conv2D(8, 7, groups=8, use_bias=False, dtype=p), (4, 14, 14, 8)),
    "1d_multiplier2": (lambda p: keras.layers.Conv1D(16, 3, groups=8, use_bias=False, dtype=p), (4, 20, 8)),
}


def _op_types(graph):
    """Op types of `graph` and of the functions it calls (a custom gradient's ops are in its function)."""
    definition = graph.as_graph_def()
    return {n.op for n in definition.node} | {n.op for f in definition.library.function for n in f.node_def}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", GROUPED)
def test_one_channel_per_group_convolutions_run_as_depthwise_ones_within_one_rounding(name, dtype):
    make, shape = GROUPED[name]
    rng = np.random.default_rng(6)
    layer = make(f"mixed_{dtype}")
    layer.build(shape)
    layer.kernel.assign(rng.standard_normal(layer.kernel.shape) * 0.3)
    x = tf.cast(rng.standard_normal(shape), dtype)
    upstream = tf.constant(rng.standard_normal(layer.compute_output_shape(shape)), tf.float32)
    stock, stock_graph = _all_gradients(layer, x, upstream)
    op_rules.install(dtype)
    ours, graph = _all_gradients(layer, x, upstream)
    assert "DepthwiseConv2dNative" in _op_types(graph) and not _op_types(graph) & {"Conv2D", "Conv2DBackpropInput"}
    assert "Conv2D" in _op_types(stock_graph)  # guard: stock's is the grouped convolution (Keras's XLA function)
    weights = [np64(tf.cast(layer.kernel, dtype))]
    dy = np64(tf.cast(upstream, dtype))
    x64 = np64(x)
    def forward64(x, kernel):
        return np.asarray(make("float64").convolution_op(tf.constant(x), tf.constant(kernel)))

    refs = [forward64(x64, weights[0]), *_float64_gradients(make, shape, weights, x64, dy)]
    sizes = [forward64(np.abs(x64), np.abs(weights[0])),
             *_float64_gradients(make, shape, [np.abs(weights[0])], np.abs(x64), np.abs(dy))]
    u, terms = UNIT_ROUNDOFF[dtype], 2.0**-24 * weights[0].size
    for got, ref, size in zip(ours, refs, sizes, strict=True):
        assert np.all(np.abs(got - ref) <= u * np.abs(ref) + terms * size), np.max(np.abs(got - ref) - u * np.abs(ref))
        once = np64(tf.cast(tf.constant(ref), dtype))
        assert np.mean(got == once) > 0.99, np.mean(got == once)


def test_grouped_convolutions_are_kerass_under_xla_on_a_gpu_with_several_channels_per_group_and_in_float32(
        monkeypatch):
    make, shape = GROUPED["5x5_stride2_multiplier2"]
    layer, x, upstream = _bfloat16_layer(make, shape)
    assert "DepthwiseConv2dNative" in _op_types(_all_gradients(layer, x, upstream)[1])  # guard: taken here
    assert "DepthwiseConv2dNative" not in _op_types(_gradients(layer, x, upstream, jit_compile=True)[1])
    several = keras.layers.Conv2D(16, 3, groups=4, dtype="mixed_bfloat16")  # four input channels per group
    several.build(shape)
    several_upstream = tf.ones(several.compute_output_shape(shape))
    assert "DepthwiseConv2dNative" not in _op_types(_all_gradients(several, x, several_upstream)[1])
    single = make("float32")
    single.build(shape)
    assert "DepthwiseConv2dNative" not in _op_types(_all_gradients(single, tf.cast(x, tf.float32), upstream)[1])
    monkeypatch.setattr(islands, "cpu_alone", lambda: False)  # a GPU: Keras's grouped convolution
    assert "DepthwiseConv2dNative" not in _op_types(_all_gradients(layer, x, upstream)[1])

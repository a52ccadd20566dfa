"""16-bit weight matmuls from float32 kernels where the CPU has no 16-bit ones (`islands.float32_kernels`).

Eigen's bfloat16 MatMul (no oneDNN: AVX2-only CPUs) and float16 MatMul (CPUs without float16
instructions) are slower than its float32 one, and the bfloat16 one truncates its sums. There the RNN
cells' weight products (`islands.weight_matmul`) and every Dense's and EinsumDense's (the matmul and
einsum-rows rules), forward and backward, are float32 kernels' on exact upcasts, each rounded once.
`hardware.emulated` is set here, so both paths run on any machine.
"""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

import keras_amp
from keras_amp import hardware
from keras_amp.numerics import islands
from tests.helpers import UNIT_ROUNDOFF, gradient_function, live_ops, np64, while_bodies


def _matmul_dtypes(graph):
    """The output dtypes of the MatMul ops in `graph`, its functions and their while bodies."""
    found = {op.outputs[0].dtype.name for op in graph.get_operations() if op.type == "MatMul"}
    for f in graph._functions.values():
        found |= _matmul_dtypes(f.graph)
    return found


def _live_kernels(graph):
    """The output dtypes of the matmuls and einsums the outputs of `graph` depend on."""
    return {op.outputs[0].dtype.name for op in live_ops(graph) if "MatMul" in op.type or op.type == "Einsum"}


def test_float32_kernels_only_for_16_bits_on_an_emulating_device_outside_xla(monkeypatch):
    monkeypatch.setattr(hardware, "emulated", lambda dtype: dtype == "bfloat16")
    assert islands.float32_kernels(tf.bfloat16) and islands.float32_kernels("bfloat16")
    assert not islands.float32_kernels("float16")  # this "device" has float16 kernels
    assert not islands.float32_kernels("float32")
    assert tf.function(lambda: tf.constant(islands.float32_kernels("bfloat16")))()
    assert not tf.function(lambda: tf.constant(islands.float32_kernels("bfloat16")), jit_compile=True)()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_weight_product_and_its_gradients_are_rounded_once(dtype, monkeypatch):
    monkeypatch.setattr(hardware, "emulated", lambda d: True)
    rng = np.random.default_rng(0)
    x = tf.cast(rng.standard_normal((48, 64)), dtype)
    weight = keras.Variable(rng.standard_normal((64, 80)).astype("float32"))
    dy = tf.cast(rng.standard_normal((48, 80)), dtype)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = islands.weight_matmul(x, weight, dtype)
        return (y, *tape.gradient(y, [x, weight], output_gradients=dy))

    y, dx, dw = step(x)
    x64, w64, dy64 = np64(x), np64(tf.cast(weight, dtype)), np64(dy)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == tf.float32
    u = UNIT_ROUNDOFF[dtype]
    for got, ref in ((y, x64 @ w64), (dx, dy64 @ w64.T), (dw, x64.T @ dy64)):
        ref_once = np64(tf.cast(tf.constant(ref, tf.float32), dtype))  # the float32 sum rounded once
        assert np.all(np.abs(np64(got) - ref) <= u * np.abs(ref) + 1e-5 * np.abs(ref).max())
        assert np.mean(np64(got) == ref_once) > 0.99, np.mean(np64(got) == ref_once)
    assert _matmul_dtypes(step.get_concrete_function(x).graph) == {"float32"}


def _recipe_lstm(units=8):
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((6, 5))
    model = keras.Model(inp, keras.layers.LSTM(units, return_sequences=True)(inp))
    return keras_amp.apply_recipe(model, "rnn")


@pytest.mark.parametrize("kind", ["recipe", "keras_amp"])
def test_an_rnn_step_multiplies_in_float32_only_where_the_device_emulates(kind, emulated):
    if kind == "recipe":
        model = _recipe_lstm()
    else:
        keras_amp.enable("mixed_bfloat16")
        inp = keras.Input((6, 5))
        model = keras.Model(inp, keras_amp.layers.GRU(8, return_sequences=True)(inp))

    graph = gradient_function(model).get_concrete_function(tf.TensorSpec((3, 6, 5))).graph
    assert list(while_bodies(graph))  # guard: the time loop's body and its gradient are traced
    assert _matmul_dtypes(graph) == ({"float32"} if emulated else {"bfloat16"})


def test_under_xla_the_products_stay_16_bit(monkeypatch):
    monkeypatch.setattr(hardware, "emulated", lambda dtype: True)
    model = _recipe_lstm()

    gradients = gradient_function(model, jit_compile=True)
    graph = gradients.get_concrete_function(tf.TensorSpec((3, 6, 5))).graph
    assert _matmul_dtypes(graph) == {"bfloat16"}
    assert all(np.all(np.isfinite(np64(g))) for g in gradients(tf.ones((3, 6, 5))))


def test_an_exported_model_keeps_the_16_bit_kernels(tmp_path, monkeypatch):
    # A SavedModel may be served on another device (a GPU): the float32 kernels are this CPU's choice.
    monkeypatch.setattr(hardware, "emulated", lambda dtype: True)
    model = _recipe_lstm()
    x = np.random.default_rng(0).standard_normal((3, 6, 5)).astype("float32")
    model.export(str(tmp_path / "lstm"), verbose=False)
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((tmp_path / "lstm" / "saved_model.pb").read_bytes())
    kernels = {tf.as_dtype(node.attr["T"].type).name for f in saved.meta_graphs[0].graph_def.library.function
               for node in f.node_def if node.op == "MatMul"}
    assert kernels == {"bfloat16"}
    loaded = tf.saved_model.load(str(tmp_path / "lstm"))  # kept: its variables live as long as it does
    served = loaded.serve(tf.constant(x))
    assert _matmul_dtypes(tf.function(model).get_concrete_function(x).graph) == {"float32"}  # guard: taken here
    np.testing.assert_allclose(np64(served), np64(model(x)), atol=0.05)


# A layer, its input shape, and its kernel as the 2-D matrix the product multiplies by.
LAYERS = {
    "dense_rows": (lambda: keras.layers.Dense(80), (48, 64), lambda k: k),
    "dense_sequence": (lambda: keras.layers.Dense(80), (4, 12, 64), lambda k: k),
    "einsum_heads": (lambda: keras.layers.EinsumDense("abc,cde->abde", (12, 4, 20), bias_axes="de"), (4, 12, 64),
                     lambda k: k.reshape(64, 80)),
    "einsum_transposed": (lambda: keras.layers.EinsumDense("abc,dc->abd", (12, 80), bias_axes="d"), (4, 12, 64),
                          lambda k: k.T),
    "einsum_merge_heads": (lambda: keras.layers.EinsumDense("abcd,cde->abe", (12, 80), bias_axes="e"),
                           (4, 12, 4, 16), lambda k: k.reshape(64, 80)),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", LAYERS)
def test_a_layer_s_weight_product_is_rounded_once_forward_and_backward(kind, dtype, emulated):
    build, shape, as_matrix = LAYERS[kind]
    keras_amp.enable(f"mixed_{dtype}")
    layer = build()
    layer.build(shape)
    rng = np.random.default_rng(1)
    layer.set_weights([rng.standard_normal(w.shape).astype("float32") for w in layer.get_weights()])
    x = tf.cast(rng.standard_normal(shape), dtype)
    dy = tf.cast(rng.standard_normal(layer.compute_output_shape(shape)), dtype)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return (y, *tape.gradient(y, [x, layer.kernel], output_gradients=dy))

    y, dx, dkernel = step(x)
    assert _live_kernels(step.get_concrete_function(x).graph) == ({"float32"} if emulated else {dtype})
    if not emulated:
        return  # TF's own kernels: their rounding is the device's (tests/helpers.matmul_rounding)
    rows = lambda t: np64(t).reshape(-1, 80)
    w64 = as_matrix(np64(tf.cast(layer.kernel.value, dtype)))
    x64, dy64 = np64(x).reshape(-1, 64), rows(dy)
    r16 = lambda a: np64(tf.cast(tf.constant(a, tf.float32), dtype))  # a float64 value rounded once
    product = x64 @ w64
    bias = np64(tf.cast(layer.bias.value, dtype)).reshape(-1)
    u = UNIT_ROUNDOFF[dtype]
    checks = (
        (rows(y), r16(r16(product) + bias), product + bias),  # Keras adds the bias to the rounded product
        (np64(dx).reshape(-1, 64), r16(dy64 @ w64.T), dy64 @ w64.T),
        (as_matrix(np64(dkernel)), r16(x64.T @ dy64), x64.T @ dy64),
    )
    for got, once, exact in checks:
        assert np.all(np.abs(got - exact) <= 2 * u * np.abs(exact) + 1e-3 * np.abs(exact).max())
        assert np.mean(got == once) > 0.99, (kind, np.mean(got == once))


def test_inputs_of_unknown_static_shape(monkeypatch):
    # A function traced for any input shape: the rows are taken from the dynamic shape.
    monkeypatch.setattr(hardware, "emulated", lambda dtype: True)
    keras_amp.enable("mixed_bfloat16")
    dense = keras.layers.Dense(8)
    dense.build((None, 4))

    @tf.function(input_signature=[tf.TensorSpec((None, None, None), tf.bfloat16)])
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = dense(x)
        return (y, *tape.gradient(y, [x, dense.kernel]))

    x = tf.cast(np.random.default_rng(2).standard_normal((2, 3, 4)), tf.bfloat16)
    y, dx, dkernel = step(x)
    w64, b64 = np64(tf.cast(dense.kernel.value, tf.bfloat16)), np64(tf.cast(dense.bias.value, tf.bfloat16))
    assert _live_kernels(step.get_concrete_function().graph) == {"float32"}
    np.testing.assert_allclose(np64(y), np64(x) @ w64 + b64, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np64(dx), np.broadcast_to(w64.sum(1), (2, 3, 4)), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np64(dkernel), np.broadcast_to(np64(x).reshape(6, 4).sum(0)[:, None], (4, 8)),
                               rtol=2e-2, atol=2e-2)


def test_products_of_unknown_rank_or_lists_are_keras_s(monkeypatch):
    monkeypatch.setattr(hardware, "emulated", lambda dtype: True)
    keras_amp.enable("mixed_bfloat16")
    weight = keras.Variable(np.eye(3), dtype="bfloat16")  # a weight of the activation's dtype

    @tf.function(input_signature=[tf.TensorSpec(None, tf.bfloat16)])
    def product(x):
        return keras.ops.matmul(x, weight)

    x = tf.cast([[1.0, 2.0, 3.0]], tf.bfloat16)
    np.testing.assert_array_equal(np64(product(x)), [[1.0, 2.0, 3.0]])
    assert _live_kernels(product.get_concrete_function().graph) == {"bfloat16"}  # TF's kernel: rank unknown
    np.testing.assert_array_equal(np64(keras.ops.matmul([[1.0, 2.0]], [[1.0], [1.0]])), [[3.0]])


@pytest.mark.parametrize("kind", ["recipe", "keras_amp"])
def test_a_traced_rnn_step_is_freed_with_its_function(kind, emulated):
    # The time loop's weight products carry keras_amp's custom gradient: TensorFlow's
    # tf.custom_gradient would register each traced step's closure, and its graph, for good.
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((6, 5))
    layer = keras.layers.LSTM(8) if kind == "recipe" else keras_amp.layers.GRU(8)
    model = keras.Model(inp, layer(inp))
    model = keras_amp.apply_recipe(model, "rnn") if kind == "recipe" else model
    gradients = gradient_function(model)
    graph = weakref.ref(gradients.get_concrete_function(tf.TensorSpec((3, 6, 5))).graph)
    assert list(while_bodies(graph()))  # guard: the loop and its gradient were traced
    del gradients
    gc.collect()
    assert graph() is None

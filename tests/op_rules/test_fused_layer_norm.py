"""Layer normalisation's forward pass as oneDNN's fused float32 kernel: the same float32 numbers, one
rounding, and the same gradient; keras_amp's op-by-op float32 path wherever the kernel is not certain to
apply (eager execution, another axis, a device without it)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import _compat
from keras_amp.op_rules import fused_layer_norm
from tests.helpers import live_ops

pytestmark = pytest.mark.usefixtures("no_op_rules")

FUSES = fused_layer_norm.device_fuses()


def _as64(t) -> np.ndarray:
    return np.asarray(tf.cast(t, tf.float64))


def _layer(shape, **kwargs):
    rng = np.random.default_rng(7)
    keras_amp.enable("mixed_bfloat16")
    layer = keras.layers.LayerNormalization(**kwargs)
    layer.build(shape)
    for w in layer.weights:  # parameters that matter (Keras starts at ones and zeros)
        w.assign(rng.standard_normal(w.shape))
    # Activations with a mean far from zero: a normalisation's hard case in 16 bits.
    x = tf.constant(3.0 * rng.standard_normal(shape) + 20.0, tf.bfloat16)
    return layer, x


def _reference(layer, x) -> np.ndarray:
    """float64 layer normalisation of the bfloat16 `x` over its last axis, float32 parameters."""
    x64 = _as64(x)
    y = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + layer.epsilon)
    if layer.scale:
        y = y * _as64(layer.gamma)
    return y + _as64(layer.beta) if layer.center else y


def _live_types(fn, x) -> set[str]:
    return {op.type for op in live_ops(tf.function(fn).get_concrete_function(x).graph)}


@pytest.mark.parametrize("kwargs", [{}, {"center": False}, {"scale": False, "center": False}],
                         ids=["gamma_beta", "gamma", "neither"])
def test_inference_layer_norm_is_the_fused_kernel_rounded_once(kwargs):
    layer, x = _layer((8, 64, 256), **kwargs)
    ref = _reference(layer, x)
    y = _as64(tf.function(lambda x: layer(x, training=False))(x))
    once = _as64(tf.cast(ref, tf.bfloat16))
    assert np.all(np.abs(y - ref) <= 2.0**-8 * np.abs(ref) + 1e-5 * np.abs(ref).max()), np.max(np.abs(y - ref))
    assert np.mean(y == once) > 0.999, np.mean(y == once)  # float32 arithmetic, one rounding
    types = _live_types(lambda x: layer(x, training=False), x)
    if not FUSES:
        assert fused_layer_norm.OP_TYPE not in types
        return
    assert fused_layer_norm.OP_TYPE in types and "Rsqrt" not in types, types
    # keras_amp's op-by-op float32 path, the same numbers up to float32 rounding.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_layer_norm, "device_fuses", lambda: False)
        ops = _as64(tf.function(lambda x: layer(x, training=False))(x))
    assert np.mean(ops == y) > 0.999 and np.max(np.abs(ops - y)) <= 2.0**-7 * np.abs(ref).max()


def _trained(layer):
    def trained(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.range(y.shape[-1], dtype=tf.float32))
        return [y] + tape.gradient(loss, [x] + layer.trainable_weights)

    return trained


@pytest.mark.skipif(not FUSES, reason="no oneDNN CPU kernel here")
def test_training_gets_the_same_gradient_as_the_op_by_op_path():
    layer, x = _layer((8, 64, 256))
    assert fused_layer_norm.OP_TYPE in _live_types(lambda x: _trained(layer)(x)[0], x)
    fused = [_as64(t) for t in tf.function(_trained(layer))(x)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_layer_norm, "device_fuses", lambda: False)
        ops = [_as64(t) for t in tf.function(_trained(layer))(x)]
    assert np.mean(fused[0] == ops[0]) > 0.999
    for a, b in zip(fused[1:], ops[1:]):  # the same backward pass, from the same recomputed statistics
        np.testing.assert_array_equal(a, b)


def test_a_graph_traced_for_inference_then_differentiated():
    # The function is traced once, without a tape; TensorFlow differentiates that graph later.
    layer, x = _layer((4, 16, 64))
    f = tf.function(lambda x: layer(x))
    f(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(tf.cast(f(x), tf.float32) * tf.range(64, dtype=tf.float32))
    dx = _as64(tape.gradient(loss, x))
    np.testing.assert_allclose(dx, _trained(layer)(x)[1], rtol=0, atol=2.0**-7 * np.abs(dx).max())


def test_xla_compiled_functions_keep_the_float32_ops():
    # XLA has no kernel for the op: a `jit_compile=True` step (Keras's compile(jit_compile=True)) would fail.
    layer, x = _layer((4, 16, 64))
    compiled = tf.function(_trained(layer), jit_compile=True)
    graph = compiled.get_concrete_function(x).graph
    assert fused_layer_norm.OP_TYPE not in {op.type for op in graph.get_operations()}
    y, dx, *_ = compiled(x)
    np.testing.assert_allclose(_as64(y), _reference(layer, x), rtol=2.0**-7, atol=1e-5)
    np.testing.assert_allclose(_as64(dx), _as64(tf.function(_trained(layer))(x)[1]), rtol=0,
                               atol=2.0**-7 * np.abs(_as64(dx)).max())


def test_eager_other_axes_and_other_devices_keep_the_float32_ops():
    layer, x = _layer((4, 16, 64))
    eager = _as64(layer(x, training=False))  # eager: op by op
    np.testing.assert_allclose(eager, _reference(layer, x), rtol=2.0**-7, atol=1e-5)
    other_axis, x2 = _layer((4, 16, 64), axis=1)
    assert fused_layer_norm.OP_TYPE not in _live_types(lambda x: other_axis(x, training=False), x2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_layer_norm, "device_fuses", lambda: False)  # a GPU, or no oneDNN
        assert fused_layer_norm.OP_TYPE not in _live_types(lambda x: layer(x, training=False), x)


def test_the_op_is_pinned_by_its_op_def():
    name = f"{_compat.OP_DEF}{fused_layer_norm.OP_TYPE}"
    assert _compat.original(name).name == fused_layer_norm.OP_TYPE
    assert _compat.pin_problem(_compat.PIN_BY_NAME[name], _compat.ORIGINALS) is None
    missing = _compat.Pin(f"{_compat.OP_DEF}_NoSuchOp", "0" * 16, (_compat.OP_LAYER_NORM_FUSION,))
    assert "missing" in _compat.pin_problem(missing, _compat.resolve([missing]))
    changed = _compat.Pin(name, "0" * 16, (_compat.OP_LAYER_NORM_FUSION,))
    assert "changed" in _compat.pin_problem(changed, _compat.ORIGINALS)


def test_an_exported_model_keeps_portable_ops(tmp_path):
    # `model.export()` traces while TensorFlow saves: the SavedModel must load on builds without oneDNN.
    layer, x = _layer((4, 16, 64))
    inputs = keras.Input((16, 64), dtype="bfloat16")
    model = keras.Model(inputs, layer(inputs))
    model.export(str(tmp_path), verbose=False)
    from tensorflow.core.protobuf import saved_model_pb2  # noqa: PLC0415

    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((tmp_path / "saved_model.pb").read_bytes())
    graph = saved.meta_graphs[0].graph_def
    types = {n.op for f in graph.library.function for n in f.node_def} | {n.op for n in graph.node}
    assert fused_layer_norm.OP_TYPE not in types and "Rsqrt" in types
    loaded = tf.saved_model.load(str(tmp_path))
    np.testing.assert_allclose(_as64(loaded.serve(x)), _reference(layer, x), rtol=2.0**-7, atol=1e-5)
    if FUSES:  # guard: the same model traced outside a save uses the kernel
        assert fused_layer_norm.OP_TYPE in _live_types(lambda x: model(x), x)

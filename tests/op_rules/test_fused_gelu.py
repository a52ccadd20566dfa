"""A bfloat16 gelu fused into its matmul for inference: float32 numerics with one rounding where oneDNN
fuses it; keras_amp's float32 path wherever that fusion is not certain (a tape, another reader, a
device without the kernel)."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.op_rules import fused_gelu
from tests.helpers import matmul_roundoff

pytestmark = pytest.mark.usefixtures("no_op_rules")

FUSES = fused_gelu.device_fuses()
_erf = np.vectorize(math.erf)


def _as64(t) -> np.ndarray:
    return np.asarray(tf.cast(tf.cast(t, tf.bfloat16), tf.float64))


def _dense(shape, units=256):
    rng = np.random.default_rng(5)
    keras_amp.enable("mixed_bfloat16")
    layer = keras.layers.Dense(units, activation="gelu")
    layer.build(shape)
    layer.bias.assign(0.5 * rng.standard_normal(units))
    x = tf.constant(rng.standard_normal(shape), tf.float32)
    pre = np.tensordot(_as64(x), _as64(layer.kernel), 1) + _as64(layer.bias)  # float64, bfloat16 operands
    return layer, x, 0.5 * pre * (1.0 + _erf(pre / math.sqrt(2.0)))


def _unfused_bound(layer, x, ref):
    """keras_amp's float32 gelu of the twice-rounded bfloat16 pre-activation, rounded: gelu's slope is
    within [-0.17, 1.13], so |error| <= 1.13 (pre-activation error) + the last rounding. The matmul's
    rounding is its kernel's (a whole ulp where it truncates)."""
    xw = np.abs(np.tensordot(_as64(x), _as64(layer.kernel), 1))
    pre = xw + np.abs(_as64(layer.bias))
    return 2.0**-8 * np.abs(ref) + 1.13 * (matmul_roundoff("bfloat16") * 1.01 * xw + 2.0**-8 * pre) + 2.0**-20


def _op_types(fn, x) -> set[str]:
    return {op.type for op in tf.function(fn).get_concrete_function(x).graph.get_operations()}


@pytest.mark.parametrize("shape", [(512, 128), (8, 64, 128)], ids=["rows", "sequence"])
def test_inference_gelu_is_the_fusable_op_rounded_once(shape):
    layer, x, ref = _dense(shape)
    y = np.asarray(tf.cast(tf.function(lambda x: layer(x))(x), tf.float64))
    types = _op_types(lambda x: layer(x), x)
    assert np.all(np.abs(y - ref) <= _unfused_bound(layer, x, ref)), np.max(np.abs(y - ref))
    if not FUSES:
        assert "Erfc" not in types and "Erf" not in types  # keras_amp's float32 path, no 16-bit gelu op
        return
    assert "PartitionedCall" not in types and "Erfc" in types  # TF's gelu ops, for the remapper
    assert np.mean(y == _as64(ref)) > 0.999  # oneDNN's fused kernel: gelu in float32, one rounding


def test_a_recording_tape_eager_or_a_device_without_the_kernel_keep_the_float32_path(monkeypatch):
    layer, x, ref = _dense((512, 128))

    def under_tape(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return y, tape.gradient(y, x)

    assert not {"Erf", "Erfc"} & _op_types(under_tape, x)  # no 16-bit gelu op
    eager = np.asarray(tf.cast(layer(x), tf.float64))
    assert np.all(np.abs(eager - ref) <= _unfused_bound(layer, x, ref))
    monkeypatch.setattr(fused_gelu, "device_fuses", lambda: False)  # a GPU, or no native bfloat16
    assert not {"Erf", "Erfc"} & _op_types(lambda x: layer(x), x)


@pytest.mark.skipif(not FUSES, reason="oneDNN does not run bfloat16 natively here")
def test_a_reader_of_the_pre_activation_added_later_gets_stocks_bfloat16_gelu():
    # The case the module doc names: the remapper does not fuse, TF's bfloat16 ops run (stock's
    # numerics); the pre-activation itself is untouched.
    layer, x, ref = _dense((512, 128))
    cast = lambda t: keras.ops.cast(t, "bfloat16")  # noqa: E731

    @tf.function
    def two_readers(x):
        pre = keras.ops.add(keras.ops.matmul(cast(x), cast(layer.kernel)), cast(layer.bias))
        return keras.activations.gelu(pre), pre

    y, pre = (np.asarray(tf.cast(t, tf.float64)) for t in two_readers(x))
    pre64 = np.tensordot(_as64(x), _as64(layer.kernel), 1) + _as64(layer.bias)
    assert np.mean(pre == _as64(pre64)) > 0.999
    keras.config.set_dtype_policy("float32")
    stock = np.asarray(tf.cast(tf.function(lambda p: tf.nn.gelu(p, approximate=False))(
        tf.constant(pre, tf.bfloat16)), tf.float64))
    np.testing.assert_array_equal(y, stock)


@pytest.mark.skipif(not FUSES, reason="oneDNN does not run bfloat16 natively here")
def test_on_a_sequence_stocks_gelu_rounds_after_each_op_where_ours_is_fused():
    # Stock gets the fused kernel for a Dense on rows; on a sequence tensordot's reshape keeps the
    # matmul, the bias and the gelu apart (the bias rule's reshape move brings them together).
    shape = (8, 64, 128)
    keras.config.set_dtype_policy("mixed_bfloat16")
    rng = np.random.default_rng(5)
    layer = keras.layers.Dense(256, activation="gelu")
    layer.build(shape)
    layer.bias.assign(0.5 * rng.standard_normal(256))
    x = tf.constant(rng.standard_normal(shape), tf.float32)
    stock = np.asarray(tf.cast(tf.function(lambda x: layer(x))(x), tf.float64))
    keras_amp.enable("mixed_bfloat16")
    ours = np.asarray(tf.cast(tf.function(lambda x: layer(x))(x), tf.float64))
    pre = np.tensordot(_as64(x), _as64(layer.kernel), 1) + _as64(layer.bias)
    ref = _as64(0.5 * pre * (1.0 + _erf(pre / math.sqrt(2.0))))
    assert np.mean(ours == ref) > 0.999 and np.mean(stock == ref) < 0.9

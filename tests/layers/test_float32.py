"""Float32 wrapper: a user's own normalisation runs in float32 under every policy."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from keras_amp.layers import Float32
from tests.helpers import MIXED, np64, u


class UserNorm(keras.layers.Layer):
    """A hand-written normalisation with no dtype care, as users write them."""

    def call(self, x):
        mean = ops.mean(x, axis=-1, keepdims=True)
        var = ops.mean(ops.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) / ops.sqrt(var + 1e-3)


def _x():
    rng = np.random.default_rng(0)
    return (1e4 + 100 * rng.standard_normal((4, 8))).astype("float32")


def _ref(x):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-3)


def test_matches_float64_reference(policy):
    x = _x()
    y = Float32(UserNorm())(x)
    assert y.dtype == tf.float32
    # float32 statistics of ~1e4 +- 100 values: ~1e-5 relative.
    np.testing.assert_allclose(np64(y), _ref(np64(x)), atol=5e-5)
    y_c = Float32(UserNorm(), output_dtype="compute")(x)
    assert keras.backend.standardize_dtype(y_c.dtype) == keras.dtype_policies.get(policy).compute_dtype
    np.testing.assert_allclose(np64(y_c), _ref(np64(x)), atol=5e-5 + 2 * u(policy) * 3)


@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_unwrapped_user_layer_breaks(p):
    keras.config.set_dtype_policy(p)
    x = _x()
    stock = np64(UserNorm()(x))
    # float16: squares of 1e4 overflow; bfloat16: inputs rounded to multiples of 64.
    assert not (np.abs(stock - _ref(np64(x))).max() < 0.1)
    assert np.abs(np64(Float32(UserNorm())(x)) - _ref(np64(x))).max() < 5e-5


def test_nested_sublayers_become_float32(mixed_policy):
    inner = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)])
    wrapped = Float32(inner, output_dtype="compute")
    y = wrapped(np.ones((3, 5), "float32"))
    computing = [lyr for lyr in inner._flatten_layers() if not isinstance(lyr, keras.layers.InputLayer)]
    assert len(computing) == 3 and all(lyr.compute_dtype == "float32" for lyr in computing)
    assert keras.backend.standardize_dtype(y.dtype) == keras.dtype_policies.get(mixed_policy).compute_dtype
    sym = Float32(keras.layers.Dense(3))(keras.Input((5,)))
    assert sym.dtype == "float32"


def test_gradients_match_float32(mixed_policy):
    x = tf.constant(_x() / 1e4)
    grads = {}
    for p in ("float32", mixed_policy):
        layer = Float32(keras.layers.Dense(3, kernel_initializer="ones", dtype=p), dtype=p)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x) ** 2)
        grads[p] = tape.gradient(loss, [x] + layer.trainable_variables)
    for g32, gm in zip(grads["float32"], grads[mixed_policy]):
        np.testing.assert_allclose(np64(gm), np64(g32), rtol=1e-6)  # all float32


def test_invalid_arguments():
    with pytest.raises(TypeError, match="layer"):
        Float32("dense")
    with pytest.raises(ValueError, match="output_dtype"):
        Float32(keras.layers.Dense(2), output_dtype="int8")
    half = keras.layers.Dense(2, dtype="float16")
    half.build((None, 3))
    with pytest.raises(ValueError, match="float32"):
        Float32(half)


def test_islands_are_marked_by_class_not_by_attribute(mixed_policy):
    """Every keras_amp layer is a `model_graph.Float32Island`; nothing sets a marker on the
    user's layer that `Float32` wraps (its policy is what changes)."""
    from keras_amp import layers as amp_layers
    from keras_amp import model_graph

    inner = keras.Sequential([keras.layers.Dense(4), keras.layers.LayerNormalization()])
    wrapped = Float32(inner)
    islands = [
        wrapped,
        amp_layers.OutputHead(3),
        amp_layers.Softmax(),
        amp_layers.LayerNormalization(),
        amp_layers.BatchNormalization(),
        amp_layers.GroupNormalization(groups=2),
        amp_layers.RMSNormalization(),
        amp_layers.MultiHeadAttention(2, 4),
        amp_layers.LSTM(2),
        amp_layers.GRU(2),
    ]
    assert all(model_graph.is_island(layer) for layer in islands)
    for layer in [inner, *inner.layers]:
        assert not model_graph.is_island(layer)
        assert not [name for name in vars(layer) if name.startswith("_keras_amp")]
        assert layer.dtype_policy.name == "float32"

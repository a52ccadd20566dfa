"""OutputHead: float32 Dense + activation under every policy; stock Dense(softmax) is float16."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.layers import OutputHead
from tests.helpers import MIXED, np64, softmax


def _setup():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16)).astype("float32")
    kernel = (3 * rng.standard_normal((16, 10))).astype("float32")
    return x, kernel


def test_matches_float64_reference(policy):
    x, kernel = _setup()
    head = OutputHead(10, activation="softmax")
    head.build(x.shape)
    head.kernel.assign(kernel)
    y = head(x)
    assert y.dtype == tf.float32 and head.kernel.dtype == "float32"
    np.testing.assert_allclose(np64(y), softmax(np64(x) @ np64(kernel)), atol=1e-5)
    assert isinstance(head, keras.layers.Dense)


@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_stock_dense_softmax_is_low_precision(p):
    keras.config.set_dtype_policy(p)
    x, kernel = _setup()
    stock = keras.layers.Dense(10, activation="softmax")
    stock.build(x.shape)
    stock.kernel.assign(kernel)
    ref = softmax(np64(x) @ np64(kernel))
    y = stock(x)
    assert keras.backend.standardize_dtype(y.dtype) == keras.dtype_policies.get(p).compute_dtype
    assert np.abs(np64(y) - ref).max() > 1e-4  # float16/bfloat16 probabilities
    head = OutputHead(10, activation="softmax")
    head.build(x.shape)
    head.set_weights(stock.get_weights())  # same weights as Dense
    assert np.abs(np64(head(x)) - ref).max() < 1e-5


def test_model_output_is_float32(mixed_policy):
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    model = keras.Model(inputs, OutputHead(10, activation="softmax")(hidden))
    assert model.outputs[0].dtype == "float32"
    assert model(np.ones((2, 16))).dtype == tf.float32


def test_rejects_non_float32_dtype():
    with pytest.raises(ValueError, match="float32"):
        OutputHead(3, dtype="mixed_float16")
    assert OutputHead(3, dtype="float32").compute_dtype == "float32"

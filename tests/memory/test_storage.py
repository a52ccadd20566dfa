"""keras_amp.memory.storage: a Keras variable's storage dtype changed in place; exact state bytes."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_amp import memory


def test_set_storage_keeps_the_keras_variable_and_its_attributes():
    layer = keras.layers.Dense(3)
    layer.build((None, 2))
    kernel = layer.kernel
    value = kernel.numpy()
    memory.set_storage(kernel, "bfloat16")
    assert layer.kernel is kernel and layer.weights[0] is kernel
    assert memory.storage_dtype(kernel) == "bfloat16" and kernel.value.dtype == tf.bfloat16
    assert kernel.trainable and kernel.path == "dense/kernel"
    np.testing.assert_array_equal(kernel.numpy(), tf.cast(value, tf.bfloat16).numpy())
    kernel.assign(np.ones((2, 3), "float32"))  # assign casts to the storage dtype
    assert kernel.numpy().dtype.name == "bfloat16"
    memory.set_storage(kernel, "float32", np.full((2, 3), 0.5, "float32"))
    np.testing.assert_array_equal(kernel.numpy(), np.full((2, 3), 0.5, "float32"))


def test_set_storage_refuses_inside_a_traced_function_and_before_build():
    layer = keras.layers.Dense(3)
    layer.build((None, 2))

    @tf.function
    def swap():
        memory.set_storage(layer.kernel, "bfloat16")

    with pytest.raises(RuntimeError, match="outside a tf.function"):
        swap()
    lazy = keras.Variable(initializer="zeros", shape=(2,), dtype="float32")
    lazy._value = None
    with pytest.raises(ValueError, match="not initialized"):
        memory.set_storage(lazy, "bfloat16")


def test_state_bytes_counts_each_variable_once_by_its_storage():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization()])
    model.compile(keras.optimizers.Adam(), "mse")
    model.optimizer.build(model.trainable_variables)
    memory.set_storage(model.layers[0].kernel, "bfloat16")
    got = memory.state_bytes(model)
    assert got["trainable"] == 4 * 8 * 2 + 8 * 4 + 2 * 8 * 4  # bf16 kernel, float32 bias, gamma, beta
    assert got["non_trainable"] == 2 * 8 * 4
    # Adam: two float32 slots per trainable weight (built on float32), iteration (int64), learning rate.
    assert got["optimizer"] == 2 * (4 * 8 + 8 + 8 + 8) * 4 + 8 + 4
    assert got["total"] == got["trainable"] + got["non_trainable"] + got["optimizer"]

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


@pytest.mark.parametrize("kind, dtype", [("split", "bfloat16"), ("kahan", "float16"), ("kahan", "bfloat16"),
                                         ("none", "bfloat16")])
def test_lean_master_joins_the_16bit_value_with_the_recorded_compensation(kind, dtype):
    from keras_amp.numerics import bits  # noqa: PLC0415

    x = np.random.default_rng(0).normal(size=(64,)).astype("float32") * 3.0
    v = keras.Variable(x)
    assert memory.storage.lean_master(v) is None and not memory.storage.is_marked_lean(v)  # not lean
    if kind == "split":
        hi, low = bits.split(tf.constant(x))
    elif kind == "kahan":
        hi, low = bits.kahan_split(tf.constant(x), tf.as_dtype(dtype))
    else:
        hi, low = tf.cast(x, dtype), None
    memory.set_storage(v, dtype, hi)
    memory.storage.mark_lean(v, kind, low)
    assert memory.storage.is_marked_lean(v)
    got = memory.storage.lean_master(v).numpy()
    x64, err = x.astype("float64"), np.abs(got.astype("float64") - x.astype("float64"))
    if kind == "split":
        np.testing.assert_array_equal(got.view(np.uint32), x.view(np.uint32))  # the master, bit for bit
    else:  # kahan: about twice the 16-bit precision; none: the 16-bit value itself
        ulp = np.abs(x64) * (2.0 ** -10 if dtype == "float16" else 2.0 ** -7)
        assert np.all(err <= (ulp * 2.0 ** -8 if kind == "kahan" else ulp)), err.max()
    memory.storage.unmark_lean(v)
    assert memory.storage.lean_master(v) is None and not memory.storage.is_marked_lean(v)

"""keras_amp.memory.float32_weights: every weight float32 inside, 16-bit storage back exactly after."""

import numpy as np

import keras
import keras_amp
from keras_amp import memory


def test_frozen_and_lean_weights_are_float32_inside_and_16bit_after():
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    model.layers[0].trainable = False
    model.compile(keras_amp.optimizers.LeanAdam(1e-2), "mse")
    model.fit(np.ones((8, 4), "float32"), np.zeros((8, 2), "float32"), verbose=0)
    lean_kernel = model.layers[1].kernel
    master = model.optimizer.master_weights()[id(lean_kernel)].numpy()
    frozen = np.asarray(model.layers[0].kernel.numpy(), np.float32)
    with memory.float32_weights(model):
        assert {memory.storage_dtype(v) for v in model.weights} == {"float32"}
        np.testing.assert_array_equal(lean_kernel.numpy(), master)
        np.testing.assert_array_equal(model.layers[0].kernel.numpy(), frozen)
    assert {memory.storage_dtype(v) for v in model.weights} == {"bfloat16"}
    np.testing.assert_array_equal(model.optimizer.master_weights()[id(lean_kernel)].numpy(), master)
    assert model.train_function is None  # traced again at the next call

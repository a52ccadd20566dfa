"""keras_amp.memory.float32_weights: every weight float32 inside, 16-bit storage back exactly after."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_amp
from keras_amp import memory
from keras_amp.numerics import bits


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


def test_lean_weights_of_a_model_compiled_again_hold_their_masters_inside():
    # Compiled with another optimizer and not trained since (no `prepare` yet): the masters come from
    # the compensation recorded with each weight, not from the 16-bit values alone.
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    model.compile(keras_amp.optimizers.LeanAdam(1e-3), "mse")
    x, y = np.ones((16, 8), "float32"), np.zeros((16, 2), "float32")
    model.fit(x, y, epochs=2, verbose=0)
    kernel = model.layers[0].kernel
    master = model.optimizer.master_weights()[id(kernel)].numpy()
    hi = kernel.numpy().copy()
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    with memory.float32_weights(model):
        np.testing.assert_array_equal(kernel.numpy().view(np.uint32), master.view(np.uint32))
    assert memory.storage_dtype(kernel) == "bfloat16"
    np.testing.assert_array_equal(kernel.numpy().view(np.uint16), hi.view(np.uint16))  # back as it was


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_kahan_weights_come_back_bit_for_bit_although_their_join_splits_otherwise(policy):
    # A "kahan" remainder of exactly half an ulp joins into a master whose split rounds the tie the other
    # way: leaving the view had moved such weights one ulp, and training differed from then on.
    keras_amp.enable(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(64),
                              keras.layers.Dense(4)])
    opt = keras_amp.optimizers.LeanAdam(1e-3, compensation="kahan")
    model.compile(keras_amp.LossScaleOptimizer(opt) if policy == "mixed_float16" else opt, "mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(256, 16)).astype("float32"), rng.normal(size=(256, 4)).astype("float32"),
              batch_size=16, epochs=2, verbose=0)
    dtype = tf.as_dtype(policy.split("_")[1])
    ties = sum(int(tf.reduce_sum(tf.cast(tf.not_equal(bits.kahan_split(m, dtype)[0], v.value), tf.int32)))
               for v in model.trainable_variables if (m := opt.master_weights().get(id(v))) is not None)
    assert ties > 0  # guard: some stored pairs are not the split of their join
    before = [v.numpy() for v in model.weights + opt.variables]
    with memory.float32_weights(model):
        pass
    for a, b in zip(before, [v.numpy() for v in model.weights + opt.variables]):
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))

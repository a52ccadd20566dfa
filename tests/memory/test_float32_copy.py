"""keras_amp.memory.float32_weights: every weight float32 inside, 16-bit storage back exactly after."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_amp
from keras_amp import memory
from keras_amp.memory import storage
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
    assert model.train_function is not None  # the same variables came back: its steps still hold
    new = np.full(model.layers[0].kernel.shape, 1 + 2**-10, "float32")  # not a bfloat16 value
    with memory.float32_weights(model):
        model.layers[0].kernel.assign(new)
    assert memory.storage_dtype(model.layers[0].kernel) == "bfloat16"
    np.testing.assert_array_equal(np.asarray(model.layers[0].kernel.numpy(), np.float32), np.ones_like(new))


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


def _lean_fit(model, callbacks=(), epochs=3):
    model.compile(keras_amp.optimizers.LeanAdam(1e-2), "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 16)).astype("float32"), rng.normal(size=(64, 4)).astype("float32")
    return model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False,
                     callbacks=list(callbacks)).history["loss"]


def _wrapped():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    backbone = keras.Model(inputs, keras.layers.Dense(8)(keras.layers.Dense(32)(inputs)), name="backbone")
    inputs = keras.Input((16,))
    return keras.Model(inputs, keras.layers.Dense(4)(backbone(inputs))), backbone


@pytest.mark.parametrize("part", ["model", "backbone"])
def test_float32_weights_saved_in_a_callback_during_fit(tmp_path, part):
    # Saving float32 weights each epoch (of the model, or of the backbone inside it, which has no
    # optimizer of its own): fit went on with its traced step, and nothing it trains changed.
    keras_amp.enable("mixed_bfloat16")
    reference_model = _wrapped()[0]
    reference = _lean_fit(reference_model)
    model, backbone = _wrapped()
    saved = []

    class SaveFloat32(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            target = model if part == "model" else backbone
            path = str(tmp_path / f"{epoch}.weights.h5")
            masters = [storage.lean_master(v) for v in target.weights]
            memory.save_float32_weights(target, path)
            saved.append((path, [m.numpy() for m in masters]))

    assert _lean_fit(model, [SaveFloat32()]) == reference
    assert len(saved) == 3 and memory.storage_dtype(backbone.weights[0]) == "bfloat16"
    for v, want in zip(model.weights, reference_model.weights):  # the model holds what it trained
        np.testing.assert_array_equal(storage.lean_master(v).numpy(), storage.lean_master(want).numpy())
    np.testing.assert_array_equal(saved[-1][1][0], storage.lean_master(backbone.weights[0]).numpy())
    keras_amp.disable()
    plain = _wrapped()[0 if part == "model" else 1]
    for path, masters in saved:
        plain.load_weights(path)
        for v, want in zip(plain.weights, masters):
            np.testing.assert_array_equal(v.numpy(), want, err_msg=v.path)


def test_a_weight_assigned_inside_is_stored_as_training_stores_it_and_steps_traced_inside_go():
    keras_amp.enable("mixed_bfloat16")
    model, backbone = _wrapped()
    _lean_fit(model, epochs=1)
    kernel = backbone.weights[0]
    new = np.random.default_rng(1).normal(size=kernel.shape).astype("float32")
    model.predict_function = None
    with memory.float32_weights(backbone):
        kernel.assign(new)
        model.predict(np.ones((2, 16), "float32"), verbose=0)  # traced on the float32 copies
    assert model.predict_function is None and model.train_function is not None
    assert memory.storage_dtype(kernel) == "bfloat16"
    np.testing.assert_array_equal(storage.lean_master(kernel).numpy(), new)  # "split": exact
    got = model.predict(np.ones((2, 16), "float32"), verbose=0)
    # A graph of the model traced now (eager differs where oneDNN fuses a bias into its matmul: one rounding).
    want = tf.function(lambda x: model(x, training=False))(np.ones((2, 16), "float32"))
    np.testing.assert_array_equal(got, keras.ops.convert_to_numpy(want))

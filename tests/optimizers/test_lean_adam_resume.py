"""LeanAdam's state across a change of optimizer, a re-save before training and a tf.train.Checkpoint."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_amp
from keras_amp import memory
from keras_amp.optimizers import LeanAdam

X = np.random.RandomState(0).randn(64, 16).astype("float32")
Y = np.random.RandomState(1).randn(64, 4).astype("float32")


def _model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(4, dtype="float32")])


def _bits(x):
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


@pytest.mark.parametrize("second", ["LeanAdam", "Adam"])
def test_compiled_again_the_float32_masters_go_to_the_new_optimizer(second):
    # Before: the weights stayed in bfloat16 with no compensation, the new optimizer trained them as pure
    # bfloat16 Adam (no weight moved in 8 steps) and the old optimizer's low bits were lost.
    keras_amp.enable("mixed_bfloat16")
    model = _model()
    model.compile(LeanAdam(1e-3), "mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    kernel = model.layers[0].kernel
    master = model.optimizer.master_weights()[id(kernel)].numpy()
    assert memory.storage_dtype(kernel) == "bfloat16"  # guard: lean under the first optimizer
    model.compile(LeanAdam(1e-2) if second == "LeanAdam" else keras.optimizers.Adam(1e-2), "mse")
    prepared = memory.prepare(model)
    if second == "LeanAdam":
        assert kernel.path in prepared.lean
        model.optimizer.build(model.trainable_variables)
        np.testing.assert_array_equal(_bits(model.optimizer.master_weights()[id(kernel)]), _bits(master))
    else:
        assert kernel.path in prepared.back_to_float32 and memory.storage_dtype(kernel) == "float32"
        np.testing.assert_array_equal(_bits(kernel.numpy()), _bits(master))
    before = kernel.numpy().astype("float32")
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    assert np.mean(kernel.numpy().astype("float32") != before) > 0.9
    assert not memory.prepare(model).changed  # the handover happens once


def test_a_loaded_state_saved_again_before_training_is_kept(tmp_path):
    # Before: the unbuilt optimizer wrote no state, and the run resumed from the re-saved file at step 0.
    keras_amp.enable("mixed_bfloat16")
    model = _model()
    model.compile(LeanAdam(1e-3), "mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    model.save(str(tmp_path / "a.keras"))
    loaded = keras.saving.load_model(str(tmp_path / "a.keras"))
    assert not loaded.optimizer.built and int(loaded.optimizer.iterations.numpy()) == 4
    loaded.save(str(tmp_path / "b.keras"))
    again = keras.saving.load_model(str(tmp_path / "b.keras"))
    resumed = again.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
    uninterrupted = model.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
    assert resumed == uninterrupted and int(again.optimizer.iterations.numpy()) == 8
    for a, b in zip(model.weights + model.optimizer.variables, again.weights + again.optimizer.variables, strict=True):
        np.testing.assert_array_equal(_bits(a.numpy()), _bits(b.numpy()), err_msg=a.path)


def test_a_tf_checkpoint_restored_after_prepare_brings_the_masters_back(tmp_path):
    # Before: `build` assigned the compensation worked out at `prepare` (from the fresh model's
    # initial weights) over the restored one: masters off by up to 1.7e-3, assert_consumed passing.
    keras_amp.enable("mixed_bfloat16")
    model = _model(seed=1)
    model.compile(LeanAdam(1e-3), "mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    fresh = _model(seed=2)
    fresh.compile(LeanAdam(1e-3), "mse")
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):  # README: restore after prepare
        tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    fresh = _model(seed=2)
    fresh.compile(LeanAdam(1e-3), "mse")
    memory.prepare(fresh, fresh.optimizer)
    status = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    fresh.optimizer.build(fresh.trainable_variables)
    status.assert_consumed()
    want, got = model.optimizer.master_weights(), fresh.optimizer.master_weights()
    assert len(got) == len(want) == 2  # the bfloat16 Dense's kernel and bias
    for a, b in zip(model.trainable_variables, fresh.trainable_variables):
        if id(a) in want:
            np.testing.assert_array_equal(_bits(got[id(b)]), _bits(want[id(a)]), err_msg=a.path)
    resumed = fresh.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
    uninterrupted = model.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
    assert resumed == uninterrupted

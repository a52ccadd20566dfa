"""Checkpoints keep float32 master weights whatever the policy: a mixed-trained model loads into a
float32 model bit-exact through `.keras`, `tf.train.Checkpoint` and `BackupAndRestore`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from auto_precision_models import regression_data, sensitive_model
from keras_amp.auto_precision import model_policies

X, Y = regression_data(n=64)


def _mixed_trained(policy, callbacks=()):
    model = sensitive_model(policy)
    model_policies.set_policies(model, {"sensitive": "float32"})
    model.compile(keras_amp.wrap(keras.optimizers.Adam(1e-2)), "mse")
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0, callbacks=list(callbacks))
    return model


def _float32_twin():
    return sensitive_model("float32", seed=1)  # other initial weights: a load must overwrite them


def _assert_bit_exact(src, dst):
    assert all(w.dtype == "float32" for w in src.weights)  # master weights are float32 under mixed
    assert len(src.weights) == len(dst.weights)
    for a, b in zip(src.weights, dst.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a.value), keras.ops.convert_to_numpy(b.value))


POLICIES = ["mixed_bfloat16", "mixed_float16"]


@pytest.mark.parametrize("policy", POLICIES)
def test_keras_file(policy, tmp_path):
    model = _mixed_trained(policy)
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras_amp.LossScaleOptimizer)
    model.save(tmp_path / "m.keras")
    twin = _float32_twin()
    assert not np.array_equal(twin.get_weights()[0], model.get_weights()[0])
    twin.load_weights(tmp_path / "m.keras")
    _assert_bit_exact(model, twin)


@pytest.mark.parametrize("policy", POLICIES)
def test_tf_train_checkpoint(policy, tmp_path):
    model = _mixed_trained(policy)
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    twin = _float32_twin()
    tf.train.Checkpoint(model=twin).read(path).assert_existing_objects_matched()
    _assert_bit_exact(model, twin)


class _Capture(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.weights = [w.numpy().copy() for w in self.model.weights]


@pytest.mark.parametrize("policy", POLICIES)
def test_backup_and_restore(policy, tmp_path):
    backup = str(tmp_path / "backup")
    model = _mixed_trained(policy, callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    twin = _float32_twin()
    twin.compile(keras.optimizers.Adam(1e-2), "mse")
    capture = _Capture()  # after BackupAndRestore's on_train_begin: sees the restored weights
    twin.fit(X, Y, batch_size=16, epochs=3, verbose=0,
             callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False), capture])
    assert len(capture.weights) == len(model.weights)
    for a, b in zip(model.weights, capture.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a.value), b)

"""keras_amp.memory.hooks: enable() makes fit/evaluate/predict prepare the model; disable() undoes it."""

import numpy as np

import keras
import keras_amp
from keras_amp import memory
from keras_amp.memory import hooks


def _frozen_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.layers[0].trainable = False
    model.compile("sgd", "mse")
    return model


def test_enable_installs_and_disable_removes_the_hooks():
    trainer = keras.Model
    original = trainer.make_train_function
    keras_amp.enable("mixed_bfloat16")
    assert hooks.installed() and trainer.make_train_function is not original
    keras_amp.disable()
    assert not hooks.installed() and trainer.make_train_function is original


def test_each_entry_point_prepares_and_retraces():
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    for call in (lambda m: m.predict(x, verbose=0), lambda m: m.evaluate(x, y, verbose=0),
                 lambda m: m.fit(x, y, verbose=0)):
        keras_amp.enable("mixed_bfloat16")
        model = _frozen_model()
        call(model)
        assert memory.storage_dtype(model.layers[0].kernel) == "bfloat16"
        keras_amp.disable()


def test_a_traced_function_is_dropped_when_storage_changes():
    keras_amp.enable("mixed_bfloat16")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    model = _frozen_model()
    model.layers[0].trainable = True
    model.fit(x, y, verbose=0)
    first = model.train_function
    model.layers[0].trainable = False
    model.fit(x, y, verbose=0)  # freezing after a fit: stored in 16 bits, traced again
    assert memory.storage_dtype(model.layers[0].kernel) == "bfloat16"
    assert model.train_function is not first
    again = model.train_function
    model.fit(x, y, verbose=0)  # nothing changed: the trace is kept
    assert model.train_function is again


def test_without_keras_amp_fit_leaves_storage_alone():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _frozen_model()
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), verbose=0)
    assert memory.storage_dtype(model.layers[0].kernel) == "float32"

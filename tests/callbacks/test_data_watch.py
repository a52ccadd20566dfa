"""keras_amp.callbacks.data_watch: per-step NaN/inf counts of the training batches, in variables."""

import keras
import numpy as np

from keras_amp.callbacks import data_watch
from keras_amp.callbacks.data_watch import DataWatch
from tests.helpers import regression_batch, two_dense_model


def _compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # lr 0: NaN batches leave the weights
    return model


def test_counts_the_batches_holding_nan_or_inf_and_names_the_first():
    model = _compiled(two_dense_model())
    x, y = regression_batch(n=32)
    x[9, 2] = np.nan  # batch 1 of 4 (batch size 8)
    y[27, 0] = np.inf  # batch 3
    watch = DataWatch(model)
    watch.install()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    steps, bad, first = watch.read()
    assert (steps, first) == (8, 1) and watch.names == ["inputs", "labels"]
    np.testing.assert_array_equal(bad, [2, 2] + [0] * (data_watch.MAX_ARRAYS - 2))  # once per epoch each
    assert watch.describe(steps_per_epoch=4) == (
        "the training batch of step 2 of this fit (epoch 1, batch 1): inputs (2 batches), labels (2 batches)")
    assert watch.describe() == "the training batch of step 2 of this fit: inputs (2 batches), labels (2 batches)"
    watch.reset()
    steps, bad, first = watch.read()
    assert (steps, int(bad.sum()), first) == (0, 0, -1) and watch.describe() == ""


def test_clean_batches_count_steps_only():
    model = _compiled(two_dense_model())
    watch = DataWatch(model)
    watch.install()
    model.fit(*regression_batch(n=24), batch_size=8, epochs=1, verbose=0)
    steps, bad, first = watch.read()
    assert (steps, int(bad.sum()), first) == (3, 0, -1) and watch.describe(steps_per_epoch=3) == ""


def test_structured_inputs_are_named_by_key_and_integer_ones_skipped():
    ids = keras.Input((3,), dtype="int32", name="ids")
    features = keras.Input((4,), name="f")
    h = keras.layers.Concatenate()([keras.layers.Flatten()(keras.layers.Embedding(10, 2)(ids)), features])
    model = _compiled(keras.Model({"ids": ids, "f": features}, keras.layers.Dense(1)(h)))
    f = np.ones((16, 4), "float32")
    f[12, 1] = -np.inf  # batch 1 of 2
    watch = DataWatch(model)
    watch.install()
    model.fit({"ids": np.zeros((16, 3), "int32"), "f": f}, np.zeros((16, 1), "float32"),
              batch_size=8, epochs=1, verbose=0, shuffle=False)
    steps, bad, first = watch.read()
    assert watch.names == ["inputs['f']", "labels"] and (steps, first) == (2, 1)
    assert bad[:2].tolist() == [1, 0]


def test_arrays_past_the_last_slot_share_it():
    n_inputs = data_watch.MAX_ARRAYS + 1  # with the labels, 2 more arrays than slots
    inputs = [keras.Input((1,)) for _ in range(n_inputs)]
    model = _compiled(keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(inputs))))
    x = [np.ones((8, 1), "float32") for _ in range(n_inputs)]
    x[-1][3, 0] = np.nan  # the last input: past the last named slot
    watch = DataWatch(model)
    watch.install()
    model.fit(x, np.zeros((8, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    _, bad, first = watch.read()
    last = data_watch.MAX_ARRAYS - 1
    assert watch.names[:2] == ["inputs[0]", "inputs[1]"] and len(watch.names) == data_watch.MAX_ARRAYS
    assert watch.names[last] == "further arrays"
    assert first == 0 and bad.tolist() == [0] * last + [1]
    assert watch.describe() == "the training batch of step 1 of this fit: further arrays (1 batch)"


def test_remove_puts_back_the_models_own_train_step():
    model = _compiled(two_dense_model())
    watch = DataWatch(model)
    watch.install()
    wrapper = model.train_step
    watch.install()  # once only: not wrapped twice
    assert model.train_step is wrapper and "train_step" in vars(model)
    watch.remove()
    assert "train_step" not in vars(model) and model.train_function is None
    model.fit(*regression_batch(n=8), batch_size=8, epochs=1, verbose=0)
    assert watch.read()[0] == 0  # no longer counting
    # A train_step the model already had as an instance attribute is the one put back.
    own_calls = []
    original = model.train_step

    def own(data):
        own_calls.append(1)
        return original(data)

    model.train_step = own
    watch.install()
    model.fit(*regression_batch(n=16), batch_size=8, epochs=1, verbose=0)
    watch.remove()
    assert model.train_step is own and watch.read()[0] == 2
    assert own_calls  # traced through the wrapper, so the model's own step ran

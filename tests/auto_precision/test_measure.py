"""measure: the search's batches and loss, weighted exactly as `fit` weights them; errors against float32."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.auto_precision import measure

RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 4)).astype("float32")
Y = RNG.normal(size=(8, 1)).astype("float32")
W = np.array([1, 0, 2, 0, 1, 0, 3, 0], "float32")  # zero weights hide half the rows


def _model(loss):
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(keras.layers.Dense(6, name="d1")(inp)))
    model.compile("sgd", loss)
    return model


def _unaligned_mse(y_true, y_pred):
    """No rank alignment of its own: with y (8,) and y_pred (8, 1) it broadcasts to (8, 8) unless wrapped."""
    return keras.ops.square(y_true - y_pred)


@pytest.mark.parametrize("loss, y", [
    ("mse", Y),
    (keras.losses.mean_squared_error, Y),
    (keras.losses.MeanSquaredError(), Y),
    (_unaligned_mse, Y[:, 0]),  # compile brings y and y_pred to one rank before the function sees them
], ids=["name", "function", "loss_object", "function_without_rank_alignment"])
def test_the_weighted_loss_is_the_one_fit_computes(loss, y):
    model = _model(loss)
    # Before: a name or function got the weights as a third positional argument (a TypeError).
    (value, _, _), = measure.run(model, [(X, y, W)], measure.loss_of(model, None))
    expected = model.evaluate(X, y, sample_weight=W, batch_size=8, verbose=0)
    assert value == pytest.approx(expected, rel=1e-6)
    unweighted = model.evaluate(X, y, batch_size=8, verbose=0)
    assert abs(unweighted - expected) > 1e-3 * abs(expected)  # guard: the weights change the loss


def test_a_dataset_of_weighted_batches_is_read_as_fit_reads_it():
    ds = tf.data.Dataset.from_tensor_slices((X, Y, W)).batch(4)
    batches = measure.batches_of(ds, 5)
    assert len(batches) == 2 and [len(b) for b in batches] == [3, 3]
    np.testing.assert_array_equal(batches[1][2], W[4:])


@pytest.mark.parametrize("data, match", [
    ((X, None), r"`data` must yield \(x, y\[, sample_weight\]\) batches with targets y\. Received: batch 0 with "
                r"y=None"),
    ([(X, Y), (X, None)], r"Received: batch 1 with y=None"),
    ([(X, Y, W, W)], r"Received: batch 0 with 4 elements"),
    (tf.data.Dataset.from_tensor_slices(X).batch(4), r"`data` must yield \(x, y\) batches"),
    (tf.data.Dataset.from_tensor_slices((X[:0], Y[:0])).batch(4), r"`data` must yield at least one batch"),
])
def test_batches_without_targets_are_refused_naming_data(data, match):
    with pytest.raises(ValueError, match=match):
        measure.batches_of(data, 2)


def test_batches_of_another_type_are_refused_naming_data():
    with pytest.raises(TypeError, match=r"`data` must be a tf.data.Dataset of \(x, y\[, sample_weight\]\) batches"):
        measure.batches_of({"x": X, "y": Y}, 2)


def test_a_batch_the_model_cannot_take_is_an_error_naming_data():
    model = _model("mse")
    with pytest.raises(ValueError) as info:
        measure.reference(model, [(np.ones((8, 5), "float32"), Y)], measure.loss_of(model, None))
    message = str(info.value)
    # Before: TensorFlow's "in user code: File .../audit.py ..." about `x`.
    assert message.startswith("`data` must yield (x, y[, sample_weight]) batches that model")
    assert "expected shape=(None, 4), found shape=(8, 5)" in message and "in user code" not in message


def test_errors_are_relative_to_the_reference_and_inf_when_not_finite():
    ref = [(2.0, [np.array([3.0, 4.0])], [np.array([1.0, 0.0])])]
    run = [(2.5, [np.array([3.0, 4.5])], [np.array([1.0, 0.5])])]
    errors = measure.errors(run, ref)
    assert errors.loss == pytest.approx(0.25) and errors.output == pytest.approx(0.1)  # 0.5 / 5
    assert errors.gradient == pytest.approx(0.5) and errors.finite
    overflow = measure.errors([(math.inf, [np.array([np.inf, 4.0])], [np.array([1.0, 0.0])])], ref)
    assert overflow.loss == math.inf and overflow.output == math.inf and not overflow.finite


def test_a_loss_is_needed_and_only_one():
    model = _model(None)
    with pytest.raises(ValueError, match="needs a loss"):
        measure.loss_of(model, None)
    with pytest.raises(TypeError, match="takes one loss for the whole output"):
        measure.loss_of(model, {"out": "mse"})
    # A compiled dict of losses: TensorFlow's tracking keeps it as a wrapper, not a dict.
    model.compile(optimizer="sgd", loss={model.output_names[0]: "mse"})
    with pytest.raises(TypeError, match=r"Received: loss, a dict of losses \(1 of them\)"):
        measure.loss_of(model, None)

"""float32_loss: mean(square(y - 300)) is inf in float16 with raw ops, finite with the wrapper; as_compiled: a
loss as compile runs it."""

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from keras_amp.losses import as_compiled, float32_loss


def _raw_mse(y_true, y_pred):
    return ops.mean(ops.square(y_true - y_pred))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_raw_ops_overflow_or_round_wrapper_holds(dtype):
    y_true = ops.zeros((8,), dtype)
    y_pred = ops.full((8,), 300.0, dtype)
    raw = float(ops.convert_to_numpy(ops.cast(_raw_mse(y_true, y_pred), "float32")))
    if dtype == "float16":
        assert np.isinf(raw)  # 300**2 = 9e4 > 65504
    else:
        # bfloat16 keeps 8 significant bits: 90000 rounds to the nearest multiple of 512, 90112
        # (and the mean of 8 equal terms stays exact). Reference: float64 rounded by ml_dtypes.
        expected = float(np.float32(ml_dtypes.bfloat16(300.0**2)))
        assert expected == 90112.0 and raw == expected  # 0.12% off, silently
    wrapped = float32_loss(_raw_mse)(y_true, y_pred)
    assert wrapped.dtype == tf.float32
    assert float(wrapped) == 90000.0  # exact: 300 is exact in both dtypes


def test_keras_loss_objects_and_decorator():
    y_true = np.zeros((4, 3), "float32")
    y_pred = ops.full((4, 3), 300.0, "float16")
    # Keras Loss objects already compute in float32: the wrapper must do no harm to them.
    assert float(keras.losses.MeanSquaredError()(y_true, y_pred)) == 90000.0
    mse = float32_loss(keras.losses.MeanSquaredError())
    assert float(mse(y_true, y_pred)) == 90000.0
    # The function form computes in y_pred's dtype: 300**2 overflows float16 unwrapped.
    raw = keras.losses.mean_squared_error(y_true, y_pred)
    assert raw.dtype == tf.float16 and np.all(np.isinf(raw.numpy()))
    wrapped = float32_loss(keras.losses.mean_squared_error)(y_true, y_pred)
    assert wrapped.dtype == tf.float32
    np.testing.assert_array_equal(wrapped.numpy(), np.full(4, 90000.0))

    @float32_loss
    def weighted(y_true, y_pred, sample_weight=None):
        return ops.sum(ops.square(y_true - y_pred) * sample_weight)

    sw = ops.full((4, 3), 0.5, "float16")
    assert float(weighted(y_true, y_pred, sample_weight=sw)) == 12 * 45000.0
    assert weighted.__name__ == "weighted"


def test_integer_labels_untouched_and_gradient():
    labels = np.array([1, 0], "int32")
    logits = tf.Variable(np.array([[0.0, 2.0], [1.0, -1.0]], "float16"))
    loss_fn = float32_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, logits)
    assert loss.dtype == tf.float32
    grad = tape.gradient(loss, logits)
    assert grad.dtype == tf.float16 and np.all(np.isfinite(grad.numpy()))


def test_rejects_non_callable():
    with pytest.raises(TypeError, match="callable"):
        float32_loss(3)


def test_as_compiled_runs_a_loss_as_compile_does():
    y_pred = keras.ops.full((4, 1), 2.0, "float16")
    y_true = np.full((4, 1), 1e7, "float32")  # not a float16 number
    stock = keras.losses.get("mse")(y_true, y_pred)  # the bare function casts the labels to float16
    assert not np.isfinite(np.asarray(stock, np.float64)).all()
    for loss in ("mse", keras.losses.mean_squared_error, lambda t, p: keras.ops.square(t - p)[:, 0],
                 keras.losses.MeanSquaredError()):
        compiled = as_compiled(loss)
        assert isinstance(compiled, keras.losses.Loss)
        value = compiled(y_true, y_pred, sample_weight=np.array([1.0, 1.0, 0.0, 0.0], "float32"))
        assert keras.backend.standardize_dtype(value.dtype) == "float32"
        assert float(value) == pytest.approx((1e7 - 2.0) ** 2 / 2, rel=1e-6)  # sum_over_batch_size
    traced = tf.function(lambda t, p: as_compiled(lambda a, b: keras.ops.abs(a - b))(t, p))
    assert float(traced(y_true, y_pred)) == pytest.approx(1e7 - 2.0, rel=1e-6)  # a lambda's name is no scope
    with pytest.raises(TypeError, match="`loss`"):
        as_compiled(3)

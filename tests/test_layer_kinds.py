"""keras_amp.layer_kinds: what a layer computes, by Keras type, activation identity or traced ops."""

import keras

from keras_amp import layer_kinds
from tests.helpers import MyNorm, Scaler


def test_op_kind_taxonomy():
    assert layer_kinds.op_kind(keras.layers.Softmax()) == "softmax"
    assert layer_kinds.op_kind(keras.layers.Dense(2, activation="log_softmax")) == "softmax"
    assert layer_kinds.op_kind(keras.layers.Dense(2, activation="softplus")) == "exp"
    assert layer_kinds.op_kind(keras.layers.RMSNormalization()) == "normalization"  # a Keras type
    assert layer_kinds.op_kind(keras.layers.ActivityRegularization(l2=1.0)) == "loss"
    assert layer_kinds.op_kind(keras.layers.TimeDistributed(keras.layers.Dense(2, activation="softmax"))) == "softmax"
    assert layer_kinds.op_kind(keras.layers.Dense(2, activation="relu")) is None


class Upcast(keras.layers.Layer):
    """Normalises in float32 whatever its policy, as keras-hub's RMS norms do."""

    def call(self, x):
        y = keras.ops.cast(x, "float32")
        y = y * keras.ops.rsqrt(keras.ops.mean(keras.ops.power(y, 2), axis=-1, keepdims=True) + 1e-6)
        return keras.ops.cast(y, self.compute_dtype)


def _called(layer, dtype="float32"):
    inp = keras.Input((8,), dtype=dtype)
    keras.Model(inp, layer(inp))
    return layer


def test_op_kind_normalization_is_what_the_ops_compute_not_the_name():
    assert layer_kinds.op_kind(_called(MyNorm())) is None
    assert layer_kinds.op_kind(_called(Scaler())) == "normalization"
    assert layer_kinds.op_kind(Scaler()) is None  # never called in a graph: no ops to read
    # The dtype of the statistics is the traced one: the policy's, or float32 where the layer upcasts.
    assert layer_kinds.normalization_dtype(_called(Scaler(dtype="mixed_bfloat16"))) == "bfloat16"
    assert layer_kinds.normalization_dtype(_called(Upcast(dtype="mixed_bfloat16"))) == "float32"
    assert layer_kinds.normalization_dtype(_called(Scaler(dtype="float32"))) == "float32"
    assert layer_kinds.normalization_dtype(_called(keras.layers.Dense(4))) is None

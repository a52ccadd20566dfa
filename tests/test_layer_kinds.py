"""keras_amp.layer_kinds: what a layer computes, by Keras type, activation identity or traced ops."""

import keras
import tensorflow as tf

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


_ONE_D, _TWO_D, _THREE_D = (8, 4), (8, 8, 4), (4, 4, 4, 2)
_EXAMPLES = {  # one instance of each KNOWN_ROOTLESS class, with an input it takes
    "Activation": (lambda L: L.Activation("gelu"), (8,)), "Conv1D": (lambda L: L.Conv1D(4, 3), _ONE_D),
    "Conv1DTranspose": (lambda L: L.Conv1DTranspose(4, 3), _ONE_D), "Conv2D": (lambda L: L.Conv2D(4, 3), _TWO_D),
    "Conv2DTranspose": (lambda L: L.Conv2DTranspose(4, 3), _TWO_D), "Conv3D": (lambda L: L.Conv3D(2, 3), _THREE_D),
    "Conv3DTranspose": (lambda L: L.Conv3DTranspose(2, 3), _THREE_D), "Dense": (lambda L: L.Dense(4), (8,)),
    "DepthwiseConv1D": (lambda L: L.DepthwiseConv1D(3), _ONE_D),
    "DepthwiseConv2D": (lambda L: L.DepthwiseConv2D(3), _TWO_D), "Dropout": (lambda L: L.Dropout(0.5), (8,)),
    "ELU": (lambda L: L.ELU(), (8,)), "EinsumDense": (lambda L: L.EinsumDense("ab,bc->ac", output_shape=4), (8,)),
    "Flatten": (lambda L: L.Flatten(), _TWO_D), "Identity": (lambda L: L.Identity(), (8,)),
    "LeakyReLU": (lambda L: L.LeakyReLU(), (8,)), "PReLU": (lambda L: L.PReLU(), (8,)),
    "Permute": (lambda L: L.Permute((2, 1)), _ONE_D), "ReLU": (lambda L: L.ReLU(), (8,)),
    "Rescaling": (lambda L: L.Rescaling(2.0), (8,)), "Reshape": (lambda L: L.Reshape((4, 2)), (8,)),
    "SeparableConv1D": (lambda L: L.SeparableConv1D(4, 3), _ONE_D),
    "SeparableConv2D": (lambda L: L.SeparableConv2D(4, 3), _TWO_D),
}
for _d, _shape in ((1, _ONE_D), (2, _TWO_D), (3, _THREE_D)):
    for _kind in ("AveragePooling", "GlobalAveragePooling", "GlobalMaxPooling", "MaxPooling", "UpSampling",
                  "ZeroPadding", "Cropping", "SpatialDropout"):
        _args = {"SpatialDropout": (0.5,), "Cropping": (1,), "AveragePooling": (2,), "MaxPooling": (2,)}.get(_kind, ())
        _EXAMPLES[f"{_kind}{_d}D"] = (lambda L, k=f"{_kind}{_d}D", a=_args: getattr(L, k)(*a), _shape)


def test_known_rootless_layers_are_what_their_traces_show():
    # The shortcut answers only what a trace of the layer would: every class in it is traced here.
    assert {cls.__name__ for cls in layer_kinds.KNOWN_ROOTLESS} == set(_EXAMPLES)
    keras.config.set_dtype_policy("mixed_bfloat16")
    for name, (make, shape) in _EXAMPLES.items():
        layer = make(keras.layers)
        inp = keras.Input(shape)
        keras.Model(inp, layer(inp))
        graph = tf.function(layer, autograph=False).get_concrete_function(
            tf.TensorSpec(layer.input.shape, layer.input.dtype)).graph  # raises where it cannot trace
        assert len(graph.get_operations()) > 2, name  # guard: the layer's ops are there
        assert not [op for op in graph.get_operations() if op.type in ("Rsqrt", "Sqrt")], name
        assert layer_kinds._traced_root_dtype(layer) is None and layer_kinds.normalization_dtype(layer) is None, name


class RMSDense(keras.layers.Dense):
    def call(self, x):
        y = super().call(x)
        return y * keras.ops.rsqrt(keras.ops.mean(keras.ops.square(y), axis=-1, keepdims=True) + 1e-6)


def _rms(y):
    return y * keras.ops.rsqrt(keras.ops.mean(keras.ops.square(y), axis=-1, keepdims=True) + 1e-6)


def test_a_subclass_or_an_activation_not_keras_own_is_traced():
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert layer_kinds.normalization_dtype(_called(RMSDense(4))) == "bfloat16"
    assert layer_kinds.normalization_dtype(_called(keras.layers.Dense(4, activation=_rms))) == "bfloat16"
    assert layer_kinds.normalization_dtype(_called(keras.layers.Activation(_rms))) == "bfloat16"

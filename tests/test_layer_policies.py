"""keras_amp.layer_policies: the one in-place policy setter (recipes, search, fallback, schedule)."""

import keras
import numpy as np
import pytest

import keras_amp
from keras_amp import layer_policies
from keras_amp.auto_precision import model_policies


def _float8_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(1, name="b")])
    model.quantize("float8")
    return model


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize`")
def test_a_float8_layer_keeps_its_quantization_under_float32():
    keras_amp.enable("mixed_bfloat16")
    model = _float8_model()
    layer = model.get_layer("a")
    # Stock Keras's setter, for contrast: the float8 quantization is gone without a word.
    stock = _float8_model().get_layer("a")
    stock.dtype_policy = "float32"
    assert stock.dtype_policy.quantization_mode is None
    model_policies.set_policies(model, {"a": "float32"})  # what Float32Fallback / ProgressivePrecision call
    assert layer.dtype_policy.name == "float8_from_float32" and layer.compute_dtype == "float32"
    assert layer.dtype_policy.amax_history_length == model.get_layer("b").dtype_policy.amax_history_length
    # Its float8 variables stay in use: a training step writes the amax history of the gradient.
    history = next(v for v in layer.variables if v.path.endswith("outputs_grad_amax_history"))
    before = np.array(history.numpy())
    model.compile(keras.optimizers.SGD(1e-2), "mse")
    model.fit(np.ones((4, 8), "float32"), np.ones((4, 1), "float32"), verbose=0)
    assert not np.array_equal(history.numpy(), before)


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize`")
def test_a_change_that_would_drop_float8_is_refused_naming_the_layer_and_rolled_back():
    keras_amp.enable("mixed_bfloat16")
    model = _float8_model()
    layers = dict(model_policies.layers_by_path(model))
    with pytest.raises(ValueError, match=r"Layer 'b' \(Dense\) is quantized \('float8_from_mixed_bfloat16'\)"):
        layer_policies.set_in_place([("a", layers["a"], "float32"),
                                     ("b", layers["b"], keras_amp.Matmul16DTypePolicy("mixed_bfloat16"))])
    assert layers["a"].dtype_policy.name == "float8_from_mixed_bfloat16"  # rolled back


def test_normalization_statistics_are_refreshed_when_search_or_fallback_set_float32():
    keras_amp.enable("mixed_float16")
    mean = np.array([1.0001, 3.14159], "float32")  # not representable in float16
    inp = keras.Input((2,))
    model = keras.Model(inp, keras.layers.Normalization(mean=mean, variance=[2.0, 0.5], name="norm")(inp))
    norm = model.get_layer("norm")
    assert not np.array_equal(np.asarray(norm.mean, "float32"), mean)  # rounded to float16 at build
    model_policies.set_policies(model, {"norm": "float32"})
    assert np.array_equal(np.asarray(norm.mean), mean.reshape(norm.mean.shape))


class _NoSetter(keras.layers.Layer):
    def call(self, x):
        return x

    @property
    def dtype_policy(self):
        return keras.DTypePolicy("mixed_bfloat16")


def test_a_layer_that_refuses_rolls_every_change_back():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, name="d")(inp)
    model = keras.Model(inp, _NoSetter(name="stuck")(h))
    with pytest.raises(ValueError, match=r"layer 'stuck' \(_NoSetter\) to 'float32'") as info:
        model_policies.set_policies(model, {"d": "float32", "stuck": "float32"})
    assert isinstance(info.value, layer_policies.PolicyChangeError) and info.value.path == "stuck"
    assert model.get_layer("d").dtype_policy.name == "mixed_bfloat16"

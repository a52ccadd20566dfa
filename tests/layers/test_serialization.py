"""Every keras_amp layer: registered, get_config round trip, `.keras` save/load in Sequential,
functional and subclassed models, same outputs after loading."""

import keras
import numpy as np
import pytest

from keras_amp import layers as amp_layers
from tests.helpers import np64, u

SEQ = (2, 6, 8)


class Block(keras.Model):
    """A subclassed model holding a keras_amp layer."""

    def __init__(self, inner=None, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner if inner is not None else amp_layers.LayerNormalization()

    def call(self, x):
        return self.inner(x)

    def get_config(self):
        return {**super().get_config(), "inner": keras.saving.serialize_keras_object(self.inner)}

    @classmethod
    def from_config(cls, config):
        config["inner"] = keras.saving.deserialize_keras_object(config["inner"])
        return cls(**config)


keras.saving.register_keras_serializable(package="keras_amp_tests")(Block)


class SelfAttention(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = amp_layers.MultiHeadAttention(2, 4, dropout=0.1)

    def build(self, input_shape):
        self.mha.build(input_shape, input_shape)

    def call(self, x):
        return self.mha(x, x)


LAYERS = {
    "Softmax": lambda: amp_layers.Softmax(axis=-1, output_dtype="compute"),
    "LayerNormalization": lambda: amp_layers.LayerNormalization(epsilon=1e-4),
    "BatchNormalization": lambda: amp_layers.BatchNormalization(momentum=0.9),
    "GroupNormalization": lambda: amp_layers.GroupNormalization(groups=2),
    "RMSNormalization": lambda: amp_layers.RMSNormalization(epsilon=1e-5),
    "MultiHeadAttention": lambda: amp_layers.MultiHeadAttention(2, 4, dropout=0.1),
    "LSTM": lambda: amp_layers.LSTM(4, return_sequences=True),
    "GRU": lambda: amp_layers.GRU(4, return_sequences=True, reset_after=False),
    "Float32": lambda: amp_layers.Float32(keras.layers.Dense(3), output_dtype="compute"),
    "OutputHead": lambda: amp_layers.OutputHead(3, activation="softmax"),
}


def _apply(layer, x):
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return layer(x, x)
    return layer(x)


def _x():
    return np.random.default_rng(0).standard_normal(SEQ).astype("float32")


@pytest.mark.parametrize("name", LAYERS, ids=lambda n: n)
def test_config_round_trip(name):
    layer = LAYERS[name]()
    assert keras.saving.get_registered_name(type(layer)) == f"keras_amp>{type(layer).__name__}"
    clone = type(layer).from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


# Each model kind under a different policy: every kind and every policy is
# covered without the full 3 x 3 product (saving is the slow part).
KIND_POLICY = [("sequential", "float32"), ("functional", "mixed_float16"), ("subclassed", "mixed_bfloat16")]


@pytest.mark.parametrize("name", LAYERS, ids=lambda n: n)
@pytest.mark.parametrize("kind,policy_name", KIND_POLICY, ids=lambda v: v)
def test_keras_file_round_trip(name, kind, policy_name, tmp_path):
    keras.config.set_dtype_policy(policy_name)
    x = _x()
    if kind == "sequential":
        if name == "MultiHeadAttention":
            model = keras.Sequential([keras.Input(SEQ[1:]), SelfAttention()])
        else:
            model = keras.Sequential([keras.Input(SEQ[1:]), LAYERS[name]()])
    elif kind == "functional":
        inputs = keras.Input(SEQ[1:])
        model = keras.Model(inputs, _apply(LAYERS[name](), inputs))
    else:
        model = Block(LAYERS[name]() if name != "MultiHeadAttention" else SelfAttention())
        model(x)
    expected = np64(model(x))
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(
        path, custom_objects={"SelfAttention": SelfAttention}
    )
    # The keras_amp class itself (not a stock class of the same name) comes back. For MHA in
    # sequential/subclassed models SelfAttention re-creates it in __init__; functional loads it.
    layer_types = {type(lyr) for lyr in loaded._flatten_layers()}
    assert getattr(amp_layers, name) in layer_types, layer_types
    # Same weights, same float32 islands: identical outputs (inference mode).
    np.testing.assert_allclose(np64(loaded(x)), expected, rtol=0, atol=0)


def test_stock_weights_load_into_ours(mixed_policy):
    """Stock checkpoints load into ours and give stock's function: ours under the mixed policy
    matches a float32 stock layer with the same weights to the compute dtype's precision (a
    weight mapped to the wrong place would be off by O(1))."""
    x = _x()
    pairs = [
        (lambda **k: keras.layers.LSTM(4, **k), lambda: amp_layers.LSTM(4)),
        (lambda **k: keras.layers.GRU(4, **k), lambda: amp_layers.GRU(4)),
        (lambda **k: keras.layers.MultiHeadAttention(2, 4, **k), lambda: amp_layers.MultiHeadAttention(2, 4)),
        (lambda **k: keras.layers.RMSNormalization(**k), lambda: amp_layers.RMSNormalization()),
    ]
    rng = np.random.default_rng(1)
    for make_stock, make_ours in pairs:
        stock, ours = make_stock(dtype="float32"), make_ours()
        _apply(stock, x)
        _apply(ours, x)
        assert [w.path.split("/")[-1] for w in stock.weights] == [w.path.split("/")[-1] for w in ours.weights]
        # Random weights (not the initialisers' ones and zeros) so a swapped weight shows.
        stock.set_weights([rng.standard_normal(w.shape).astype("float32") * 0.3 for w in stock.get_weights()])
        ours.set_weights(stock.get_weights())
        expected = np64(_apply(stock, x))
        got = np64(_apply(ours, x))
        scale = max(1.0, np.abs(expected).max())
        # Inputs and matmuls in the compute dtype: measured <= 1.1 u * scale (LSTM, MHA); a 10%
        # change of one kernel moves the output by >= 0.028, above this bound for both dtypes.
        np.testing.assert_allclose(got, expected, atol=4 * u(mixed_policy) * scale)

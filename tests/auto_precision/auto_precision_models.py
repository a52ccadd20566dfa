"""Small models with one deliberately sensitive layer, shared by the automatic-precision tests."""

import keras
import numpy as np


@keras.saving.register_keras_serializable(package="keras_amp_tests")
class Offset(keras.layers.Layer):
    """(x + 256) - 256: exact in float32, but bfloat16's spacing at 256 is 2, so x is lost."""

    def call(self, x):
        return (x + 256.0) - 256.0


@keras.saving.register_keras_serializable(package="keras_amp_tests")
class Amplify(keras.layers.Layer):
    """x * 300 * 300 / 90000: exact enough in float32; float16 overflows (65504) for |x| > 0.73.

    Every constant is finite in float16, so the first non-finite value is produced by the second
    multiplication inside this layer.
    """

    def call(self, x):
        return ((x * 300.0) * 300.0) / 90000.0


def regression_data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    w = rng.normal(size=(8, 1)).astype("float32")
    y = (np.maximum(x @ w, 0) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def sensitive_model(policy, sensitive=Offset, seed=0):
    """Dense -> sensitive layer -> Dense, built under `policy`, compiled with Adam + MSE."""
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="d1")(inp)
    h = sensitive(name="sensitive")(h)
    out = keras.layers.Dense(1, name="out")(h)
    model = keras.Model(inp, out, name="sensitive_model")
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


@keras.saving.register_keras_serializable(package="keras_amp_tests")
class SubclassedSensitive(keras.Model):
    """The same architecture as a subclassed model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(16, activation="relu", name="d1")
        self.sensitive = Offset(name="sensitive")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x):
        return self.out(self.sensitive(self.d1(x)))

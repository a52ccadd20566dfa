"""The dropout rule (`keras_amp.op_rules.dropout`): 16-bit keep masks from half the random words,
Keras's arithmetic on the kept values and the gradient, float32 inputs left to stock."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import op_rules
from keras_amp.op_rules import dropout as rule

P = ("mixed_bfloat16", "mixed_float16")
pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning")


def _x(shape, dtype, seed=0):
    return tf.constant(np.random.default_rng(seed).uniform(0.5, 2.0, shape), dtype)  # no zeros: y != 0 is the mask


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_probability_is_one_minus_rate_to_2_to_the_minus_17(rate):
    n = 1 << 20
    keep = rule.keep_mask(tf.constant([n]), rate, tf.constant([3, 4]))
    p = 1 - round(rate * 65536) / 65536
    assert abs(p - (1 - rate)) <= 2.0**-17
    kept = float(tf.reduce_mean(tf.cast(keep, tf.float64)))
    assert abs(kept - p) < 6 * math.sqrt(p * (1 - p) / n), (kept, p)  # 6 sigma of a binomial mean


@pytest.mark.parametrize("p", P)
def test_kept_values_and_gradient_are_kerass_arithmetic_through_the_mask(p):
    keras_amp.enable(p)
    dtype = keras.backend.standardize_dtype(keras.config.dtype_policy().compute_dtype)
    x, g = _x((64, 96), dtype), _x((64, 96), dtype, seed=1)
    rate = 0.3
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = keras.random.dropout(x, rate, seed=7)
    dx = tape.gradient(y, x, output_gradients=g)
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    kept = y.numpy() != 0
    assert 0.6 < kept.mean() < 0.8
    # Stock's arithmetic: x / (1 - rate) with 1 - rate computed in x's dtype.
    divisor = tf.constant(1, dtype) - tf.constant(rate, dtype)
    np.testing.assert_array_equal(y.numpy()[kept], (x / divisor).numpy()[kept])
    np.testing.assert_array_equal(dx.numpy(), np.where(kept, (g / divisor).numpy(), 0))
    # Against float64: the divisor's and the quotient's roundings, each a half-ulp.
    ulp = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    want = np.asarray(x.numpy(), np.float64) / (1 - rate)
    np.testing.assert_allclose(np.asarray(y.numpy(), np.float64)[kept], want[kept], rtol=2 * ulp, atol=0)


def test_the_rule_draws_half_the_random_words_of_stock():
    x = tf.TensorSpec((32, 256), tf.bfloat16)

    def random_words(fn):
        graph = tf.function(lambda x: fn(x, 0.1, seed=1)).get_concrete_function(x).graph
        return {op.type: int(np.prod(op.outputs[0].shape)) for op in graph.get_operations()
                if op.type.startswith("StatelessRandomUniform")}

    stock = random_words(keras.random.dropout)
    keras_amp.enable("mixed_bfloat16")
    ours = random_words(keras.random.dropout)
    assert stock == {"StatelessRandomUniformV2": 32 * 256}  # one 16-bit uniform number per element
    assert ours == {"StatelessRandomUniformFullIntV2": 32 * 256 // 2}  # one 32-bit word per two


def test_same_seed_same_mask_other_seed_other_mask_and_noise_shape_broadcasts():
    keras_amp.enable("mixed_bfloat16")
    x = _x((8, 16, 32), "bfloat16")
    a, b = (keras.random.dropout(x, 0.5, seed=11).numpy() != 0 for _ in range(2))
    c = keras.random.dropout(x, 0.5, seed=12).numpy() != 0
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.3
    shared = keras.random.dropout(x, 0.5, noise_shape=(8, 1, 32), seed=3).numpy() != 0
    assert (shared == shared[:, :1, :]).all() and 0.3 < shared.mean() < 0.7  # one decision per (batch, feature)
    layer = keras.layers.Dropout(0.5, seed=5)  # a seeded layer: the same masks from a fresh layer
    again = keras.layers.Dropout(0.5, seed=5)
    np.testing.assert_array_equal(layer(x, training=True).numpy(), again(x, training=True).numpy())
    np.testing.assert_array_equal(layer(x, training=False).numpy(), x.numpy())


def test_float32_inputs_and_edge_rates_are_stocks():
    x32 = _x((16, 16), "float32")
    stock = keras.random.dropout(x32, 0.25, seed=9).numpy()
    keras_amp.enable("mixed_bfloat16")
    assert op_rules.rule_installed("dropout")
    np.testing.assert_array_equal(keras.random.dropout(x32, 0.25, seed=9).numpy(), stock)
    x16 = _x((16, 16), "bfloat16")
    np.testing.assert_array_equal(keras.random.dropout(x16, 0.0).numpy(), x16.numpy())
    assert not keras.random.dropout(x16, 1.0).numpy().any()


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_model_with_dropout_trains_under_the_rule(jit_compile):
    keras_amp.enable("mixed_bfloat16")
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(4)])
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 32)).astype("float32")
    y = (x[:, :4].argmax(1)).astype("int32")
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, epochs=4, batch_size=32, verbose=0)
    after = model.evaluate(x, y, verbose=0)
    assert np.isfinite(after) and after < 0.7 * before, (before, after)

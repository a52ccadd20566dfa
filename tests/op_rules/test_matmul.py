"""keras_amp.op_rules.matmul: while the rules are installed, a layer with a Matmul16DTypePolicy multiplies
16-bit operands with float32 accumulation, one rounding and a float32 result; every other matmul is
the original, and without the rules the policy is plain float32."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from tests.helpers import UNIT_ROUNDOFF

pytestmark = [
    pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning"),
    pytest.mark.usefixtures("no_op_rules"),
]


def _round(x, dtype):
    """float64 values rounded to a 16-bit dtype, back as float64."""
    return np.asarray(tf.cast(tf.cast(tf.constant(x, tf.float64), dtype), tf.float64))


@pytest.mark.parametrize("p", ["mixed_bfloat16", "mixed_float16"])
def test_matmul16_policy_layer_matmuls_in_16_bits_with_a_float32_result(p):
    keras_amp.enable(p)
    low = p[len("mixed_"):]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 64)).astype("float32")
    kernel = rng.normal(size=(64, 16)).astype("float32")
    bias = rng.normal(size=16).astype("float32")
    fast = keras.layers.Dense(16, dtype=keras_amp.Matmul16DTypePolicy(p))
    plain = keras.layers.Dense(16, dtype="float32")
    for layer in (fast, plain):
        layer.build((None, 64))
        layer.set_weights([kernel, bias])
    assert fast.compute_dtype == "float32" and fast.kernel.dtype == "float32"
    # Reference: 16-bit operands, exact products and sum, one rounding to 16 bits, float32 bias.
    ref = _round(_round(x, low) @ _round(kernel, low), low) + bias.astype(np.float64)
    exact = x.astype(np.float64) @ kernel.astype(np.float64) + bias.astype(np.float64)
    tol = np.abs(ref).max() * 1e-6 + 1e-6
    for call in (fast, tf.function(fast)):  # eager and traced
        out = call(x)
        assert out.dtype == tf.float32
        # float32 accumulation may sit one 16-bit spacing away from the float64 sum's rounding.
        spacing = 2 * UNIT_ROUNDOFF[low] * np.abs(ref - bias)
        assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= spacing + tol)
    assert np.abs(np.asarray(fast(x), np.float64) - exact).max() > 1e-3  # guard: really 16-bit
    # Other layers' matmuls are the original (float32 here).
    np.testing.assert_allclose(np.asarray(plain(x), np.float64), exact, rtol=1e-5, atol=1e-4)
    # Without the rules the policy is plain float32.
    keras_amp.disable()
    np.testing.assert_allclose(np.asarray(fast(x), np.float64), exact, rtol=1e-5, atol=1e-4)


def _reversible_lm(tie, reverse_dtype=None):
    """Tokens -> embedding -> Dense -> the embedding's reverse projection, as keras-hub's LM heads."""
    keras.utils.set_random_seed(4)
    embedding = keras.layers.ReversibleEmbedding(40, 16, tie_weights=tie, reverse_dtype=reverse_dtype)
    tokens = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Dense(16, name="hidden")(embedding(tokens))
    model = keras.Model(tokens, embedding(hidden, reverse=True))
    weight = embedding.embeddings if tie else embedding.reverse_embeddings
    hidden_model = keras.Model(tokens, hidden)
    return model, hidden_model, weight


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("p", ["mixed_bfloat16", "mixed_float16"])
def test_a_weight_read_without_autocasting_is_multiplied_in_16_bits_with_float32_logits(p, tie):
    """Keras's Embedding turns autocasting off, so stock multiplies the reverse projection's float32
    weight by the upcast 16-bit hidden state; the rule multiplies both in 16 bits, float32 result."""
    tokens = np.random.RandomState(0).randint(0, 40, (3, 6)).astype("int32")
    low = p.split("_")[1]
    results = {}
    for who in ("stock", "keras_amp"):
        keras.config.set_dtype_policy(p) if who == "stock" else keras_amp.enable(p)
        model, hidden_model, weight = _reversible_lm(tie)
        out = tf.function(model)(tokens)
        hidden = np.asarray(tf.cast(hidden_model(tokens), tf.float64))
        w = np.asarray(tf.cast(weight.value, tf.float64))
        w = w.T if tie else w
        results[who] = (np.asarray(out, np.float64), hidden @ w, hidden @ _round(w, low), out.dtype)
        keras_amp.disable()
    stock, ours = results["stock"], results["keras_amp"]
    assert stock[3] == ours[3] == tf.float32  # Keras's output dtype is kept
    # Stock: the float32 weight (a float32 matmul: float32 rounding of each sum).
    np.testing.assert_allclose(stock[0], stock[1], rtol=0, atol=8 * UNIT_ROUNDOFF["float32"] * np.abs(stock[1]).max())
    # keras_amp: the weight rounded to 16 bits, the exact products summed in float32.
    np.testing.assert_allclose(ours[0], ours[2], rtol=0, atol=8 * UNIT_ROUNDOFF["float32"] * np.abs(ours[2]).max())
    # Guard: the two differ by the weight's 16-bit rounding, far above float32's.
    assert np.abs(ours[0] - ours[1]).max() > 100 * UNIT_ROUNDOFF["float32"] * np.abs(ours[1]).max()


def test_float32_requested_by_the_layer_and_autocast_layers_are_left_alone():
    keras_amp.enable("mixed_bfloat16")
    tokens = np.random.RandomState(0).randint(0, 40, (3, 6)).astype("int32")
    model, hidden_model, weight = _reversible_lm(False, reverse_dtype="float32")
    graph = tf.function(model).get_concrete_function(tf.TensorSpec((None, 6), tf.int32)).graph
    assert not [op for op in graph.get_operations() if op.type == "PartitionedCall"]  # no 16-bit rule call
    hidden = np.asarray(tf.cast(hidden_model(tokens), tf.float64))
    want = hidden @ np.asarray(weight.value, np.float64)
    np.testing.assert_allclose(np.asarray(model(tokens), np.float64), want, rtol=0,
                               atol=8 * UNIT_ROUNDOFF["float32"] * np.abs(want).max())
    dense = keras.layers.Dense(5)
    assert dense(np.ones((2, 16), "float32")).dtype == "bfloat16"  # autocast on: a stock 16-bit Dense

"""keras_amp's own code runs as written inside a user's tf.function, as Keras's does: AutoGraph converts
none of it (it leaves the `keras` package alone; converting ours cost about a second of tracing per
process, most of it `check_model`'s audit)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.autograph.impl import api as autograph_api  # the conversion entry point, spied on

import keras_amp

pytestmark = pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning")


@pytest.fixture
def converted(monkeypatch):
    """The modules of the functions AutoGraph converts while the test runs."""
    modules = []
    original = autograph_api._convert_actual

    def spy(entity, program_ctx):
        modules.append(f"{getattr(entity, '__module__', '?')}.{getattr(entity, '__qualname__', entity)}")
        return original(entity, program_ctx)

    monkeypatch.setattr(autograph_api, "_convert_actual", spy)
    return modules


def _transformer(vocabulary=32):
    tokens = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, 16)(tokens)
    h = h + keras.layers.MultiHeadAttention(2, 8)(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Dense(32, activation="gelu")(h)
    return keras.Model(tokens, keras.layers.Dense(vocabulary)(h))


def test_a_custom_loop_step_and_check_model_convert_no_keras_amp_code(converted):
    keras_amp.enable("mixed_float16")
    model = _transformer()
    optimizer = keras_amp.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = np.random.default_rng(0).integers(0, 32, (4, 8)).astype("int32")

    @tf.function  # AutoGraph on, as users write it
    def step(x):
        with tf.GradientTape() as tape:
            loss = loss_fn(x, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
        return loss

    assert np.isfinite(float(step(tf.constant(x))))
    assert optimizer.total_steps.numpy() == 1  # guard: the step ran the optimizer
    keras_amp.check_model(model, x=x[:2])  # the audit traces a forward and backward pass
    ours = [name for name in converted if name.startswith("keras_amp.")]
    assert not ours, ours
    assert any(name.endswith("step") for name in converted), converted  # guard: the spy sees conversions

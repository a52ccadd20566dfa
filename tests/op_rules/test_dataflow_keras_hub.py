"""The dataflow rules on the keras-hub 0.32 attention forms no name-based rule reached.

Falcon, GPT-NeoX and Phi3 (literal einsum), T5 (literal einsum, `ops.rsqrt` norm, `* -1e9` mask),
DeBERTaV3 (three score terms), Bloom (`ops.matmul`) and SegFormer's MiT encoder (`q @ k`), built
as keras-hub ships them from tiny configs with random weights. Under stock mixed_float16 a traced
step computes QK^T in float16 in each; under `keras_amp.enable()` + the recipe, none does. T5's
first float16 step is NaN in stock Keras and finite here. (The census, tests/corpus/, covers every
family under both policies.)
"""

import keras
import keras_hub
import numpy as np
import pytest

import keras_amp
from keras_amp.diagnostics import audit

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
VOCAB, SEQ, BATCH = 64, 8, 2
_RNG = np.random.RandomState(0)
TOKENS = _RNG.randint(1, VOCAB, size=(BATCH, SEQ)).astype("int32")
PADDING = np.ones((BATCH, SEQ), "int32")
PADDING[0, -2:] = 0  # a padded row: T5 turns it into its (1 - mask) * -1e9 bias
IMAGES = _RNG.normal(size=(BATCH, 32, 32, 3)).astype("float32")

BACKBONES = {
    "falcon": lambda: keras_hub.models.FalconBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_attention_heads=2, hidden_dim=16, intermediate_dim=32),
    "gpt_neo_x": lambda: keras_hub.models.GPTNeoXBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=16),
    "phi3": lambda: keras_hub.models.Phi3Backbone(
        vocabulary_size=VOCAB, num_layers=1, hidden_dim=16, intermediate_dim=32, num_query_heads=2,
        num_key_value_heads=1, max_sequence_length=16, pretraining_sequence_length=16),
    "t5": lambda: keras_hub.models.T5Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.0),
    "deberta_v3": lambda: keras_hub.models.DebertaV3Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.0,
        max_sequence_length=16, bucket_size=4),
    "bloom": lambda: keras_hub.models.BloomBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32),
    "mit": lambda: keras_hub.models.MiTBackbone(
        layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2], layerwise_sr_ratios=[2, 1],
        max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3], layerwise_strides=[4, 2],
        image_shape=(32, 32, 3), hidden_dims=[8, 16]),
}


def _inputs(family):
    if family == "mit":
        return IMAGES
    if family == "t5":
        return {"encoder_token_ids": TOKENS, "encoder_padding_mask": PADDING,
                "decoder_token_ids": TOKENS, "decoder_padding_mask": PADDING}
    return {"token_ids": TOKENS, "padding_mask": PADDING}


def _classifier(backbone):
    """The backbone with a float32 4-class head on its (pooled) last sequence output."""
    out = backbone.output
    if isinstance(out, dict):
        out = out.get("decoder_sequence_output", out.get("sequence_output"))
    if isinstance(out, (list, tuple)):
        out = out[-1]
    pooled = keras.layers.Flatten()(out) if len(out.shape) > 3 else keras.layers.GlobalAveragePooling1D()(out)
    return keras.Model(backbone.input, keras.layers.Dense(4, dtype="float32")(pooled))


def _low_scores(model, x):
    return [r for r in audit.audit_model(model, x).low_precision() if r.category == "attention"]


@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_stock_float16_scores_ours_float32(family):
    x = _inputs(family)
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    stock = _classifier(BACKBONES[family]())
    assert _low_scores(stock, x), "stock Keras was expected to compute QK^T in float16"
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
    keras_amp.enable("mixed_float16")
    keras.utils.set_random_seed(0)
    ours = keras_amp.apply_recipe(_classifier(BACKBONES[family]()), "transformer")
    report = audit.audit_model(ours, x)
    assert any(r.category == "attention" for r in report.records)  # guard: the scores were seen
    assert not report.low_precision(), str(report)


def _first_step(model, x):
    y = np.arange(BATCH) % 4
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras_amp.wrap(keras.optimizers.Adam(1e-3)), loss=loss)
    value = float(model.train_on_batch(x, y))
    return value, all(np.isfinite(w).all() for w in model.get_weights())


def test_t5_as_keras_hub_ships_it_trains_finite_in_float16_stock_gives_nan():
    x = _inputs("t5")
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    stock = _classifier(BACKBONES["t5"]())
    # Stock: the float16 -1e9 is -inf and 0 * -inf is NaN in every unpadded position's bias.
    predicted = stock(x, training=False).numpy()
    assert np.isnan(predicted).all()
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
    keras_amp.enable("mixed_float16")
    keras.utils.set_random_seed(0)
    ours = keras_amp.apply_recipe(_classifier(BACKBONES["t5"]()), "transformer")
    # Eager execution has no graph for the dataflow rules to read: predict traces.
    assert np.isfinite(ours.predict(x, verbose=0)).all()
    loss, weights_finite = _first_step(ours, x)
    assert np.isfinite(loss) and weights_finite
    assert float(ours.optimizer.overflow_count.numpy()) == 0  # nothing overflowed, nothing skipped

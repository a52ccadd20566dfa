"""The "tested on" corpus: every model small, random weights, no downloads.

Each `Case` builds a model whose output feeds a loss (a head on top of a backbone), and gives a
fixed batch. Builders take no arguments and build under whatever dtype policy is in force, so a
test calls them after `keras_amp.enable(...)` (or before, for the float32 reference).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import keras_hub
import numpy as np

BATCH = 4
IMAGE = (32, 32, 3)  # the smallest input keras.applications accepts
CLASSES = 4
VOCAB = 64
SEQ = 8


@dataclasses.dataclass(frozen=True)
class Case:
    """One corpus model.

    Args:
        name: String. Test id.
        recipe: String. The recipe applied to it.
        build: Callable. Returns the built model (outputs logits or probabilities).
        data: Callable. Returns `(x, y)`, one batch of `BATCH`.
        loss: Callable. Returns a fresh `keras.losses.Loss` for the model's output.
        policies: The policies it is tested under.
    """

    name: str
    recipe: str
    build: Callable[[], keras.Model]
    data: Callable[[], tuple[Any, Any]]
    loss: Callable[[], keras.losses.Loss]
    policies: tuple[str, ...] = ("mixed_float16", "mixed_bfloat16")


def _images():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (BATCH,) + IMAGE).astype("float32")
    return x, rng.integers(0, CLASSES, (BATCH,)).astype("int32")


def _tokens():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (BATCH, SEQ)).astype("int32")
    return tokens, np.roll(tokens, -1, axis=1)  # next-token targets


def _sparse_probs():
    return keras.losses.SparseCategoricalCrossentropy()


def _sparse_logits():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _application(cls, **kwargs):
    def build():
        return cls(weights=None, input_shape=IMAGE, classes=CLASSES, **kwargs)

    return build


# keras-hub backbones with a head, so there is a loss.


def _bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ, dropout=0.1,
    )
    tokens = keras.Input((SEQ,), dtype="int32", name="token_ids")
    outputs = backbone({
        "token_ids": tokens,
        "segment_ids": keras.ops.zeros_like(tokens),
        "padding_mask": keras.ops.ones_like(tokens),
    })
    logits = keras.layers.Dense(CLASSES, name="classifier")(outputs["pooled_output"])
    return keras.Model(tokens, logits, name="bert_classifier")


def _bert_data():
    tokens, _ = _tokens()
    return tokens, np.arange(BATCH, dtype="int32") % CLASSES


def _causal_lm(backbone):
    tokens = keras.Input((SEQ,), dtype="int32", name="token_ids")
    hidden = backbone({"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens)})
    logits = keras.layers.Dense(VOCAB, name="lm_head")(hidden)
    return keras.Model(tokens, logits, name=f"{backbone.name}_lm")


def _gpt2():
    return _causal_lm(keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ, dropout=0.1,
    ))


def _llama():
    return _causal_lm(keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
        intermediate_dim=32,
    ))


def _vit():
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
    )
    images = keras.Input((16, 16, 3), name="images")
    tokens = backbone(images)
    logits = keras.layers.Dense(CLASSES, name="classifier")(tokens[:, 0])  # the class token
    return keras.Model(images, logits, name="vit_classifier")


def _vit_data():
    rng = np.random.default_rng(0)
    return rng.uniform(-1, 1, (BATCH, 16, 16, 3)).astype("float32"), rng.integers(0, CLASSES, (BATCH,)).astype("int32")


# Written by hand.


@keras.saving.register_keras_serializable(package="keras_amp_corpus")
class TinyTransformer(keras.Model):
    """A subclassed Transformer LM: embedding, one pre-norm attention block, vocabulary head."""

    def __init__(self, vocabulary_size=VOCAB, hidden_dim=16, num_heads=2, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size, self.hidden_dim, self.num_heads = vocabulary_size, hidden_dim, num_heads
        self.embed = keras.layers.Embedding(vocabulary_size, hidden_dim, name="embed")
        self.norm_1 = keras.layers.LayerNormalization(name="norm_1")
        self.attention = keras.layers.MultiHeadAttention(num_heads, hidden_dim // num_heads, dropout=0.1, name="attention")
        self.norm_2 = keras.layers.LayerNormalization(name="norm_2")
        self.ffn_1 = keras.layers.Dense(2 * hidden_dim, activation="gelu", name="ffn_1")
        self.ffn_2 = keras.layers.Dense(hidden_dim, name="ffn_2")
        self.head = keras.layers.Dense(vocabulary_size, name="head")

    def call(self, tokens, training=False):
        h = self.embed(tokens)
        n = self.norm_1(h)
        h = h + self.attention(n, n, use_causal_mask=True, training=training)
        h = h + self.ffn_2(self.ffn_1(self.norm_2(h)))
        return self.head(h)

    def get_config(self):
        return {
            **super().get_config(),
            "vocabulary_size": self.vocabulary_size, "hidden_dim": self.hidden_dim, "num_heads": self.num_heads,
        }


def _subclassed_transformer():
    model = TinyTransformer(name="subclassed_transformer")
    model(np.zeros((1, SEQ), "int32"))
    return model


def _functional_transformer():
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, 16, name="embed")(tokens)
    a = keras.layers.MultiHeadAttention(2, 8, dropout=0.1, name="attention")(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="norm_1")(h + a)  # operator nodes, not Add layers
    f = keras.layers.Dense(16, name="ffn_2")(keras.layers.Dense(32, activation="relu", name="ffn_1")(h))
    h = keras.layers.LayerNormalization(name="norm_2")(h + f)
    logits = keras.layers.Dense(VOCAB, name="head")(h)
    return keras.Model(tokens, logits, name="functional_transformer")


def _bilstm_tagger():
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, 16, name="embed")(tokens)
    h = keras.layers.Bidirectional(keras.layers.LSTM(16, return_sequences=True), name="bilstm")(h)
    logits = keras.layers.Dense(CLASSES, name="tags")(h)
    return keras.Model(tokens, logits, name="bilstm_tagger")


def _tag_data():
    tokens, _ = _tokens()
    return tokens, (tokens % CLASSES).astype("int32")


def _imdb_bilstm():
    # keras.io/examples/nlp/bidirectional_lstm_imdb, scaled down: stacked Bidirectional LSTMs and
    # a sigmoid head.
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 16)(inputs)
    x = keras.layers.Bidirectional(keras.layers.LSTM(8, return_sequences=True))(x)
    x = keras.layers.Bidirectional(keras.layers.LSTM(8))(x)
    outputs = keras.layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(inputs, outputs)


def _imdb_data():
    tokens, _ = _tokens()
    return tokens, (tokens.sum(axis=1, keepdims=True) % 2).astype("float32")


def _binary_probs():
    return keras.losses.BinaryCrossentropy()


CHARS = 8


def _lstm_seq2seq():
    # keras.io/examples/nlp/lstm_seq2seq, scaled down: the encoder's returned [h, c] states are the
    # decoder LSTM's initial state; a softmax Dense over the characters.
    encoder_inputs = keras.Input(shape=(None, CHARS))
    encoder = keras.layers.LSTM(16, return_state=True)
    encoder_outputs, state_h, state_c = encoder(encoder_inputs)
    encoder_states = [state_h, state_c]
    decoder_inputs = keras.Input(shape=(None, CHARS))
    decoder_lstm = keras.layers.LSTM(16, return_sequences=True, return_state=True)
    decoder_outputs, _, _ = decoder_lstm(decoder_inputs, initial_state=encoder_states)
    decoder_dense = keras.layers.Dense(CHARS, activation="softmax")
    decoder_outputs = decoder_dense(decoder_outputs)
    return keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)


def _seq2seq_data():
    rng = np.random.default_rng(0)
    source, target = rng.integers(0, CHARS, (2, BATCH, SEQ))
    one_hot = np.eye(CHARS, dtype="float32")
    return [one_hot[source], one_hot[target]], one_hot[np.roll(target, -1, axis=1)]


def _categorical_probs():
    return keras.losses.CategoricalCrossentropy()


@keras.saving.register_keras_serializable(package="keras_amp_corpus")
class GRUTagger(keras.Model):
    """A subclassed tagger whose own code adds the GRU's output to its input (a residual)."""

    def __init__(self, vocabulary_size=VOCAB, hidden_dim=16, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size, self.hidden_dim = vocabulary_size, hidden_dim
        self.embed = keras.layers.Embedding(vocabulary_size, hidden_dim, name="embed")
        self.gru = keras.layers.GRU(hidden_dim, return_sequences=True, name="gru")
        self.tags = keras.layers.Dense(CLASSES, name="tags")

    def call(self, tokens):
        h = self.embed(tokens)
        return self.tags(h + self.gru(h))

    def get_config(self):
        return {**super().get_config(), "vocabulary_size": self.vocabulary_size, "hidden_dim": self.hidden_dim}


def _subclassed_gru_tagger():
    model = GRUTagger(name="subclassed_gru_tagger")
    model(np.zeros((1, SEQ), "int32"))
    return model


# One full-size application, under one policy: ConvNeXtTiny under float16 (a CNN whose LayerScale and
# LayerNormalization go through the .keras round trip, and fit with loss scaling). ResNet50V2 and
# EfficientNetV2B0 left the corpus for the census, which runs the same models at the same size under both
# policies (`census_models`: ResNet50, ResNet50V2, EfficientNetV2B0 and ConvNeXtTiny among them).
CASES = (
    Case("convnexttiny", "cnn", _application(keras.applications.ConvNeXtTiny), _images, _sparse_probs,
         ("mixed_float16",)),
    Case("bert", "transformer", _bert, _bert_data, _sparse_logits),
    Case("gpt2", "transformer", _gpt2, _tokens, _sparse_logits),
    Case("llama", "transformer", _llama, _tokens, _sparse_logits),
    Case("vit", "transformer", _vit, _vit_data, _sparse_logits),
    Case("subclassed_transformer", "transformer", _subclassed_transformer, _tokens, _sparse_logits),
    Case("functional_transformer", "transformer", _functional_transformer, _tokens, _sparse_logits),
    Case("bilstm_tagger", "rnn", _bilstm_tagger, _tag_data, _sparse_logits),
    Case("imdb_bilstm", "rnn", _imdb_bilstm, _imdb_data, _binary_probs),
    Case("lstm_seq2seq", "rnn", _lstm_seq2seq, _seq2seq_data, _categorical_probs),
    Case("subclassed_gru_tagger", "rnn", _subclassed_gru_tagger, _tag_data, _sparse_logits),
)

"""The examples' model families, built as functional models so `keras_amp.apply_recipe` can clone them.

    cnn          images: a ResNet (Conv2D stem, residual blocks with BatchNormalization, pooling).
                 text:   a causal 1-D ResNet over byte embeddings (dilated Conv1D, LayerNormalization).
    transformer  pre-norm Transformer blocks (causal self-attention for language modelling,
                 mean-pooled for classification) over byte and position embeddings.
    rnn          stacked LSTMs over byte embeddings.

Each ends in a plain `Dense` logits head named "logits", in the compute dtype: the float32
cross-entropy from logits makes that safe (check_model(model, loss=...) says so).
Built with stock Keras layers only: the recipe swaps in keras_amp's islands.
"""

from __future__ import annotations

import keras
from keras import layers

FAMILIES = ("cnn", "transformer", "rnn")


@keras.saving.register_keras_serializable(package="keras_amp_examples")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a `(batch, length, dim)` input."""

    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.length, input_shape[-1]), initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="embeddings")

    def call(self, inputs):
        # Read inside call: Keras autocasts the float32 variable to the compute dtype.
        return inputs + self.embeddings[None, : keras.ops.shape(inputs)[1]]

    def get_config(self):
        return {**super().get_config(), "length": self.length}


def _cnn_image(data, width: int, depth: int) -> keras.Model:
    inputs = keras.Input(data.input_shape, name="images")
    x = layers.Conv2D(width, 3, padding="same", use_bias=False, name="stem")(inputs)
    x = layers.BatchNormalization(name="stem_bn")(x)
    x = layers.Activation("relu", name="stem_relu")(x)
    for stage in range(depth):
        filters = width * 2**stage
        strides = 1 if stage == 0 else 2
        shortcut = x
        if strides != 1 or x.shape[-1] != filters:
            shortcut = layers.Conv2D(filters, 1, strides=strides, use_bias=False, name=f"s{stage}_proj")(x)
        y = layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False, name=f"s{stage}_conv1")(x)
        y = layers.BatchNormalization(name=f"s{stage}_bn1")(y)
        y = layers.Activation("relu", name=f"s{stage}_relu1")(y)
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"s{stage}_conv2")(y)
        y = layers.BatchNormalization(name=f"s{stage}_bn2")(y)
        x = layers.Activation("relu", name=f"s{stage}_relu2")(layers.Add(name=f"s{stage}_add")([shortcut, y]))
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, layers.Dense(data.num_classes, name="logits")(x), name="resnet")


def _cnn_text(data, width: int, depth: int) -> keras.Model:
    inputs = keras.Input(data.input_shape, dtype="int32", name="tokens")
    x = layers.Embedding(256, width, name="embed")(inputs)
    for block in range(depth):
        # Causal padding: position t sees only tokens <= t, so next-byte prediction is honest.
        y = layers.LayerNormalization(name=f"b{block}_norm")(x)
        y = layers.Conv1D(2 * width, 3, padding="causal", dilation_rate=2 ** (block % 4), activation="relu",
                          name=f"b{block}_conv")(y)
        y = layers.Conv1D(width, 1, name=f"b{block}_mix")(y)
        x = layers.Add(name=f"b{block}_add")([x, y])
    x = layers.LayerNormalization(name="final_norm")(x)
    if data.task == "classify":
        x = layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(inputs, layers.Dense(data.num_classes, name="logits")(x), name="causal_resnet")


def _transformer(data, width: int, depth: int, heads: int) -> keras.Model:
    inputs = keras.Input(data.input_shape, dtype="int32", name="tokens")
    x = layers.Embedding(256, width, name="embed")(inputs)
    x = PositionEmbedding(data.input_shape[0], name="positions")(x)
    causal = data.task == "lm"
    for block in range(depth):
        y = layers.LayerNormalization(name=f"b{block}_norm1")(x)
        y = layers.MultiHeadAttention(heads, width // heads, name=f"b{block}_attention")(
            y, y, use_causal_mask=causal)
        x = layers.Add(name=f"b{block}_add1")([x, y])
        y = layers.LayerNormalization(name=f"b{block}_norm2")(x)
        y = layers.Dense(4 * width, activation="gelu", name=f"b{block}_ffn_in")(y)
        y = layers.Dense(width, name=f"b{block}_ffn_out")(y)
        x = layers.Add(name=f"b{block}_add2")([x, y])
    x = layers.LayerNormalization(name="final_norm")(x)
    if not causal:
        x = layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(inputs, layers.Dense(data.num_classes, name="logits")(x), name="transformer")


def _rnn(data, width: int, depth: int) -> keras.Model:
    inputs = keras.Input(data.input_shape, dtype="int32", name="tokens")
    x = layers.Embedding(256, width, name="embed")(inputs)
    for block in range(depth):
        last = block == depth - 1
        x = layers.LSTM(width, return_sequences=data.task == "lm" or not last, name=f"lstm{block}")(x)
    return keras.Model(inputs, layers.Dense(data.num_classes, name="logits")(x), name="lstm")


def build(family: str, data, *, width: int, depth: int, heads: int = 4) -> keras.Model:
    """Builds `family` ("cnn", "transformer", "rnn") for `data` (a `common.data.Data`) under the global policy."""
    if family not in FAMILIES:
        raise ValueError(f"Unknown model `family`. Received: family={family!r}. Allowed: {', '.join(FAMILIES)}")
    if len(data.input_shape) != 1 and family != "cnn":
        raise ValueError(f"The {family} model needs a text data set. Received: dataset={data.name!r} "
                         f"(inputs {data.input_shape}). Allowed: --model=cnn for images")
    if family == "cnn":
        return (_cnn_text if len(data.input_shape) == 1 else _cnn_image)(data, width, depth)
    if family == "transformer":
        if width % heads:
            raise ValueError(f"`width` must be divisible by `heads`. Received: width={width}, heads={heads}")
        return _transformer(data, width, depth, heads)
    return _rnn(data, width, depth)

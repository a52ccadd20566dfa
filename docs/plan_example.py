"""Draws docs/plan.png: the "rnn" recipe's plan for a small language model (`make pictures`).

    python docs/plan_example.py [OUT_PNG]
"""

import sys

from keras_amp_console import import_tensorflow_quietly

import_tensorflow_quietly()  # the start-up banner filtered out

import keras  # noqa: E402

import keras_amp  # noqa: E402


def build() -> keras.Model:
    """Byte embedding, a causal convolution, self-attention, an LSTM and a softmax head."""
    inputs = keras.Input((64,), dtype="int32")
    x = keras.layers.Embedding(256, 64, name="embed")(inputs)
    x = keras.layers.Conv1D(64, 3, padding="causal", activation="relu", name="conv")(x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Add(name="residual")([x, keras.layers.MultiHeadAttention(4, 16, name="attention")(x, x)])
    x = keras.layers.LSTM(64, return_sequences=True, name="lstm")(x)
    x = keras.layers.Dense(256, name="logits")(x)
    return keras.Model(inputs, keras.layers.Softmax(name="probabilities")(x), name="small_lm")


if __name__ == "__main__":
    keras_amp.enable("mixed_bfloat16")
    out = sys.argv[1] if len(sys.argv) > 1 else "docs/plan.png"
    keras_amp.plot_precision_plan(build(), out, recipe="rnn")
    print(f"written to {out}")

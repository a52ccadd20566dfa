"""Quick start: `keras_amp.enable()`, a recipe, a wrapped optimizer, a check, on real text (offline).

    python examples/quickstart.py

Trains a small causal Conv1D model to predict the next byte of Python's own documentation
(`pydoc_data.topics`, which ships with Python) and prints what keras_amp chose and found.
For the float32 comparison, timing and memory, see `make demo` (examples/demo.py).
"""

from __future__ import annotations

from absl import app, flags

import common  # noqa: F401  (keeps TensorFlow's start-up banner off the output; see common/__init__.py)
from common.flags import parse as parse_flags

FLAGS = flags.FLAGS
flags.DEFINE_enum("policy", "auto", ["auto", "mixed_float16", "mixed_bfloat16", "float32"], "Precision policy.")
flags.DEFINE_integer("epochs", 2, "Training epochs.", lower_bound=1)
flags.DEFINE_integer("steps_per_epoch", 50, "Steps per epoch.", lower_bound=1)
flags.DEFINE_integer("width", 256, "Conv1D channels.", lower_bound=1)


def main(argv):
    del argv
    import keras
    import numpy as np
    from pydoc_data import topics

    import keras_amp

    text = np.frombuffer("".join(topics.topics.values()).encode(), np.uint8).astype("int32")
    windows = text[: len(text) // 65 * 65].reshape(-1, 65)  # 64 bytes in, the next 64 out
    x, y = windows[:, :-1], windows[:, 1:]

    config = keras_amp.enable(FLAGS.policy)  # "auto": mixed_bfloat16 / mixed_float16 / float32 by hardware
    print(f"policy {config.policy}: {config.reason}")
    model = keras.Sequential([
        keras.Input((64,), dtype="int32"),
        keras.layers.Embedding(256, 64),
        keras.layers.Conv1D(FLAGS.width, 5, padding="causal", activation="relu"),
        keras.layers.Conv1D(FLAGS.width, 5, padding="causal", dilation_rate=4, activation="relu"),
        keras.layers.Dense(256),  # logits
    ])
    model = keras_amp.apply_recipe(model, "cnn")  # float32 where 16 bits is unsafe (first/last layers)
    model.compile(optimizer=keras_amp.wrap(keras.optimizers.Adam(2e-3)),  # loss scaling under float16 only
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=64, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch,
                        callbacks=[keras_amp.callbacks.LossScaleMonitor()], verbose=2)
    print(keras_amp.check_model(model, x[:8]))  # audits the ops on real inputs (default: a batch of ones)
    print(f"final loss {history.history['loss'][-1]:.3f}, accuracy {history.history['accuracy'][-1]:.3f}")
    keras_amp.disable()


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

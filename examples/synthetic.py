"""The examples' offline task: a synthetic, learnable image classification problem and a small CNN."""

from __future__ import annotations

NUM_CLASSES = 10
IMAGE = 24


def make_dataset(batch_size: int, seed: int):
    """Each class is a bright 6x6 patch at its own position under Gaussian noise."""
    import tensorflow as tf

    positions = tf.constant([(r, c) for r in (1, 7, 13, 18) for c in (1, 7, 13, 18)][:NUM_CLASSES], tf.int32)

    def sample(index):
        rng = tf.random.stateless_normal
        label = tf.cast(tf.math.floormod(index, NUM_CLASSES), tf.int32)
        noise = rng((IMAGE, IMAGE, 1), seed=tf.stack([tf.cast(seed, tf.int64), index]))
        r, c = positions[label][0], positions[label][1]
        patch = tf.pad(tf.ones((6, 6, 1)), [[r, IMAGE - 6 - r], [c, IMAGE - 6 - c], [0, 0]])
        return noise + 1.5 * patch, label

    return (
        tf.data.Dataset.range(batch_size * 50)
        .map(sample, num_parallel_calls=tf.data.AUTOTUNE)
        .cache()
        .shuffle(batch_size * 50, seed=seed)
        .repeat()
        .batch(batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


def build_model():
    import keras

    return keras.Sequential(
        [
            keras.Input((IMAGE, IMAGE, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            # The logits head stays float32 so the softmax/loss never see float16.
            keras.layers.Dense(NUM_CLASSES, dtype="float32"),
        ]
    )

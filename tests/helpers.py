"""Shared test helpers: policies, unit roundoff, float64 references. Import these; conftest files
hold fixtures only."""

import keras
import numpy as np
import tensorflow as tf

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
MIXED = ["mixed_float16", "mixed_bfloat16"]

# Unit roundoff (half the spacing at 1) of each compute dtype.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def compute_dtype(policy_name):
    """The compute dtype of a Keras policy name."""
    return keras.dtype_policies.get(policy_name).compute_dtype


def u(policy_name):
    """Unit roundoff of the policy's compute dtype."""
    return UNIT_ROUNDOFF[compute_dtype(policy_name)]


def np64(x):
    """A tensor (any float dtype) as a float64 NumPy array, through float32 (exact for 16-bit floats)."""
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")), np.float64)


def sigmoid(x):
    """Float64 reference."""
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    """Float64 reference, max-shifted."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class MyNorm(keras.layers.Layer):
    """Named like a normalisation, computes none."""

    def call(self, x):
        return x * 2.0


class Scaler(keras.layers.Layer):
    """An innocent name over an RMS normalisation in raw TensorFlow, which no op rule reaches."""

    def call(self, x):
        return x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + 1e-6)

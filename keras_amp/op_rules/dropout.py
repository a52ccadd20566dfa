"""16-bit dropout masks from half the random words: the dropout rule.

Keras's TensorFlow dropout (`tf.nn.experimental.stateless_dropout`) draws one uniform number per
element in the input's dtype, from one 32-bit Philox word each, and keeps an element when the
number is >= `rate`. For a 16-bit input the number carries 8 (bfloat16) or 11 (float16) bits, so
the 32-bit word is mostly thrown away, and the random numbers are the largest single cost of a
small Transformer's step after its matmuls (BUILD_NOTES, "Where a training step's time goes").

The rule draws one 32-bit word per two elements and reads it as two 16-bit integers `d`; an
element is kept when `d >= round(rate * 65536)`. So the keep probability is `rate` to within
2^-17, closer than stock's, whose 16-bit uniform numbers round `rate` to their own grid. The kept
values are Keras's arithmetic, `x / (1 - rate)` in the input's dtype, and the gradient is the
upstream gradient through the same mask and the same division: the same numbers as stock for the
same mask. The mask is kept for the backward pass (one byte per element, as stock's `SelectV2`
keeps it). The masks are a different random stream from stock's for the same seed, still
deterministic per seed. Float32 inputs, `noise_shape` given as a tensor, and a `rate` that is
not a Python number go to the original.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from keras_amp import _compat
from keras_amp.custom_gradient import custom_gradient
from keras_amp.dtypes import LOW_PRECISION

TF_RANDOM = "keras.src.backend.tensorflow.random"
DROPOUT = f"{TF_RANDOM}.dropout"
# Keras's own seed and noise-shape handling, so `seed=` means what it means to Keras.
RELIED_ON = (f"{TF_RANDOM}._cast_seed", f"{TF_RANDOM}._get_concrete_noise_shape",
             "keras.src.random.seed_generator.draw_seed")
_DRAWS_PER_WORD = 2  # 16-bit draws from one 32-bit Philox word
_LEVELS = 1 << 16


def keep_mask(shape: Any, rate: float, seed: Any) -> tf.Tensor:
    """Boolean mask of `shape`, each element True with probability `1 - round(rate * 2^16) / 2^16`,
    from `ceil(n / 2)` stateless 32-bit Philox words for `seed` (a [2] int tensor)."""
    n = tf.reduce_prod(shape)
    words = tf.random.stateless_uniform([(n + _DRAWS_PER_WORD - 1) // _DRAWS_PER_WORD], seed,
                                        minval=None, maxval=None, dtype=tf.uint32)
    draws = tf.reshape(tf.bitcast(words, tf.uint16), [-1])[:n]
    threshold = tf.constant(min(round(rate * _LEVELS), _LEVELS - 1), tf.uint16)
    return tf.reshape(draws >= threshold, shape)


def packed_dropout(original: Callable) -> Callable:
    """Replaces the TF backend's `dropout` for 16-bit inputs (see the module docstring)."""
    cast_seed = _compat.original(RELIED_ON[0])
    concrete_noise_shape = _compat.original(RELIED_ON[1])
    draw_seed = _compat.original(RELIED_ON[2])

    def dropout(inputs, rate, noise_shape=None, seed=None):
        x = tf.convert_to_tensor(inputs)
        if (x.dtype.name not in LOW_PRECISION or not isinstance(rate, (int, float)) or isinstance(rate, bool)
                or not 0.0 < rate < 1.0 or isinstance(noise_shape, (tf.Tensor, tf.Variable))):
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        keep = keep_mask(concrete_noise_shape(x, noise_shape), float(rate), cast_seed(draw_seed(seed)))
        # Keras's `x / (1 - rate)` with `1 - rate` computed in x's dtype, as stock does.
        divisor = tf.subtract(tf.constant(1, x.dtype), tf.constant(float(rate), x.dtype))
        zero = tf.zeros([], x.dtype)

        @custom_gradient
        def masked(x):
            def grad(upstream):
                return tf.where(keep, upstream / divisor, zero)

            return tf.where(keep, x / divisor, zero), grad

        return masked(x)

    dropout.__name__ = dropout.__qualname__ = original.__name__
    return dropout

"""Normalisation layers whose statistics and normalisation are float32 on every path.

Each subclasses the Keras layer of the same name (same weights, same config) and
differs only in dtype handling, written against Keras 3.15.1:

- `LayerNormalization` and `GroupNormalization`: stock already has
  `autocast=False` and upcasts internally; ours casts explicitly so the float32
  contract does not depend on those internals.
- `BatchNormalization`: stock has layer-level autocast, so float32 inputs are
  rounded to float16/bfloat16 before its internal upcast (values above 65504
  become inf under `mixed_float16`; bfloat16 keeps 8 bits of mantissa).
- `RMSNormalization`: same input rounding as `BatchNormalization`, and its
  `scale` is read in the compute dtype.
"""

import keras
from keras import ops

from keras_amp.layers.float32 import float32_value, to_float32

# Shared why-comment for the four classes below: inputs are cast to float32 and
# `autocast=False`, because the mean/variance of activations near 1e4 need
# squares near 1e8 (float16 max is 65504) and bfloat16's 8-bit mantissa would
# round x - mean to nothing; the result is cast to the compute dtype by `call`.


class _NoAutocast:
    """Mixin: `autocast=False`, so the float32 inputs each `call` casts to are not rounded first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.autocast = False


@keras.saving.register_keras_serializable(package="keras_amp")
class LayerNormalization(_NoAutocast, keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` with float32 statistics under every policy.

    Takes the same arguments as `keras.layers.LayerNormalization`. Inputs are
    cast to float32, mean, variance and the affine transform are float32
    (`gamma`/`beta` are read as float32), and the output is in the layer's
    compute dtype.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> y = keras_amp.layers.LayerNormalization()(np.full((2, 8), 1e4) + np.arange(8))
    """

    def call(self, inputs):
        return super().call(to_float32(inputs))


@keras.saving.register_keras_serializable(package="keras_amp")
class BatchNormalization(_NoAutocast, keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` with float32 statistics under every policy.

    Takes the same arguments as `keras.layers.BatchNormalization`. Unlike the
    stock layer, inputs are not autocast to float16/bfloat16 before the
    layer's internal upcast: batch moments (masked or not), moving statistics
    and the normalisation are float32 in training and inference; the output
    is in the compute dtype.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> bn = keras_amp.layers.BatchNormalization()
    >>> y = bn(np.full((4, 8), 7e4) + np.arange(4)[:, None], training=True)
    """

    def call(self, inputs, training=None, mask=None):
        return super().call(to_float32(inputs), training=training, mask=mask)


@keras.saving.register_keras_serializable(package="keras_amp")
class GroupNormalization(_NoAutocast, keras.layers.GroupNormalization):
    """`keras.layers.GroupNormalization` with float32 statistics under every policy.

    Takes the same arguments as `keras.layers.GroupNormalization`; group
    moments and the affine transform are float32, the output is in the
    compute dtype.

    Example:

    >>> keras.config.set_dtype_policy("mixed_bfloat16")
    >>> y = keras_amp.layers.GroupNormalization(groups=2)(np.ones((2, 4, 8)))
    """

    def call(self, inputs):
        return super().call(to_float32(inputs))


@keras.saving.register_keras_serializable(package="keras_amp")
class RMSNormalization(_NoAutocast, keras.layers.RMSNormalization):
    """`keras.layers.RMSNormalization` with float32 statistics under every policy.

    Takes the same arguments as `keras.layers.RMSNormalization`. Inputs and
    `scale` are float32, `x * rsqrt(mean(x**2) + epsilon) * scale` is computed
    in float32 and the output is in the compute dtype.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> y = keras_amp.layers.RMSNormalization()(np.full((2, 8), 7e4))
    """

    def call(self, x):
        # Stock reads `scale` autocast to the compute dtype; read it as float32.
        outputs = ops.rms_normalization(
            to_float32(x),
            scale=float32_value(self.scale),
            axis=self.axis,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

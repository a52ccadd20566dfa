"""Normalisation layers whose statistics and normalisation are float32 on every path.

Each subclasses the Keras layer of the same name (same weights, same config) and
differs only in dtype handling and in checking its arguments at construction:

- `LayerNormalization` and `GroupNormalization`: stock already has
  `autocast=False` and upcasts floating inputs internally; ours casts explicitly,
  integer inputs included, so the float32 contract does not depend on those internals.
- `BatchNormalization`: stock has layer-level autocast, so float32 inputs are
  rounded to float16/bfloat16 before its internal upcast (values above 65504
  become inf under `mixed_float16`; bfloat16 keeps 8 bits of mantissa).
- `RMSNormalization`: same input rounding as `BatchNormalization`, and its
  `scale` is read in the compute dtype.
"""

import keras
from keras import ops

from keras_amp import model_graph, validation
from keras_amp.layers import arguments
from keras_amp.numerics.islands import float32_variables

# Shared why-comment for the four classes below: inputs are cast to float32 (integer ones
# too: stock computes their mean in integer arithmetic), `gamma`/`beta`/`scale` are read as
# float32 (`float32_variables`, also when called outside a model) and `autocast=False`, because the
# mean/variance of activations near 1e4 need squares near 1e8 (float16 max is 65504) and
# bfloat16's 8-bit mantissa would round x - mean to nothing; the result is cast to the
# compute dtype.

_COMMON_CHECKS = {
    "epsilon": arguments.check_epsilon,
    "center": validation.check_bool,
    "scale": validation.check_bool,
}


class _Float32Normalization(model_graph.Float32Island, arguments.CheckedArguments):
    """Mixin: arguments checked at construction; `autocast=False`, so the float32 inputs each
    `call` casts to are not rounded first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.autocast = False


def _float32(x):
    return ops.cast(x, "float32")


@keras.saving.register_keras_serializable(package="keras_amp")
class LayerNormalization(_Float32Normalization, keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` with float32 statistics under every policy.

    Takes the same arguments as `keras.layers.LayerNormalization`. Inputs (integer
    ones included) are cast to float32, mean, variance and the affine transform are
    float32 (`gamma`/`beta` are read as float32), and the output is in the layer's
    compute dtype. `axis`, `epsilon`, `center`, `scale` and `rms_scaling` are checked
    when the layer is created.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> y = keras_amp.layers.LayerNormalization()(np.full((2, 8), 1e4) + np.arange(8))
    """

    STOCK = keras.layers.LayerNormalization
    ARGUMENT_CHECKS = {
        **_COMMON_CHECKS,
        # Stock refuses a non-int, non-sequence axis itself (TypeError); the items of a list are ours.
        "axis": arguments.check_axis_items,
        "rms_scaling": validation.check_bool,
    }

    def call(self, inputs):
        with float32_variables():
            return super().call(_float32(inputs))


@keras.saving.register_keras_serializable(package="keras_amp")
class BatchNormalization(_Float32Normalization, keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` with float32 statistics under every policy.

    Takes the same arguments as `keras.layers.BatchNormalization`. Unlike the
    stock layer, inputs are not autocast to float16/bfloat16 before the
    layer's internal upcast: batch moments (masked or not), moving statistics
    and the normalisation are float32 in training and inference; the output
    is in the compute dtype. `axis`, `momentum` (in [0, 1]), `epsilon`, `center`,
    `scale`, `synchronized` and `renorm` are checked when the layer is created.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> bn = keras_amp.layers.BatchNormalization()
    >>> y = bn(np.full((4, 8), 7e4) + np.arange(4)[:, None], training=True)
    """

    STOCK = keras.layers.BatchNormalization
    ARGUMENT_CHECKS = {
        **_COMMON_CHECKS,
        "axis": validation.check_int,  # stock takes one axis
        "momentum": arguments.check_fraction,
        "synchronized": validation.check_bool,
        "renorm": validation.check_bool,
    }

    def call(self, inputs, training=None, mask=None):
        with float32_variables():
            return super().call(_float32(inputs), training=training, mask=mask)


@keras.saving.register_keras_serializable(package="keras_amp")
class GroupNormalization(_Float32Normalization, keras.layers.GroupNormalization):
    """`keras.layers.GroupNormalization` with float32 statistics under every policy.

    Takes the same arguments as `keras.layers.GroupNormalization`; group
    moments and the affine transform are float32, the output is in the
    compute dtype. `axis`, `epsilon`, `center` and `scale` are checked when the
    layer is created (stock checks `groups` there, and against the channels at build).

    Example:

    >>> keras.config.set_dtype_policy("mixed_bfloat16")
    >>> y = keras_amp.layers.GroupNormalization(groups=2)(np.ones((2, 4, 8)))
    """

    STOCK = keras.layers.GroupNormalization
    ARGUMENT_CHECKS = {
        **_COMMON_CHECKS,
        "axis": validation.check_int,  # stock takes one axis
        # `groups` is checked by stock at construction already.
    }

    def call(self, inputs):
        with float32_variables():
            return super().call(_float32(inputs))


@keras.saving.register_keras_serializable(package="keras_amp")
class RMSNormalization(_Float32Normalization, keras.layers.RMSNormalization):
    """`keras.layers.RMSNormalization` with float32 statistics under every policy.

    Takes the same arguments as `keras.layers.RMSNormalization`. Inputs (integer
    ones included) and `scale` are float32, `x * rsqrt(mean(x**2) + epsilon) * scale`
    is computed in float32 and the output is in the compute dtype. `axis` and
    `epsilon` are checked when the layer is created.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> y = keras_amp.layers.RMSNormalization()(np.full((2, 8), 7e4))
    """

    STOCK = keras.layers.RMSNormalization
    ARGUMENT_CHECKS = {"axis": arguments.check_axis, "epsilon": arguments.check_epsilon}

    def call(self, x):
        # Stock reads `scale` autocast to the compute dtype; read it as float32.
        with float32_variables():
            outputs = ops.rms_normalization(
                _float32(x), scale=_float32(self.scale), axis=self.axis, epsilon=self.epsilon
            )
        return ops.cast(outputs, self.compute_dtype)

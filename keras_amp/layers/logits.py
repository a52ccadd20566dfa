"""`Logits`: an output projection with float32 logits at the compute dtype's matmul speed.

Written against Keras 3.15.1 / TensorFlow 2.21. A vocabulary head is often the largest matmul of
a language model. Computing it in float32 (`OutputHead`) costs about as much as the rest of a
small Transformer's step on a bfloat16 CPU; computing it in the compute dtype rounds every logit
to 8 (bfloat16) or 11 (float16) bits before the float32 loss, and float16 logits can overflow.

The matmul is `keras_amp.numerics.logits_matmul.float32_logits`: 16-bit operands, float32
accumulation and result.
"""

import keras
from keras import ops

from keras_amp.dtypes import LOW_PRECISION
from keras_amp.layers import arguments
from keras_amp.numerics.islands import float32_value
from keras_amp.numerics.logits_matmul import float32_logits

# Keras version the `call` override below was written against.
KERAS_VERSION = "3.15.1"


@keras.saving.register_keras_serializable(package="keras_amp")
class Logits(keras.layers.Dense):
    """A `Dense` output layer whose result is float32 while its matmul runs in 16 bits.

    Under a mixed policy the kernel and inputs are in the compute dtype (float16/bfloat16), the
    matmul accumulates in float32 and returns float32 (see `float32_logits`); the float32 bias
    and the activation (e.g. softmax) are applied in float32. The output is float32, so the
    loss sees unrounded logits. Under a float32 policy, with LoRA or quantization, it is a plain
    `Dense`. Same arguments and weights as `keras.layers.Dense`, so stock checkpoints load.

    Args:
        units: Positive integer, dimensionality of the output space (e.g. the vocabulary).
        activation: Activation function to use, applied in float32. Defaults to `None` (logits).
        **kwargs: Any other `keras.layers.Dense` argument (`use_bias`, initializers,
            regularizers, constraints, `dtype`, `name`).

    Example:

    >>> keras.config.set_dtype_policy("mixed_bfloat16")
    >>> head = keras_amp.layers.Logits(2048, name="lm_head")
    >>> head(np.ones((2, 8, 64))).dtype
    tf.float32
    """

    def __init__(self, units, activation=None, **kwargs):
        # `units` is stock Dense's own check (at construction, naming it); the activation is
        # checked here, where stock's message names no argument.
        super().__init__(units, activation=arguments.check_activation("activation", activation), **kwargs)

    def _float32_output(self):
        return (
            self.compute_dtype in LOW_PRECISION
            and not self.lora_enabled
            and self.quantization_mode is None
        )

    def call(self, inputs, training=None):
        if not self._float32_output():
            return super().call(inputs, training=training)
        x = float32_logits(inputs, ops.cast(self.kernel, self.compute_dtype))
        if self.bias is not None:
            # Float32 island: the bias is added to the float32 logits without a 16-bit rounding.
            x = ops.add(x, float32_value(self.bias))
        if self.activation is not None:
            x = self.activation(x)
        return x

    def compute_output_spec(self, inputs, *args, **kwargs):
        dtype = "float32" if self._float32_output() else self.compute_dtype
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype=dtype)

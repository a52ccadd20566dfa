"""`Logits`: an output projection with float32 logits at the compute dtype's matmul speed.

Written against Keras 3.15.1 / TensorFlow 2.21. A vocabulary head is often the largest matmul of
a language model. Computing it in float32 (`OutputHead`) costs about as much as the rest of a
small Transformer's step on a bfloat16 CPU; computing it in the compute dtype rounds every logit
to 8 (bfloat16) or 11 (float16) bits before the float32 loss, and float16 logits can overflow.

`float32_logits` multiplies the 16-bit inputs and the 16-bit kernel with float32 accumulation and
a float32 result: the products of two 16-bit numbers are exact in float32, so the logits equal
those of a float32 matmul of the same 16-bit operands, and nothing is rounded to 16 bits after
the sum. TensorFlow 2.21 has no CPU kernel for a 16-bit x 16-bit -> float32 matmul
(`BatchMatMulV3` with `Tout=float32` has GPU kernels only), but XLA compiles one on both devices
(`tf.linalg.matmul(..., output_type=tf.float32)` under `jit_compile=True`; on this AMX CPU it
runs at bfloat16 speed). The forward matmul runs that way; the two gradient matmuls run in the
compute dtype, as in a stock Dense.
"""

import keras
import tensorflow as tf
from keras import ops

from keras_amp.custom_gradient import custom_gradient
from keras_amp.dtypes import LOW_PRECISION
from keras_amp.layers import arguments
from keras_amp.numerics.islands import float32_value

# Keras version the `call` override below was written against.
KERAS_VERSION = "3.15.1"


@tf.function(jit_compile=True, reduce_retracing=True)
def _matmul_float32_out(a, b):
    """a @ b for 16-bit a, b: float32 accumulation and result (XLA, CPU and GPU)."""
    return tf.linalg.matmul(a, b, output_type=tf.float32)


def float32_logits(x, kernel):
    """`x @ kernel` (x of any rank >= 2) for 16-bit `x` and `kernel`, with a float32 result.

    Gradients: d(x) = g @ kernel^T and d(kernel) = x^T @ g run in the compute dtype, as in the
    stock layer (an XLA float32-output d(kernel) measured 1.28x the CPU time of the whole
    head's step on this CPU: the transposed operand is slow there).
    """
    low = kernel.dtype

    @custom_gradient
    def matmul(x, kernel):
        shape = tf.shape(x)
        units = tf.shape(kernel)[-1]
        x2d = tf.reshape(x, [-1, shape[-1]])
        # stop_gradient: the gradient is `grad` below; without it a tape would also build TF's
        # own gradient of the compiled function (BatchMatMulV3's, which fails for float16).
        out = _matmul_float32_out(tf.stop_gradient(x2d), tf.stop_gradient(kernel))
        out = tf.reshape(out, tf.concat([shape[:-1], [units]], 0))

        def grad(upstream):
            g = tf.reshape(tf.cast(upstream, low), [-1, units])
            d_x = tf.reshape(tf.matmul(g, kernel, transpose_b=True), shape)
            d_kernel = tf.matmul(x2d, g, transpose_a=True)
            return d_x, d_kernel

        return out, grad

    return matmul(ops.cast(x, low), kernel)


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

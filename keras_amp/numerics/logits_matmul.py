"""A 16-bit x 16-bit matmul with float32 accumulation and a float32 result, for logits.

The products of two 16-bit numbers are exact in float32, so the result equals a float32 matmul of
the same 16-bit operands, and nothing is rounded to 16 bits after the sum. TensorFlow 2.21 has no
CPU kernel for a 16-bit x 16-bit -> float32 matmul (`BatchMatMulV3` with `Tout=float32` has GPU
kernels only), but XLA compiles one on both devices (`tf.linalg.matmul(..., output_type=tf.float32)`
under `jit_compile=True`; on an AMX CPU it runs at bfloat16 speed). The forward matmul runs that
way; the two gradient matmuls run in the 16-bit dtype, as in a stock Dense.

Used by `keras_amp.layers.Logits` and by the matmul rule (`keras_amp.op_rules.matmul`) for a
16-bit layer's weight that Keras reads without autocasting.
"""

import tensorflow as tf
from keras import ops

from keras_amp.custom_gradient import custom_gradient


@tf.function(jit_compile=True, reduce_retracing=True, autograph=False)
def _matmul_float32_out(a, b):
    """a @ b for 16-bit a, b: float32 accumulation and result (XLA, CPU and GPU)."""
    return tf.linalg.matmul(a, b, output_type=tf.float32)


def float32_logits(x, kernel):
    """`x @ kernel` (x of any rank >= 2) for 16-bit `x` and `kernel`, with a float32 result.

    Gradients: d(x) = g @ kernel^T and d(kernel) = x^T @ g run in the 16-bit dtype, as in the
    stock layer (a float32-output d(kernel) through XLA was slower on the CPUs measured: XLA's
    CPU dot is slow with the transposed operand).
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

"""keras_amp.numerics.logits_matmul: 16-bit operands, float32 accumulation and result."""

import numpy as np
import pytest
import tensorflow as tf

from keras_amp.numerics.logits_matmul import float32_logits
from tests.helpers import matmul_roundoff, np64


def test_float32_logits_any_rank():
    x = tf.cast(tf.reshape(tf.range(24, dtype=tf.float32), (2, 3, 4)) / 7.0, tf.bfloat16)
    kernel = tf.cast(tf.reshape(tf.range(8, dtype=tf.float32), (4, 2)) / 3.0, tf.bfloat16)
    y = float32_logits(x, kernel)
    assert y.shape == (2, 3, 2) and y.dtype == tf.float32
    np.testing.assert_allclose(np64(y), np64(x) @ np64(kernel), rtol=1e-6)


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_float32_logits_gradients_are_the_16bit_products(dtype):
    rng = np.random.default_rng(3)
    x = tf.cast(rng.standard_normal((4, 6, 16)), dtype)
    kernel = tf.cast(rng.standard_normal((16, 9)), dtype)
    upstream = tf.constant(rng.standard_normal((4, 6, 9)), tf.float32)

    @tf.function
    def grads(x, kernel):
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = float32_logits(x, kernel)
        return tape.gradient(y, [x, kernel], output_gradients=upstream)

    d_x, d_kernel = grads(x, kernel)
    g = np64(tf.cast(upstream, dtype))  # the upstream gradient enters the 16-bit matmuls rounded
    assert d_x.dtype == dtype and d_kernel.dtype == dtype
    ulp = matmul_roundoff(dtype)  # one rounding of each 16-bit result by the matmul kernel
    ref_x, ref_k = g @ np64(kernel).T, np.einsum("btk,btu->ku", np64(x), g)
    for got, ref in ((d_x, ref_x), (d_kernel, ref_k)):  # float32 sums of exact products, rounded once
        np.testing.assert_allclose(np64(got), ref, rtol=ulp, atol=ulp * 2.0 ** -4 * np.abs(ref).max())

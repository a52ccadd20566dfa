"""Attention's products of two 16-bit activations from float32 kernels where the CPU has no 16-bit ones.

Where `islands.float32_kernels` holds (Eigen's 16-bit batched matmuls: bfloat16 without oneDNN truncates
its sums, float16 without float16 instructions is slower than float32), the value product and the two
gradient products of the scores (MultiHeadAttention, `ops.dot_product_attention`, and every score
matmul the dataflow rule rebuilds) are float32 kernels' on exact upcasts, each rounded once.
`hardware.emulated` is set here, so both paths run on any machine.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import hardware
from keras_amp.numerics import attention
from tests.helpers import UNIT_ROUNDOFF, live_ops, np64

EQUATION = "acbe,aecd->abcd"  # MultiHeadAttention's value product: (B, N, T, S) x (B, S, N, H)


def _batched_kernels(graph):
    """Output dtypes of the batched matmuls and einsums the outputs of `graph` depend on, outside the
    XLA computations (the scores' compiled dot is float32 on any device)."""
    return {op.outputs[0].dtype.name for op in live_ops(graph)
            if op.type in ("BatchMatMulV2", "BatchMatMulV3", "Einsum")
            and not op.graph.name.startswith(("_probabilities_compiled", "_scores_float32_out"))}


def _once(value, dtype):
    """A float64 array rounded once to `dtype` (through float32, exact for these sums' purposes)."""
    return np64(tf.cast(tf.constant(value, tf.float32), dtype))


def _check(got, exact, dtype, emulated):
    u = UNIT_ROUNDOFF[dtype]
    tolerance = (2 if emulated else 4) * u * np.abs(exact) + 1e-3 * np.abs(exact).max()
    assert np.all(np.abs(np64(got) - exact) <= tolerance)
    if emulated:  # rounded once: equal to the float64 sum rounded to the 16-bit dtype
        assert np.mean(np64(got) == _once(exact, dtype)) > 0.99, np.mean(np64(got) == _once(exact, dtype))


def _product_and_gradients(product, a, b, upstream):
    """(product(a, b), d a, d b) for the output gradient `upstream` in one traced function, and its graph."""

    @tf.function
    def step(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = product(a, b)
        return (y, *tape.gradient(y, [a, b], output_gradients=tf.cast(upstream, y.dtype)))

    return step(a, b), step.get_concrete_function(a, b).graph


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_value_product_and_its_gradients_are_rounded_once(dtype, emulated):
    rng = np.random.default_rng(0)
    probs = tf.cast(rng.uniform(size=(2, 3, 16, 24)), dtype)
    value = tf.cast(rng.standard_normal((2, 24, 3, 8)), dtype)
    dy = tf.cast(rng.standard_normal((2, 16, 3, 8)), dtype)

    (y, d_probs, d_value), graph = _product_and_gradients(
        lambda p, v: attention.value_einsum(EQUATION, p, v), probs, value, dy)
    assert y.dtype == d_probs.dtype == d_value.dtype == dtype
    assert _batched_kernels(graph) == ({"float32"} if emulated else {dtype})
    p64, v64, dy64 = np64(probs), np64(value), np64(dy)
    _check(y, np.einsum(EQUATION, p64, v64), dtype, emulated)
    _check(d_probs, np.einsum("abcd,aecd->acbe", dy64, v64), dtype, emulated)
    _check(d_value, np.einsum("abcd,acbe->aecd", dy64, p64), dtype, emulated)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_scores_gradient_products_are_rounded_once(dtype, emulated):
    rng = np.random.default_rng(1)
    key = tf.cast(rng.standard_normal((2, 24, 3, 8)), dtype)
    query = tf.cast(rng.standard_normal((2, 16, 3, 8)), dtype)
    g = tf.cast(rng.standard_normal((2, 3, 16, 24)), dtype)

    (_, d_key, d_query), graph = _product_and_gradients(
        lambda k, q: attention.float32_scores("aecd,abcd->acbe", k, q, 1.0, compiled=False), key, query, g)
    # The uncompiled forward is a float32 einsum of upcasts on any device; the gradients are the 16-bit products.
    assert _batched_kernels(graph) == ({"float32"} if emulated else {dtype, "float32"})
    g64 = np64(g)
    _check(d_key, np.einsum("acbe,abcd->aecd", g64, np64(query)), dtype, emulated)
    _check(d_query, np.einsum("acbe,aecd->abcd", g64, np64(key)), dtype, emulated)


def test_the_backward_pass_upcasts_the_kept_tensors_once_the_gradient_arrives(monkeypatch):
    # A float32 copy of a tensor kept from the forward pass, made as soon as that tensor exists, lives
    # through the rest of the forward pass (benchmark Transformer LM, TF allocator peak: 166 -> 205 MiB).
    monkeypatch.setattr(hardware, "emulated", lambda dtype: True)
    rng = np.random.default_rng(4)
    a, b = (tf.cast(rng.standard_normal((2, 24, 3, 8)), tf.bfloat16) for _ in range(2))
    products = {
        "value product": lambda p, v: attention.value_einsum("acbe,aecd->abcd", tf.einsum("aecd,abcd->acbe", p, v), v),
        "score gradients": lambda k, q: attention.float32_scores("aecd,abcd->acbe", k, q, 1.0, compiled=False),
    }
    for name, product in products.items():
        _, graph = _product_and_gradients(product, a, b, tf.ones((2, 24, 3, 8) if name == "value product" else
                                                                 (2, 3, 24, 24)))
        upcasts = [op for op in live_ops(graph) if op.type == "Cast" and op.get_attr("DstT") == tf.float32
                   and op.inputs[0].op.type == "Placeholder" and op.name.startswith("gradient_tape/")]
        assert upcasts and all(op.control_inputs for op in upcasts), (name, [(op.name, op.control_inputs)
                                                                             for op in upcasts])


@pytest.mark.parametrize("xla_scores", [True, False], ids=["compiled", "uncompiled"])
def test_multi_head_attention_has_no_16_bit_batched_kernel_where_the_device_emulates(xla_scores, emulated):
    keras_amp.enable("mixed_bfloat16", xla_scores=xla_scores)
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    rng = np.random.default_rng(2)
    x = tf.cast(rng.standard_normal((2, 12, 16)), tf.bfloat16)
    layer(x, x)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, x, use_causal_mask=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
        return (y, *tape.gradient(loss, [x, *layer.trainable_variables]))

    results = step(x)
    kernels = _batched_kernels(step.get_concrete_function(x).graph)
    # Native: the 16-bit value product and scores gradients (and, uncompiled, QK^T's float32 einsum).
    assert kernels == ({"float32"} if emulated else {"bfloat16"} | ({"float32"} if not xla_scores else set()))
    assert all(r is not None and np.all(np.isfinite(np64(r))) for r in results)


def test_dot_product_attention_s_value_product(emulated):
    keras_amp.enable("mixed_float16")
    rng = np.random.default_rng(3)
    q, k, v = (tf.cast(rng.standard_normal((2, 10, 2, 8)), tf.float16) for _ in range(3))

    @tf.function
    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            y = keras.ops.dot_product_attention(q, k, v, is_causal=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
        return (y, *tape.gradient(loss, [q, k, v]))

    y, *grads = step(q, k, v)
    kernels = _batched_kernels(step.get_concrete_function(q, k, v).graph)
    assert kernels == ({"float32"} if emulated else {"float16"})  # QK^T: the float32 dot of an XLA computation
    q64, k64, v64 = np64(q), np64(k), np64(v)
    logits = np.einsum("btnh,bsnh->bnts", q64, k64) / np.sqrt(8)
    logits = np.where(np.tril(np.ones((10, 10), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(np64(y), np.einsum("bnts,bsnh->btnh", p, v64), rtol=0, atol=1e-2)
    assert all(g is not None and np.all(np.isfinite(np64(g))) for g in grads)

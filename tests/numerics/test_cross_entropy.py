"""`keras_amp.numerics.cross_entropy`: the float32 sparse cross-entropy of 16-bit logits as two XLA
computations, against float64 NumPy references, and the op rule that uses it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.numerics import cross_entropy

pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning")


def _reference(logits16, labels, upstream):
    x = np.asarray(tf.cast(logits16, tf.float64).numpy())
    top = x.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))[..., 0]
    loss = lse - np.take_along_axis(x, labels[..., None], -1)[..., 0]
    grad = (np.exp(x - lse[..., None]) - np.eye(x.shape[-1])[labels]) * upstream[..., None]
    return loss, grad


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_loss_and_gradient_match_float64(dtype):
    rng = np.random.default_rng(0)
    logits16 = tf.constant(rng.standard_normal((3, 5, 70)) * 8, dtype)  # rank 3: a sequence model's logits
    labels = rng.integers(0, 70, (3, 5))
    upstream = rng.uniform(0.5, 2.0, (3, 5))
    logits = tf.cast(logits16, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = cross_entropy.sparse_cross_entropy(tf.constant(labels), logits, logits16)
    grad = tape.gradient(loss, logits, output_gradients=tf.constant(upstream, tf.float32))
    want_loss, want_grad = _reference(logits16, labels, upstream)
    assert loss.dtype == tf.float32 and loss.shape == (3, 5) and grad.shape == (3, 5, 70)
    np.testing.assert_allclose(loss.numpy(), want_loss, rtol=2e-6, atol=2e-6)  # float32 arithmetic
    # exp(x - lse) carries lse's float32 rounding (|lse| < 40 here: 40 * 2**-24 relative).
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=40 * 2.0**-24 + 2.0**-23, atol=1e-7 * upstream.max())
    # TensorFlow's own float32 kernel on the same upcast agrees to float32 rounding.
    stock = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.constant(labels), logits)
    np.testing.assert_allclose(loss.numpy(), stock.numpy(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("bad", [-1, 70])
def test_a_label_outside_the_classes_raises_as_tensorflows_kernel_does(bad):
    logits16 = tf.zeros((4, 70), tf.bfloat16)
    labels = tf.constant([0, 1, bad, 3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="label value outside the valid range"):
        cross_entropy.sparse_cross_entropy(labels, tf.cast(logits16, tf.float32), logits16)
    with pytest.raises(tf.errors.InvalidArgumentError):  # the contract it keeps (XLA's gather would clamp)
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.zeros((4, 70)))


def _loss_ops(xla_scores):
    keras_amp.enable("mixed_bfloat16", xla_scores=xla_scores)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def f(labels, logits16):
        with tf.GradientTape() as tape:
            tape.watch(logits16)
            value = loss(labels, logits16)
        return value, tape.gradient(value, logits16)

    spec = (tf.TensorSpec((8, 16), tf.int32), tf.TensorSpec((8, 16, 300), tf.bfloat16))
    graph_ops = f.get_concrete_function(*spec).graph.get_operations()
    ops = {op.type for op in graph_ops} | {"(the XLA cross-entropy)" for op in graph_ops
                                           if cross_entropy.is_cross_entropy_call(op)}
    rng = np.random.default_rng(1)
    labels, logits16 = rng.integers(0, 300, (8, 16)), tf.constant(rng.standard_normal((8, 16, 300)) * 4, tf.bfloat16)
    value, grad = f(tf.constant(labels, tf.int32), logits16)
    keras_amp.disable()
    return ops, float(value), np.asarray(tf.cast(grad, tf.float64))


def test_the_rule_uses_it_with_xla_kernels_and_tensorflows_kernel_without():
    xla_ops, xla_value, xla_grad = _loss_ops(True)
    tf_ops, tf_value, tf_grad = _loss_ops(False)
    assert "SparseSoftmaxCrossEntropyWithLogits" in tf_ops
    assert "SparseSoftmaxCrossEntropyWithLogits" not in xla_ops  # guard: the XLA path was taken
    assert "(the XLA cross-entropy)" in xla_ops and "(the XLA cross-entropy)" not in tf_ops  # what check_model reads
    np.testing.assert_allclose(xla_value, tf_value, rtol=1e-6)
    # The gradient reaches the 16-bit logits in bfloat16 either way: equal to its rounding.
    np.testing.assert_allclose(xla_grad, tf_grad, rtol=2.0**-8, atol=2.0**-8 * np.abs(tf_grad).max())


def test_sparse_cross_entropy_keeps_kerass_errors():  # the rule hands shapes it cannot take to Keras
    keras_amp.enable("mixed_bfloat16")
    logits = tf.zeros((4, 5), tf.bfloat16)
    with pytest.raises(ValueError, match="must have the same shape"):
        tf.function(lambda: keras.ops.sparse_categorical_crossentropy(tf.zeros((3,), tf.int32), tf.cast(logits, tf.float32), from_logits=True))()

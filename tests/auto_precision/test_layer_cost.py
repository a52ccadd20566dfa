"""layer_cost: each layer's own floating-point operations, against closed forms; exact ops cost 0."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.auto_precision import layer_cost


def _graph_op(fn, *shapes, op_type):
    graph = tf.function(fn).get_concrete_function(*[tf.TensorSpec(s, tf.float32) for s in shapes]).graph
    (op,) = [op for op in graph.get_operations() if op.type == op_type]
    return op


@pytest.mark.parametrize("fn, shapes, op_type, flops", [
    (lambda a, b: tf.einsum("abc,cd->abd", a, b), [(2, 3, 4), (4, 5)], "Einsum", 2 * 3 * 5 * 4),
    (lambda a, b: tf.einsum("...c,cd->...d", a, b), [(2, 3, 4), (4, 5)], "Einsum", 2 * 3 * 5 * 4),
    (lambda a, b: tf.einsum("bqhd,bkhd->bhqk", a, b), [(2, 3, 4, 8), (2, 6, 4, 8)], "Einsum", 2 * 4 * 3 * 6 * 8),
    (lambda a, b: tf.matmul(a, b, transpose_a=True), [(7, 3), (7, 5)], "MatMul", 3 * 5 * 7),
    (lambda a, b: tf.matmul(a, b, adjoint_a=True), [(2, 7, 3), (2, 7, 5)], "BatchMatMulV2", 2 * 3 * 5 * 7),
    (lambda a: tf.exp(a), [(4, 5)], "Exp", 20),
    (lambda a: tf.nn.relu(a), [(4, 5)], "Relu", 0),
    (lambda a: tf.reshape(a, [20]), [(4, 5)], "Reshape", 0),
], ids=["einsum", "einsum_ellipsis", "einsum_scores", "matmul_transposed", "batch_matmul_adjoint", "exp", "relu",
        "reshape"])
def test_op_flops_closed_forms(fn, shapes, op_type, flops):
    assert layer_cost.op_flops(_graph_op(fn, *shapes, op_type=op_type)) == flops


def test_layer_flops_of_dense_and_convolutions_and_nothing_for_exact_layers():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((5, 5, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inp)
    x = keras.layers.DepthwiseConv2D(3, padding="same", name="depthwise")(x)
    x = keras.layers.Activation("relu", name="relu")(x)
    x = keras.layers.Dropout(0.5, name="dropout")(x)
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.Activation("hard_swish", name="hard_swish")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    out = keras.layers.Dense(8, name="dense")(x)
    model = keras.Model(inp, out)
    flops = layer_cost.layer_flops(model, np.ones((2, 5, 5, 3), "float32"))
    assert flops["conv"] == 2 * 5 * 5 * 4 * (3 * 3 * 3) + 2 * 5 * 5 * 4  # multiply-adds + bias
    assert flops["depthwise"] == 2 * 5 * 5 * 4 * (3 * 3) + 2 * 5 * 5 * 4
    assert flops["dense"] == 2 * 8 * 16 + 2 * 8
    assert all(flops.get(p, 0) == 0 for p in ("relu", "dropout", "pool", "flatten"))
    assert flops["hard_swish"] > 0  # it multiplies: a rounding a float32 policy would avoid
    layers = dict((layer.name, layer) for layer in model.layers)
    assert not layer_cost.costs_something(layers["dropout"], flops.get("dropout", 0))
    assert layer_cost.costs_something(layers["hard_swish"], flops["hard_swish"])
    # Weights alone make a candidate: an Embedding only gathers, but its 16-bit rows are rounded.
    embed = keras.layers.Embedding(10, 4)
    embed.build((None,))
    assert layer_cost.costs_something(embed, 0)

"""keras_amp.custom_gradient: tf.custom_gradient's results and gradients, without its graph-mode leak."""

import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf

from keras_amp import custom_gradient as custom_gradient_module
from keras_amp.custom_gradient import custom_gradient


def _scaled_square(decorator):
    @decorator
    def f(x, w):
        y, z = x * x * w, tf.reduce_sum(x)

        def grad(dy, dz):
            dz = tf.zeros_like(z) if dz is None else dz
            return 2.0 * x * w * dy + dz, tf.reduce_sum(x * x * dy)

        return (y, z), grad

    return f


def _grads(f, x, w, use_z):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y, z = f(x, w)
        loss = tf.reduce_sum(y * y) + (3.0 * z if use_z else 0.0)
    return [loss] + tape.gradient(loss, [x, w])


@pytest.mark.parametrize("use_z", [True, False], ids=["both_outputs", "one_output_unused"])
@pytest.mark.parametrize("graph", [True, False], ids=["tf_function", "eager"])
def test_same_values_and_gradients_as_tf_custom_gradient(graph, use_z):
    x = tf.constant(np.linspace(-1.0, 2.0, 6).reshape(2, 3), tf.float64)
    w = tf.constant(0.7, tf.float64)
    run = (lambda f: tf.function(lambda a, b: _grads(f, a, b, use_z))) if graph else (lambda f: lambda a, b: _grads(f, a, b, use_z))
    ours = [t.numpy() for t in run(_scaled_square(custom_gradient))(x, w)]
    stock = [t.numpy() for t in run(_scaled_square(tf.custom_gradient))(x, w)]
    # float64 NumPy reference: loss = sum((x^2 w)^2) + 3 sum(x); d/dx = 4 x^3 w^2 + 3; d/dw = 2 w sum(x^4)
    xn, wn = x.numpy(), 0.7
    ref = [np.sum((xn**2 * wn) ** 2) + (3 * xn.sum() if use_z else 0.0),
           4 * xn**3 * wn**2 + (3.0 if use_z else 0.0), 2 * wn * np.sum(xn**4)]
    for a, b, r in zip(ours, stock, ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=0)
        np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-12)


def test_gradient_through_a_nested_function_call():
    f = _scaled_square(custom_gradient)
    inner = tf.function(lambda a, b: f(a, b)[0])

    @tf.function
    def outer(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(inner(x, w))
        return tape.gradient(loss, x)

    x = tf.constant([[1.0, -2.0]], tf.float64)
    np.testing.assert_allclose(outer(x, tf.constant(0.5, tf.float64)).numpy(), 2 * x.numpy() * 0.5, atol=1e-12)


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded_backward", "tf_custom_gradient_fallback"])
def test_gradient_ops_are_named_in_the_forward_scope_under_the_tape_where_tf_custom_gradient_names_them_at_root(
        recorded, monkeypatch):
    if not recorded:  # TensorFlow's private record_operation missing: tf.custom_gradient is used, scoped too
        monkeypatch.setattr(custom_gradient_module, "_record_operation", None)
    def backward_op_names(decorator):
        f = _scaled_square(decorator)

        def step(x, w):
            with tf.GradientTape() as tape:
                tape.watch([x, w])
                with tf.name_scope("block"):
                    y, _ = f(x, w)
                loss = tf.reduce_sum(y, name="loss")
            return tape.gradient(loss, [x, w])

        graph = tf.function(step).get_concrete_function(
            tf.TensorSpec((2, 3), tf.float32), tf.TensorSpec((), tf.float32)).graph
        # The gradient function's own ops: grad() multiplies by 2.0 and sums x * x * dy.
        return {op.name for op in graph.get_operations()
                if op.type in ("Mul", "Sum") and not op.name.startswith(("block/", "loss"))}

    ours, stock = backward_op_names(custom_gradient), backward_op_names(tf.custom_gradient)
    assert ours and all(name.startswith("gradient_tape/block/") for name in ours), ours
    assert not any(name.startswith("gradient_tape/") for name in stock), stock  # why the scope is set


def _traced_graph(decorator):
    f = _scaled_square(decorator)
    fn = tf.function(lambda a, b: _grads(f, a, b, True))
    concrete = fn.get_concrete_function(tf.TensorSpec((2, 3), tf.float32), tf.TensorSpec((), tf.float32))
    concrete(tf.ones((2, 3)), tf.constant(1.0))
    return weakref.ref(concrete.graph)


def test_a_traced_graph_is_freed_with_its_function_where_tf_custom_gradient_keeps_it():
    stock = _traced_graph(tf.custom_gradient)
    ours = _traced_graph(custom_gradient)
    gc.collect()
    assert stock() is not None  # TF's registry keeps the closure, and through it the whole graph
    assert ours() is None


def test_a_model_using_it_exports_and_its_saved_gradient_fails_clearly(tmp_path):
    # Before: `tf.saved_model.save` traced the shared gradient type with no op and `model.export()`
    # raised (every bfloat16 Dense on a sequence uses it, through the bias rule).
    import keras  # noqa: PLC0415

    import keras_amp  # noqa: PLC0415

    keras_amp.enable("mixed_bfloat16")
    inputs = keras.Input((16, 32))
    model = keras.Model(inputs, keras.layers.Dense(8)(keras.layers.Dense(32)(inputs)))
    x = tf.constant(np.random.default_rng(0).standard_normal((2, 16, 32)), tf.float32)
    traced = tf.function(lambda x: model(x))
    graph = traced.get_concrete_function(x).graph
    assert any(op.get_attr("_gradient_op_type") == custom_gradient_module._NAME.encode()
               for op in graph.get_operations() if op.type == "IdentityN" and "_gradient_op_type" in op.node_def.attr)
    model.export(str(tmp_path), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path))
    np.testing.assert_array_equal(np.asarray(loaded.serve(x)), np.asarray(model(x)))  # the forward pass
    # Each of the ops shares the one saved function: it fails, with keras_amp's message where its traced
    # inputs fit (tested below), else with TensorFlow's binding error; never another op's gradient.
    with pytest.raises(TypeError, match="Binding inputs"), tf.GradientTape() as tape:
        tape.watch(x)
        tape.gradient(loaded.serve(x), x)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not saved in a SavedModel"):
        grad = tf.function(custom_gradient_module._dispatch).get_concrete_function(None, tf.TensorSpec([2], tf.float32))
        grad(tf.ones([2]))

"""keras_amp.diagnostics.traced_step: the diagnostic step (forward, loss, scaled backward, put back),
its loss, the layers owning weights, the scale in force."""

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_amp
from keras_amp.diagnostics import attribution, traced_step
from keras_amp.diagnostics.traced_step import DiagnosticStep

RNG = np.random.default_rng(0)
X = RNG.normal(size=(6, 4)).astype("float32")
Y = RNG.normal(size=(6, 2)).astype("float32")


def _linear(**dense):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d", **dense)], name="lin")


def _grads_and_loss(trace, grads, reference, loss):
    return {"grads": grads, "reference": reference, "loss": loss}


def test_current_loss_scale_is_the_optimizers_now_or_its_first_steps():
    model = _linear()
    assert traced_step.current_loss_scale(model) == 1.0  # not compiled
    model.compile(optimizer="sgd", loss="mse")
    assert traced_step.current_loss_scale(model) == 1.0  # no loss scaling
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=64.0)
    model.compile(optimizer=opt, loss="mse")
    assert traced_step.current_loss_scale(model) == 64.0 and not opt.built  # before the first step
    opt.build(model.trainable_variables)
    opt.dynamic_scale.assign(8.0)
    assert traced_step.current_loss_scale(model) == 8.0
    model.compile(optimizer=keras_amp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=512.0), loss="mse")
    assert traced_step.current_loss_scale(model) == 512.0


def test_resolve_loss_from_a_name_a_callable_the_compiled_loss_or_the_mean_of_the_outputs():
    model = _linear(kernel_initializer="ones")
    pred = X.astype(np.float64) @ np.ones((4, 2))
    mse = np.mean((Y - pred) ** 2)
    x, y = X, Y
    y_pred = model(X)
    np.testing.assert_allclose(traced_step.resolve_loss(model, y, "mse")(x, y, y_pred), mse, rtol=1e-6)
    absolute = traced_step.resolve_loss(model, y, lambda t, p: keras.ops.abs(t - p))
    np.testing.assert_allclose(absolute(x, y, y_pred), np.mean(np.abs(Y - pred)), rtol=1e-6)
    # No labels: the sum over outputs of each one's mean, which reaches every layer's gradient.
    surrogate = traced_step.resolve_loss(model, None, None)
    np.testing.assert_allclose(surrogate(x, None, [y_pred, 2.0 * y_pred]), 3.0 * pred.mean(), rtol=1e-6)
    model.compile(optimizer="sgd", loss="mae")
    compiled = traced_step.resolve_loss(model, y, None)
    np.testing.assert_allclose(compiled(x, y, y_pred), np.mean(np.abs(Y - pred)), rtol=1e-6)


def test_resolve_loss_errors_say_what_is_allowed():
    model = _linear()
    with pytest.raises(ValueError, match=r"Unknown `loss`\. Received: loss='bogus'\. Allowed: a Keras loss name"):
        traced_step.resolve_loss(model, Y, "bogus")
    with pytest.raises(TypeError, match="`loss` must be callable"):
        traced_step.resolve_loss(model, Y, 3)
    with pytest.raises(ValueError, match=r"`y` is needed with an explicit `loss`\. Received: y=None, loss='mse'"):
        traced_step.resolve_loss(model, None, "mse")
    with pytest.raises(ValueError, match="A loss is needed for labels `y`"):
        traced_step.resolve_loss(model, Y, None)  # uncompiled


class _Gate(keras.layers.Layer):
    """A weight of its own beside a sublayer's."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3, name="inner")

    def build(self, input_shape):
        self.gate = self.add_weight(shape=(3,), name="gate")
        self.inner.build(input_shape)

    def call(self, x):
        return self.inner(x) * self.gate


def test_weighted_layers_are_the_owners_of_trainable_variables_in_model_order():
    inp = keras.Input((4,))
    frozen = keras.layers.Dense(3, name="frozen", trainable=False)
    gate = _Gate(name="gate")
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(gate(frozen(inp))), name="m")
    assert [v.name for v in traced_step.own_trainable_variables(gate)] == ["gate"]
    assert traced_step.own_trainable_variables(model) == []  # all owned by its layers
    found = [(path, [v.name for v in vs]) for path, _, vs in traced_step.weighted_layers(model)]
    assert found == [("gate", ["gate"]), ("gate/inner", ["kernel", "bias"]), ("head", ["kernel", "bias"])]


def test_the_step_returns_scaled_and_reference_gradients_and_applies_nothing():
    model = _linear(use_bias=False)
    model.compile(optimizer="sgd", loss="mse")
    kernel = model.get_layer("d").kernel.numpy().astype(np.float64)
    step = DiagnosticStep(model, X, Y, None, _grads_and_loss)
    scale = 8.0
    out = step.run(scale)
    # mse over 6 x 2 outputs: d/dW mean((XW - Y)^2) = 2 X^T (XW - Y) / 12, in float64.
    residual = X.astype(np.float64) @ kernel - Y
    expected = 2.0 * X.astype(np.float64).T @ residual / residual.size
    ((grad,),) = out["grads"]
    np.testing.assert_allclose(grad, scale * expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["reference"][0][0], traced_step.REFERENCE_FACTOR * scale * expected,
                               rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(out["loss"], np.mean(residual**2), rtol=1e-6)  # unscaled
    np.testing.assert_array_equal(model.get_layer("d").kernel.numpy(), kernel.astype("float32"))
    assert [path for path, _, _ in step.layers] == ["d"]


def test_training_side_effects_are_put_back():
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(name="bn")])
    bn = model.get_layer("bn")
    x = X * 3.0 + 5.0
    out = DiagnosticStep(model, x, None, None, _grads_and_loss, training=True).run(1.0)
    # In training mode the batch is normalised by its own statistics: the outputs' mean is 0 (at
    # inference, with the initial statistics, it would be about 5).
    assert abs(float(out["loss"])) < 1e-5 and abs(x.mean() - 5.0) < 1.5
    np.testing.assert_array_equal(bn.moving_mean.numpy(), np.zeros(4, "float32"))
    np.testing.assert_array_equal(bn.moving_variance.numpy(), np.ones(4, "float32"))
    model(x, training=True)  # guard: a training-mode call does move them
    assert np.all(bn.moving_mean.numpy() > 0.0)


def test_traced_records_op_owners_only_when_attributing():
    model = _linear()
    trace = DiagnosticStep(model, X, None, None, _grads_and_loss).traced()
    assert len(trace.owners) == len(trace.ops) > 0 and 0 < trace.backward_start < len(trace.ops)
    matmuls = [owner for op, owner in zip(trace.ops, trace.owners) if op.type == "MatMul"]
    assert matmuls and set(matmuls) == {"d"}  # forward and backward
    assert attribution.LOSS in trace.owners[:trace.backward_start]
    bare = DiagnosticStep(model, X, None, None, _grads_and_loss, attribute=False).traced()
    assert bare.owners == [] and bare.ops == []


@pytest.mark.parametrize("dtype,normal,subnormal,maxexp", [
    ("float16", 2.0**-14, 2.0**-24, 16), ("bfloat16", 2.0**-126, 2.0**-133, 128),
    ("float32", 2.0**-126, 2.0**-149, 128)], ids=["float16", "bfloat16", "float32"])
def test_float_info_for_keras_dtype_names(dtype, normal, subnormal, maxexp):
    info = traced_step.float_info(dtype)
    assert (float(info.smallest_normal), float(info.smallest_subnormal), int(info.maxexp)) == (
        normal, subnormal, maxexp)
    if dtype == "bfloat16":
        assert info.dtype == np.dtype(ml_dtypes.bfloat16)

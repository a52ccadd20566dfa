"""saved_activations: the forward tensors a training step keeps for its backward pass."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.diagnostics import SavedActivationsReport, saved_activations

pytestmark = pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning")


def _mlp(dtype="float32"):
    inp = keras.Input((12,))
    h = keras.layers.Dense(24, activation="relu", name="hidden", dtype=dtype)(inp)
    out = keras.layers.Dense(3, name="out", dtype=dtype)(h)
    model = keras.Model(inp, out)
    model.compile(loss="mse")
    return model


def _batch(n=5):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def test_relu_mlp_keeps_its_hidden_activation_once_sized_by_the_batch():
    x, y = _batch(5)
    report = saved_activations(_mlp(), x, y)
    assert isinstance(report, SavedActivationsReport)
    # relu keeps its output, which is also the output layer's matmul input: one (5, 24) tensor.
    hidden = [t for t in report.tensors if t.layer == "hidden" and t.shape == (5, 24)]
    assert len(hidden) == 1 and hidden[0].bytes == 5 * 24 * 4 and hidden[0].dtype == "float32"
    for t in report.tensors:
        assert t.bytes == int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size
        assert not t.upcast
        if t.shape:  # scalars aside (the loss-scale seed), each comes from a layer or the loss
            assert t.layer in ("hidden", "out", "(loss)") and not t.early, t
    # Sizes follow the batch: the input batch and the weights are not counted.
    sized = lambda r: sum(t.bytes for t in r.tensors if t.shape)  # scalars (loss sums) aside
    assert sized(saved_activations(_mlp(), *_batch(10))) == 2 * sized(report)
    assert report.by_layer()["hidden"] == 5 * 24 * 4
    assert "saved for the backward pass" in str(report) and "hidden" in str(report)


class _EarlySquare(keras.layers.Layer):
    """y = x**2 with a hand-written gradient whose slope 2x needs no incoming gradient."""

    def __init__(self, ordered, **kwargs):
        super().__init__(**kwargs)
        self.ordered = ordered

    def call(self, x):
        ordered = self.ordered

        @tf.custom_gradient
        def square(x):
            def grad(dy):
                if ordered:
                    with tf.control_dependencies([dy]):
                        return dy * (2.0 * tf.identity(x))
                return dy * (2.0 * x)  # 2x runs as soon as x exists: in the forward pass

            return x * x, grad

        return square(x)


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_a_gradient_computed_in_the_forward_pass_counts_as_saved(ordered):
    inp = keras.Input((12,))
    h = keras.layers.Dense(16, name="proj")(inp)
    out = keras.layers.Dense(3, name="out")(_EarlySquare(ordered, name="square")(h))
    model = keras.Model(inp, out)
    model.compile(loss="mse")
    report = saved_activations(model, *_batch(4))
    early = [t for t in report.tensors if t.early and t.shape == (4, 16)]
    assert len(early) == (0 if ordered else 1), report
    if not ordered:
        assert "gradient computed in the forward pass" in str(report)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_policy_halves_the_hidden_activation(policy):
    x, y = _batch(6)
    float32 = saved_activations(_mlp(), x, y)
    mixed = saved_activations(_mlp(policy), x, y)
    dtype = policy[len("mixed_"):]
    hidden = [t for t in mixed.tensors if t.layer == "hidden" and t.shape == (6, 24)]
    assert [t.dtype for t in hidden] == [dtype]
    assert hidden[0].bytes == float32.by_layer()["hidden"] / 2
    # Mixed keeps the 16-bit copy of the input batch (the hidden kernel's gradient reads it).
    assert [t.dtype for t in mixed.tensors if t.layer == "hidden" and t.shape == (6, 12)] == [dtype]


def test_subclassed_model_and_no_labels():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(8, activation="tanh", name="a")
            self.b = keras.layers.Dense(2, name="b")

        def call(self, x):
            return self.b(self.a(x))

    model = Net()
    x, _ = _batch(3)
    model(x)
    report = saved_activations(model, x)  # y=None: the mean square of the outputs stands in
    assert any(t.layer == "a" and t.shape == (3, 8) for t in report.tensors), report


def test_recipe_model_under_enable_keeps_no_float32_upcast():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="stem")(inp)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(keras.layers.ReLU()(x))
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(x))
    model = keras.Model(inp, keras.layers.Dense(4, name="logits")(x))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_amp.apply_recipe(model, "cnn")
    xb = np.random.default_rng(1).normal(size=(4, 8, 8, 3)).astype("float32")
    report = saved_activations(model, xb, np.arange(4) % 4)
    # The one float32 upcast kept: the recipe's float32 output layer reads its 16-bit input cast up.
    assert {t.layer for t in report.tensors if t.upcast} == {"logits"}, report
    # The float32 stem's output is kept in float32 (stem_bn's float32 input); "bn" keeps the
    # compute dtype between 16-bit layers and keeps nothing in float32.
    assert model.get_layer("bn").compute_dtype == "bfloat16"
    assert not [t for t in report.tensors if t.layer == "bn" and t.dtype == "float32" and t.bytes > 64]


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        saved_activations("model", np.zeros((1, 12)))
    with pytest.raises(TypeError, match="`x`"):
        saved_activations(_mlp(), None)
    with pytest.raises(TypeError, match="training"):
        saved_activations(_mlp(), *_batch(2), training="yes")


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("amp", [False, True], ids=["stock", "keras_amp"])
def test_a_sequence_read_by_three_projections_is_kept_once(amp, policy):
    # Each Dense on a sequence reshapes it to rows for its matmul (keras_amp's rules likewise): views
    # of one buffer. Three projections of it keep what one does.
    def activations(projections):
        if amp:
            keras_amp.enable(policy)
        try:
            inp = keras.Input((7, 8))
            seq = keras.layers.Dense(8, name="seq", dtype=policy)(inp)
            outs = [keras.layers.Dense(8, name=f"proj_{i}", dtype=policy)(seq) for i in range(projections)]
            model = keras.Model(inp, keras.layers.Add(dtype=policy)(outs) if projections > 1 else outs[0])
            model.compile(loss="mse")
            rng = np.random.default_rng(0)
            x, y = rng.normal(size=(5, 7, 8)).astype("float32"), rng.normal(size=(5, 7, 8)).astype("float32")
            report = saved_activations(model, x, y)
        finally:
            keras_amp.disable()
        # The sequence-sized tensors: the sequence, its views, the layers' outputs (the loss's aside).
        return sum(t.bytes for t in report.tensors if t.shape in ((5, 7, 8), (35, 8)) and t.layer != "(loss)")

    # The sequence once; mixed, also the batch's 16-bit copy that seq's kernel gradient reads.
    expected = 5 * 7 * 8 * (2 * 2 if policy == "mixed_bfloat16" else 4)
    assert activations(1) == activations(3) == expected

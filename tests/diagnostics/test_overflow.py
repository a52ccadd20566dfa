"""find_overflow: the producing layer forward and backward, headroom, underflow; every model kind, XLA."""

import functools
import math

import keras
import numpy as np
import pytest

import keras_amp
from keras_amp import model_graph
from keras_amp.diagnostics.overflow import find_overflow, non_finite_data
from tests.helpers import count_walks

SCALE = 2.0**15


class Gain(keras.layers.Layer):
    """y = x * gain, applied as two factors sqrt(gain) (1e5 itself is not a float16 number)."""

    def __init__(self, gain, **kwargs):
        super().__init__(**kwargs)
        self.gain = gain

    def build(self, input_shape):
        # A weight, not a constant: XLA would fold `x * c * c` into `x * (c * c)` = x * inf.
        self.root = self.add_weight(shape=(), initializer=keras.initializers.Constant(math.sqrt(self.gain)),
                                    trainable=False, name="root")

    def call(self, x):
        return x * self.root * self.root


class Subclassed(keras.Model):
    def __init__(self, gains, gain_dtype=None):
        super().__init__(name="sub")
        self.d0 = keras.layers.Dense(8, name="d0")
        self.gains = [Gain(g, name=n, dtype=gain_dtype) for g, n in gains]
        self.head = _head()

    def call(self, x):
        h = self.d0(x)
        for layer in self.gains:
            h = layer(h)
        return self.head(h)


# The planted layer "k" multiplies by 1e5. Followed by a 1e-5 layer, its forward output (~1e5)
# overflows float16; preceded by it, the forward stays in range but the scaled gradient reaching
# k (~1e3 at scale 2**15) overflows when k multiplies it by 1e5.
FORWARD = [(1e5, "k"), (1e-5, "down")]
BACKWARD = [(1e-5, "down"), (1e5, "k")]


def _head():
    # Small weights: the gradient reaching k is ~1e-3 of the scale (overflows at 2**15, not at 1).
    return keras.layers.Dense(1, dtype="float32", name="head",
                              kernel_initializer=keras.initializers.Constant(0.01))


def _build(kind, gains, gain_dtype=None):
    if kind == "subclassed":
        model = Subclassed(gains, gain_dtype)
        model(np.zeros((1, 8), "float32"))
        return model, "k"
    blocks = [Gain(g, name=n, dtype=gain_dtype) for g, n in gains]
    if kind == "sequential":
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="d0"), *blocks,
                                 _head()], name="seq"), "k"
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, name="d0")(inp)
    if kind == "nested":
        h = keras.Sequential(blocks, name="block")(h)
        path = "block/k"
    else:
        for layer in blocks:
            h = layer(h)
        path = "k"
    return keras.Model(inp, _head()(h), name="fn"), path


def _batch():
    rng = np.random.default_rng(0)
    return rng.uniform(0.5, 1.0, (16, 8)).astype("float32"), np.ones((16, 1), "float32")


# Every model kind as a graph; XLA (jit_compile=True on the model) for functional and subclassed.
CASES = [pytest.param(kind, False, id=f"{kind}-graph")
         for kind in ("sequential", "functional", "nested", "subclassed")]
# XLA (a compile per model, the slowest cases): each kind once, one per direction.
FORWARD_CASES = CASES + [pytest.param("functional", True, id="functional-xla")]
BACKWARD_CASES = CASES + [pytest.param("subclassed", True, id="subclassed-xla")]


@pytest.mark.parametrize("kind,jit", FORWARD_CASES)
def test_forward_overflow_names_the_producing_layer(kind, jit):
    keras.config.set_dtype_policy("mixed_float16")
    model, path = _build(kind, FORWARD)
    model.compile(loss="mse", jit_compile=jit)
    x, y = _batch()
    report = find_overflow(model, x, y, loss_scale=1024.0)
    assert report.forward is not None and report.forward.layer == path, str(report)
    # "down" and "head" pass the inf on (non-finite outputs) but are not blamed.
    assert report.layer(path[:-1] + "down").nonfinite_output
    assert report.layer("head").nonfinite_output
    assert report.backward is None and "forward pass is already non-finite" in report.backward_note
    assert report.offending_layers() == [path]
    # Fixed: the 1e5 layer and the one bringing values back into range compute in float32.
    keras.config.set_dtype_policy("mixed_float16")
    fixed, _ = _build(kind, FORWARD, gain_dtype="float32")
    fixed.compile(loss="mse", jit_compile=jit)
    fixed_report = find_overflow(fixed, x, y, loss_scale=1024.0)
    assert fixed_report.ok, str(fixed_report)
    # Guard: the fixed model really carries ~1e5 activations in k, beyond float16's 65504.
    assert fixed_report.layer(path).max_abs > 65504


def test_stock_fit_says_only_that_the_loss_is_nan(capsys):
    # Stock Keras's one signal for a forward overflow: a non-finite loss, and TerminateOnNaN's
    # message. Neither names the layer, which find_overflow does (the tests above and below).
    keras.config.set_dtype_policy("mixed_float16")
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, name="d0", kernel_initializer="ones")(inp)
    h = keras.layers.Dense(8, name="big", kernel_initializer=keras.initializers.Constant(1e4))(h)  # ~5e5 > 65504
    model = keras.Model(inp, _head()(h))
    model.compile(optimizer="sgd", loss="mse")
    x, y = _batch()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()])
    out = capsys.readouterr().out
    assert not math.isfinite(history.history["loss"][0]) and "Invalid loss" in out  # guard: it overflowed
    assert set(history.history) == {"loss"} and not any(layer.name in out for layer in model.layers)
    assert find_overflow(model, x, y).forward.layer == "big"  # what the stock signals leave out


@pytest.mark.parametrize("kind,jit", BACKWARD_CASES)
def test_backward_overflow_names_the_producing_layer(kind, jit):
    keras.config.set_dtype_policy("mixed_float16")
    model, path = _build(kind, BACKWARD)
    model.compile(loss="mse", jit_compile=jit)
    x, y = _batch()
    report = find_overflow(model, x, y, loss_scale=SCALE)
    assert report.forward is None, str(report)
    assert report.backward is not None and report.backward.layer == path, str(report)
    assert report.backward.op.startswith("gradient_tape/")
    # Guard: the forward pass really was finite everywhere, k included.
    assert all(not s.nonfinite_output for s in report.layers)
    # Fixed: a loss scale 2**13 times smaller (the decision tree's "lower the scale").
    fixed = find_overflow(model, x, y, loss_scale=4.0)
    assert fixed.ok, str(fixed)


def test_headroom_and_max_activation_match_a_float64_reference():
    keras.config.set_dtype_policy("mixed_float16")
    model, _ = _build("functional", BACKWARD)
    model.compile(loss="mse")
    x, y = _batch()
    report = find_overflow(model, x, y, loss_scale=1.0, training=False)
    w, b = (v.astype("float64") for v in model.get_layer("d0").get_weights())
    ref = np.abs(x.astype("float64") @ w + b).max()
    d0 = report.layer("d0")
    assert d0.compute_dtype == "float16" and d0.output_dtype == "float16"
    np.testing.assert_allclose(d0.max_abs, ref, rtol=2e-3)  # float16 keeps ~11 bits
    np.testing.assert_allclose(d0.headroom_bits, math.log2(65504.0 / ref), atol=3e-3)
    head = report.layer("head")
    assert head.output_dtype == "float32"
    assert head.headroom_bits > 100  # float32's limit, 3.4e38


def test_gradient_underflow_fraction_at_the_loss_scale():
    keras.config.set_dtype_policy("mixed_float16")
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, name="k")(inp)
    # A float32 head with ~1e-8 weights: the gradient reaching k is ~1e-8, below float16's
    # smallest subnormal (6e-8) at scale 1.
    out = keras.layers.Dense(1, dtype="float32", name="head",
                             kernel_initializer=keras.initializers.Constant(1e-8))(h)
    model = keras.Model(inp, out)
    model.compile(loss="mse")
    x, y = _batch()
    low = find_overflow(model, x, y, loss_scale=1.0)
    assert low.ok
    assert low.layer("k").gradients.zero_fraction == 1.0
    assert low.layer("k").gradients.underflow_zero_fraction == 1.0
    assert [s.path for s in low.underflowing()] == ["k"]
    high = find_overflow(model, x, y, loss_scale=SCALE)
    assert high.layer("k").gradients.zero_fraction == 0.0
    assert high.underflowing() == []


def test_model_state_is_left_as_it_was():
    keras.config.set_dtype_policy("mixed_float16")
    inp = keras.Input((8,))
    h = keras.layers.Dense(8)(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    model = keras.Model(inp, keras.layers.Dense(1, dtype="float32")(h))
    model.compile(loss="mse")
    x, y = _batch()
    before = [v.numpy().copy() for v in model.variables]
    report = find_overflow(model, x, y, loss_scale=1.0)
    assert report.ok, str(report)
    for a, v in zip(before, model.variables):
        np.testing.assert_array_equal(a, v.numpy(), err_msg=v.path)
    # Guard: a training-mode forward pass does move the batch-norm statistics.
    model(x, training=True)
    assert not np.array_equal(before[2], model.get_layer("bn").moving_mean.numpy()) or \
        not np.array_equal(before[3], model.get_layer("bn").moving_variance.numpy())


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("where", ["inputs", "labels"])
def test_non_finite_data_is_named_and_comes_first(policy, where):
    keras.config.set_dtype_policy(policy)
    model, _ = _build("functional", [(1.0, "k")])  # no planted overflow: only the data is not finite
    model.compile(loss="mse")
    x, y = _batch()
    clean = find_overflow(model, x, y, loss_scale=SCALE)
    assert clean.ok and clean.data == ()  # guard: the batch alone decides
    (x if where == "inputs" else y)[3, 0] = np.nan
    report = find_overflow(model, x, y, loss_scale=SCALE)
    size = x.size if where == "inputs" else y.size
    assert report.data == (f"{where}: 1 of {size} values NaN/inf, first at row 3, feature 0",)
    assert not report.ok and report.offending_layers() == []  # the data is not a layer to move to float32
    text = str(report).splitlines()
    assert text[1] == f"  data: {report.data[0]}: repair or filter the data first (the batch itself is not finite)"
    if where == "inputs":
        assert report.forward.layer == "(input)"
    # Structured inputs are named by key; integer arrays (token ids) cannot hold NaN and are skipped.
    assert non_finite_data({"ids": np.zeros((2, 3), "int32"), "f": x}, None) == (
        (f"inputs['f']: 1 of {x.size} values NaN/inf, first at row 3, feature 0",) if where == "inputs" else ())


def test_a_batch_no_step_can_run_on_is_refused_before_any_graph_runs():
    # An empty batch, labels that are not numbers (a string label once failed in the graph with
    # UnimplementedError), or arrays whose batch sizes differ (once TF's "Dimensions must be equal").
    keras.config.set_dtype_policy("mixed_float16")
    model, _ = _build("functional", BACKWARD)
    model.compile(loss="mse")
    x, y = _batch()
    with pytest.raises(ValueError, match=r"`x` must hold at least one sample.*Received: x with batch size 0"):
        find_overflow(model, x[:0], y[:0])
    with pytest.raises(TypeError, match=r"`y` must be an array or tensor of numbers.*Received: y='y' of type str"):
        find_overflow(model, x, "y")
    with pytest.raises(TypeError, match=r"`y\[1\]` must be .* numbers.*Received: y\[1\] of dtype <U1, shape \(16,\)"):
        find_overflow(model, x, [y, np.array(["a"] * 16)])
    with pytest.raises(ValueError, match=r"`y` must hold one label row per sample of `x` .*"
                                         r"Received: x of shape \(16, 8\), y of shape \(3, 7\)"):
        find_overflow(model, x, np.ones((3, 7)))
    with pytest.raises(ValueError, match=r"`x` must hold the same number of samples in every array"):
        find_overflow(model, {"a": x, "b": x[:4]}, y)
    with pytest.raises(TypeError, match=r"`x` must be an array or tensor of values the model takes"):
        find_overflow(model, object(), y)


def test_labels_optional_and_a_loss_needs_them():
    keras.config.set_dtype_policy("mixed_float16")
    model, _ = _build("functional", BACKWARD)
    x, _ = _batch()
    report = find_overflow(model, x, loss_scale=SCALE)  # uncompiled, no labels: mean of outputs
    assert report.backward is not None and report.backward.layer == "k"
    with pytest.raises(ValueError, match="`y` is needed"):
        find_overflow(model, x, loss="mse")
    with pytest.raises(ValueError, match="A loss is needed"):
        find_overflow(model, x, np.ones((16, 1), "float32"))


def test_shared_layer_and_colliding_names_are_attributed_exactly():
    # A layer "dense" called twice and a layer named "dense_1": TensorFlow names the scopes of
    # the calls "dense", "dense_1" and "dense_1_<n>", so a scope name does not identify the
    # layer. The overflow is planted in the layer named "dense_1".
    keras.config.set_dtype_policy("mixed_float16")
    inp = keras.Input((8,))
    shared = keras.layers.Dense(8, name="dense", kernel_initializer=keras.initializers.Constant(0.125))
    h = shared(shared(inp))
    h = keras.layers.Dense(8, use_bias=False, name="dense_1",
                           kernel_initializer=keras.initializers.Constant(1.25e4))(h)
    model = keras.Model(inp, _head()(h), name="shared")
    model.compile(loss="mse")
    x, y = _batch()
    report = find_overflow(model, x, y, loss_scale=1.0)
    assert report.forward.layer == "dense_1" and report.forward.op_type == "MatMul", str(report)
    # Guard: the producing op's name scope is not the layer's name (TF made it unique).
    assert report.forward.op.split("/")[1] not in ("dense", "dense_1")
    assert not report.layer("dense").nonfinite_output


def test_embedding_recurrent_attention_and_dropout_models_run():
    # Sparse gradients (Embedding), a while loop (LSTM), sublayers (MultiHeadAttention), dropout.
    keras.config.set_dtype_policy("mixed_float16")
    inp = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(50, 8, name="embed")(inp)
    h = keras.layers.LSTM(8, return_sequences=True, name="lstm")(h)
    h = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="mha")(h, h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inp, _head()(h))
    model.compile(loss="mse")
    x = np.random.default_rng(0).integers(0, 50, (4, 6)).astype("int32")
    report = find_overflow(model, x, np.ones((4, 1), "float32"), loss_scale=1.0)
    assert report.ok, str(report)
    paths = {s.path for s in report.layers}
    assert {"embed", "lstm", "mha", "mha/query", "head"} <= paths
    embed = report.layer("embed").gradients
    assert embed.size == 50 * 8  # the sparse gradient, densified
    # Rows not looked up are truly zero (zero at any scale): not underflow.
    assert embed.zero_fraction > 0.5 and embed.underflow_zero_fraction == 0.0
    assert "embed" not in [s.path for s in report.underflowing()]
    assert report.layer("mha/query").gradients is not None


@pytest.mark.parametrize("tier", ["auto", None, "large"])
def test_default_scale_is_the_one_training_runs_at(tier):
    # Before the first step (optimizer unbuilt) and after: the scale `fit` uses, not Keras's 2**15.
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), _head()])
    opt = keras_amp.LossScaleOptimizer(keras.optimizers.SGD(0.0), tier=tier)
    model.compile(optimizer=opt, loss="mse")
    x, y = np.ones((4, 8), "float32"), np.zeros((4, 1), "float32")
    before = find_overflow(model, x, y)
    assert not opt.built  # guard: find_overflow builds nothing
    model.fit(x, y, epochs=1, verbose=0)
    after = find_overflow(model, x, y)
    expected = {"auto": 2.0**10, None: 2.0**15, "large": 2.0**16}[tier]  # 80 parameters: "small"
    assert before.loss_scale == after.loss_scale == opt.scale == expected
    assert str(before).startswith(f"find_overflow('{model.name}'): loss=")
    assert f"at loss scale {expected:g}" in str(before)


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_one_walk_of_the_model_and_a_tree_passed_in_is_read_instead(kind, monkeypatch):
    keras.config.set_dtype_policy("mixed_float16")
    model, path = _build(kind, FORWARD)
    x, y = _batch()
    walked = count_walks(monkeypatch)
    first = find_overflow(model, x, y, loss="mse", loss_scale=1.0)
    assert walked == [model]  # the step's weighted layers and the attribution read one tree
    tree = model_graph.layer_tree(model)
    walked.clear()
    again = find_overflow(model, x, y, loss="mse", loss_scale=1.0, tree=tree)
    assert walked == [] and again.forward.layer == first.forward.layer == path
    other, _ = _build(kind, FORWARD)
    with pytest.raises(ValueError, match="`tree` must be the LayerTree of `model`"):
        find_overflow(other, x, y, loss="mse", tree=tree)
    with pytest.raises(TypeError, match="`tree`"):
        find_overflow(model, x, y, loss="mse", tree={})


class Chain(keras.Model):
    def __init__(self, layers):
        super().__init__(name="chain")
        self.chain = layers

    def call(self, x):
        return functools.reduce(lambda h, layer: layer(h), self.chain, x)


def _boundary_model(kind, direction, narrow_dtype=None):
    """A float16 layer "narrow" beside float32 ones; Keras casts between them in the caller's scope.

    backward: narrow feeds the float32 head (kernel 20), whose input gradient (~2.5e5 for 1e5
    targets) overflows float16 where it is cast down for narrow's output. forward: the float32
    layer "big" (kernel 1e4) outputs ~5e5, cast down to float16 for narrow's input.
    """
    c, back = keras.initializers.Constant, direction == "backward"
    chain = [keras.layers.Dense(8, name="a", kernel_initializer="ones")]
    chain += [] if back else [keras.layers.Dense(8, dtype="float32", name="big", kernel_initializer=c(1e4))]
    chain += [keras.layers.Dense(8, name="narrow", dtype=narrow_dtype,
                                 kernel_initializer=c(1e-3 if back else 1e-5)),
              keras.layers.Dense(1, dtype="float32", name="head", kernel_initializer=c(20.0 if back else 1e-3))]
    if kind == "subclassed":
        model = Chain(chain)
        model(np.zeros((1, 8), "float32"))
        return model, "narrow"
    inp = keras.Input((8,))
    if kind == "nested":  # the 16-bit side inside a block, the head outside
        return keras.Model(inp, chain[-1](keras.Sequential(chain[:-1], name="blk")(inp))), "blk/narrow"
    return keras.Sequential([inp, *chain]), "narrow"


@pytest.mark.parametrize("direction", ["backward", "forward"])
@pytest.mark.parametrize("kind", ["sequential", "nested", "subclassed"])
def test_an_overflow_at_a_float16_float32_boundary_names_the_16_bit_layer(kind, direction):
    keras.config.set_dtype_policy("mixed_float16")
    model, path = _boundary_model(kind, direction)
    x, y = _batch()[0], np.full((16, 1), 1e5 if direction == "backward" else 0.0, "float32")
    report = find_overflow(model, x, y, "mse", loss_scale=1.0)
    producer = report.forward if direction == "forward" else report.backward
    assert producer is not None and producer.layer == path and producer.op_type == "Cast", str(report)
    assert report.offending_layers() == [path]
    # Guard: the cast sits in the model's or the block's scope, not in the layer's.
    assert "narrow" not in producer.op, producer.op
    source, side = (("gradient from layer 'head'", "output") if direction == "backward" else
                    (f"values from layer '{path.replace('narrow', 'big')}'", "input"))
    assert producer.boundary == (f"at a float32/float16 boundary, the float32 {source} cast to float16 "
                                 f"for the {side} of layer '{path}'")
    assert producer.boundary in str(report)
    # Fixed: the named layer computes in float32, and the step is finite.
    fixed, _ = _boundary_model(kind, direction, narrow_dtype="float32")
    assert find_overflow(fixed, x, y, "mse", loss_scale=1.0).ok


@pytest.mark.parametrize("kind", ["sequential", "nested", "subclassed"])
def test_the_loss_gradient_overflowing_for_a_16_bit_output_names_the_output_layer(kind):
    # Keras's loss casts a float16 output to float32 in its own scope; the gradient of that cast, cast down
    # for the output layer (~1.25e6 here for 1e7 targets), had been the loss's: no layer named.
    keras.config.set_dtype_policy("mixed_float16")
    chain = [keras.layers.Dense(8, name="a"), keras.layers.Dense(1, name="out")]
    x, y = _batch()[0], np.full((16, 1), 1e7, "float32")
    if kind == "subclassed":
        model, path = Chain(chain), "out"
        model(x)
    elif kind == "nested":
        inp = keras.Input((8,))
        model, path = keras.Model(inp, keras.Sequential(chain, name="blk")(inp)), "blk/out"
    else:
        model, path = keras.Sequential([keras.Input((8,)), *chain]), "out"
    report = find_overflow(model, x, y, "mse", loss_scale=1.0)
    # "mse" as fit computes it: in float32 (the bare function casts the 1e7 labels to float16: inf).
    expected = np.mean((np.asarray(model(x), np.float64) - 1e7) ** 2)
    assert report.forward is None and report.loss == pytest.approx(expected, rel=1e-6)
    assert report.backward.layer == path and report.backward.op_type == "Cast", str(report)
    assert report.offending_layers() == [path]
    assert report.backward.boundary == ("at a float32/float16 boundary, the float32 gradient from the loss cast "
                                        f"to float16 for the output of layer '{path}'")

"""LSTM/GRU: float32 gates and carried state vs a float64 NumPy loop; stock float16/bfloat16 drift."""


import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.layers import GRU, LSTM
from tests.helpers import MIXED, np64, sigmoid, u, while_bodies

# enable("mixed_float16") warns that this CPU has no fast float16: numerics, not speed, are under test.
pytestmark = pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning")
UNITS = 4
T = 150


def _inputs():
    rng = np.random.default_rng(0)
    return (0.1 * rng.standard_normal((2, T, 3))).astype("float32")


def _make(cls, **kwargs):
    """Gates driven by float32 biases so 1 - f (LSTM) / 1 - z (GRU) is small: the
    state integrates over ~1/(1 - f) steps, where float16/bfloat16 rounding piles up."""
    layer = cls(
        UNITS,
        return_state=True,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=1),
        recurrent_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=2),
        **kwargs,
    )
    layer.build((2, T, 3))
    if isinstance(layer, keras.layers.LSTM):  # gate order i, f, c, o; f = sigmoid(6) = 0.9975
        bias = np.concatenate([np.full(UNITS, 2.0), np.full(UNITS, 6.0), np.full(UNITS, 1.0), np.zeros(UNITS)])
    else:  # row 0 input bias z, r, h; z = sigmoid(4) = 0.982
        bias = np.zeros((2, 3 * UNITS))
        bias[0, :UNITS] = 4.0
        bias[0, 2 * UNITS :] = 1.0
    layer.cell.bias.assign(bias.astype("float32"))
    return layer


def ref_lstm(x, cell, h=None, c=None):
    k, rk, b = np64(cell.kernel), np64(cell.recurrent_kernel), np64(cell.bias)
    h = np.zeros((x.shape[0], UNITS)) if h is None else h
    c = np.zeros((x.shape[0], UNITS)) if c is None else c
    outputs = []
    for t in range(x.shape[1]):
        i, f, g, o = np.split(x[:, t] @ k + h @ rk + b, 4, axis=-1)
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
        outputs.append(h)
    return np.stack(outputs, 1), h, c


def ref_gru(x, cell, h=None):
    k, rk, b = np64(cell.kernel), np64(cell.recurrent_kernel), np64(cell.bias)
    h = np.zeros((x.shape[0], UNITS)) if h is None else h
    n = UNITS
    outputs = []
    for t in range(x.shape[1]):
        xz, hz = x[:, t] @ k + b[0], h @ rk + b[1]
        z = sigmoid(xz[:, :n] + hz[:, :n])
        r = sigmoid(xz[:, n : 2 * n] + hz[:, n : 2 * n])
        hh = np.tanh(xz[:, 2 * n :] + r * hz[:, 2 * n :])
        h = z * h + (1 - z) * hh
        outputs.append(h)
    return np.stack(outputs, 1), h


def _tol(policy_name):
    # Input/recurrent matmuls run in the compute dtype (relative error ~u on
    # pre-activations of size ~0.1); everything after is float32.
    return 2e-6 + u(policy_name) / 2


def test_lstm_cell_state_matches_float64(policy):
    x = _inputs()
    layer = _make(LSTM)
    _, h, c = layer(x)
    _, ref_h, ref_c = ref_lstm(np64(x), layer.cell)
    assert np.abs(ref_c).max() > 50  # guard: c is large, float16 spacing there is >= 0.03
    rel = np.max(np.abs(np64(c) - ref_c) / np.abs(ref_c))
    assert rel < _tol(policy), rel
    # h is returned in the compute dtype: one rounding on top.
    np.testing.assert_allclose(np64(h), ref_h, atol=2 * u(policy) + 1e-5)


@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_stock_lstm_cell_state_drifts_ours_holds(p):
    keras.config.set_dtype_policy(p)
    x = _inputs()
    stock, ours = _make(keras.layers.LSTM), _make(LSTM)
    ours.set_weights(stock.get_weights())  # same weight layout as stock
    ref_c = ref_lstm(np64(x), stock.cell)[2]
    rel = lambda c: np.max(np.abs(np64(c) - ref_c) / np.abs(ref_c))  # noqa: E731
    stock_rel, ours_rel = rel(stock(x)[2]), rel(ours(x)[2])
    assert stock_rel > 10 * _tol(p), stock_rel  # measured 1.6e-2 (float16), 0.18 (bfloat16)
    assert ours_rel < _tol(p), ours_rel


def test_gru_state_matches_float64(policy):
    x = _inputs()
    layer = _make(GRU)
    out, h = layer(x)
    _, ref_h = ref_gru(np64(x), layer.cell)
    assert np.max(np.abs(np64(h) - ref_h)) < _tol(policy)
    np.testing.assert_allclose(np64(out), ref_h, atol=2 * u(policy) + 1e-5)


@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_stock_gru_state_stalls_ours_holds(p):
    keras.config.set_dtype_policy(p)
    x = _inputs()
    stock, ours = _make(keras.layers.GRU), _make(GRU)
    ours.set_weights(stock.get_weights())
    ref_h = ref_gru(np64(x), stock.cell)[1]
    stock_err = np.max(np.abs(np64(stock(x)[1]) - ref_h))
    ours_err = np.max(np.abs(np64(ours(x)[1]) - ref_h))
    assert stock_err > 4 * _tol(p), stock_err  # measured 2.1e-3 (float16), 0.10 (bfloat16)
    assert ours_err < _tol(p), ours_err


@pytest.mark.parametrize("cls", [LSTM, GRU], ids=["LSTM", "GRU"])
def test_dtypes(policy, cls):
    layer = cls(UNITS, return_sequences=True, return_state=True)
    outputs = layer(_inputs()[:, :5])
    cdt = keras.dtype_policies.get(policy).compute_dtype
    expected = [cdt, cdt, "float32"] if cls is LSTM else [cdt, "float32"]
    assert [keras.backend.standardize_dtype(o.dtype) for o in outputs] == expected
    assert all(w.dtype == "float32" for w in layer.weights)
    # Symbolic (functional) outputs carry the same dtypes.
    symbolic = cls(UNITS, return_state=True)(keras.Input((5, 3)))
    assert [o.dtype for o in symbolic][1:] == expected[1:]


@pytest.mark.parametrize("cls", [LSTM, GRU], ids=["LSTM", "GRU"])
def test_stateful_equals_one_long_sequence(policy, cls):
    x = _inputs()[:, :40]
    whole = _make(cls)
    stateful = _make(cls, stateful=True)
    stateful.set_weights(whole.get_weights())
    expected = whole(x)[-1]
    stateful(x[:, :20])
    got = stateful(x[:, 20:])[-1]
    # The carried state is float32 between calls too, so splitting the
    # sequence changes nothing beyond float32 rounding.
    np.testing.assert_allclose(np64(got), np64(expected), rtol=1e-6, atol=1e-6)
    assert all(v.dtype == "float32" for v in stateful.states)
    stateful.reset_state()
    assert all(np.all(np64(v) == 0) for v in stateful.states)


@pytest.mark.parametrize("cls", [LSTM, GRU], ids=["LSTM", "GRU"])
def test_gradients_match_float32(mixed_policy, cls):
    x = tf.constant(_inputs()[:, :30])
    layers = {}
    for p in ("float32", mixed_policy):
        layers[p] = _make(cls, dtype=p)
    layers[mixed_policy].set_weights(layers["float32"].get_weights())
    grads = {}
    for p, layer in layers.items():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(x)[-1], "float32"))
        grads[p] = tape.gradient(loss, layer.trainable_variables)
    for g32, gm in zip(grads["float32"], grads[mixed_policy]):
        scale = np.abs(np64(g32)).max()
        # Backward matmuls in the compute dtype: error ~ a few u of the largest gradient.
        np.testing.assert_allclose(np64(gm), np64(g32), atol=8 * u(mixed_policy) * scale)


def test_recurrent_dropout_paths_run(mixed_policy):
    for cls in (LSTM, GRU):
        layer = cls(UNITS, dropout=0.2, recurrent_dropout=0.2, seed=3)
        out = layer(_inputs()[:, :10], training=True)
        assert np.all(np.isfinite(np64(out)))


@pytest.mark.parametrize("ours, stock", [(LSTM, keras.layers.LSTM), (GRU, keras.layers.GRU)], ids=["LSTM", "GRU"])
def test_recurrent_dropout_matches_stock_in_float32(ours, stock):
    # Same seed and weights in float32: our dropout masks and gates are stock's.
    x = _inputs()[:, :10]
    kwargs = dict(dropout=0.2, recurrent_dropout=0.2, seed=3, dtype="float32")
    stock_layer, ours_layer = stock(UNITS, **kwargs), ours(UNITS, **kwargs)
    stock_layer.build(x.shape)
    ours_layer.build(x.shape)
    ours_layer.set_weights(stock_layer.get_weights())
    stock_out = np64(stock_layer(x, training=True))
    ours_out = np64(ours_layer(x, training=True))
    no_dropout = np64(stock_layer(x, training=False))
    assert np.abs(stock_out - no_dropout).max() > 1e-3  # guard: dropout was applied
    np.testing.assert_allclose(ours_out, stock_out, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cls", [LSTM, GRU], ids=["LSTM", "GRU"])
def test_one_cell_tracked_and_generic_loop(cls):
    """Behavioural guard for the cell swap (it drops the stock cell from the tracked sublayers):
    one cell, ours, and stock's weight count; `use_cudnn` is the public switch, False."""
    layer = cls(UNITS)
    layer.build((2, 5, 3))
    cells = [type(sub) for sub in layer._flatten_layers(include_self=False)]
    assert cells == [type(layer.cell)] and type(layer.cell).__module__ == "keras_amp.layers.recurrent"
    stock = getattr(keras.layers, cls.__name__)(UNITS)
    stock.build((2, 5, 3))
    assert len(layer.weights) == len(stock.weights) == 3
    assert layer.use_cudnn is False  # the stock layer then skips its cuDNN attempt


# --- the "rnn" recipe on stock LSTM/GRU, in place (Matmul16DTypePolicy + the matmul rule) ---------


def _stock_model(cls, **kwargs):
    """A functional model around a stock layer built as `_make` builds it (weights included)."""
    inp = keras.Input((None, 3))
    layer = _make(cls, **kwargs)
    return keras.Model(inp, layer(inp)), layer


def _recipe_model(cls, p, **kwargs):
    keras_amp.enable(p)
    model, layer = _stock_model(cls, **kwargs)
    keras_amp.apply_recipe(model, "rnn")
    assert isinstance(layer.dtype_policy, keras_amp.Matmul16DTypePolicy)
    assert layer.cell.dtype_policy == layer.dtype_policy
    return model, layer


@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_rnn_recipe_on_stock_lstm_holds_the_cell_state(p):
    x = _inputs()
    keras.config.set_dtype_policy(p)
    stock_model, stock = _stock_model(keras.layers.LSTM)  # stock under the mixed policy
    ref_c = ref_lstm(np64(x), stock.cell)[2]
    model, layer = _recipe_model(keras.layers.LSTM, p)
    model.set_weights(stock_model.get_weights())
    rel = lambda c: np.max(np.abs(np64(c) - ref_c) / np.abs(ref_c))  # noqa: E731
    _, h, c = model(x)
    assert keras.backend.standardize_dtype(c.dtype) == "float32"
    assert rel(stock_model(x)[2]) > 10 * _tol(p)  # stock: 1.6e-2 (float16), 0.18 (bfloat16)
    assert rel(c) < _tol(p), rel(c)  # as keras_amp.layers.LSTM: matmuls 16-bit, the rest float32
    # Guard: the matmuls really ran in 16 bits (a float32 LSTM would be within 2e-6).
    keras_amp.disable()
    keras.config.set_dtype_policy("float32")
    assert rel(model(x)[2]) < 2e-6  # without the op rules the layer is a plain float32 LSTM
    assert np.abs(np64(model(x)[1]) - np64(h)).max() > 0


@pytest.mark.parametrize("p", MIXED, ids=lambda p: p)
def test_rnn_recipe_on_stock_gru_holds_the_state(p):
    x = _inputs()
    keras.config.set_dtype_policy(p)
    stock_model, stock = _stock_model(keras.layers.GRU)
    ref_h = ref_gru(np64(x), stock.cell)[1]
    model, _ = _recipe_model(keras.layers.GRU, p)
    model.set_weights(stock_model.get_weights())
    stock_err = np.max(np.abs(np64(stock_model(x)[1]) - ref_h))
    ours_err = np.max(np.abs(np64(model(x)[1]) - ref_h))
    assert stock_err > 4 * _tol(p), stock_err
    assert ours_err < _tol(p), ours_err


@pytest.mark.parametrize("cls", [keras.layers.LSTM, keras.layers.GRU], ids=["LSTM", "GRU"])
def test_rnn_recipe_gradients_match_float32(mixed_policy, cls):
    x = tf.constant(_inputs()[:, :30])
    keras.config.set_dtype_policy("float32")
    float32_model, _ = _stock_model(cls)
    model, _ = _recipe_model(cls, mixed_policy)
    model.set_weights(float32_model.get_weights())

    def gradients(m):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(m(x)[-1], "float32"))
        return tape.gradient(loss, m.trainable_variables)

    reference = gradients(float32_model)
    # Eager, and traced: there the kernels' 16-bit casts are hoisted out of the time loop and the
    # loop's gradient sums theirs over the steps.
    for grads in (gradients(model), tf.function(gradients)(model)):
        for g32, gm in zip(reference, grads):
            scale = np.abs(np64(g32)).max()
            assert gm.dtype == "float32"
            # Backward matmuls in the 16-bit dtype (as keras_amp.layers.LSTM / GRU).
            np.testing.assert_allclose(np64(gm), np64(g32), atol=8 * u(mixed_policy) * scale)


@pytest.mark.parametrize("cls", [keras.layers.LSTM, keras.layers.GRU], ids=["LSTM", "GRU"])
def test_rnn_recipe_with_dropout_and_stateful_runs(mixed_policy, cls):
    # Dropout masks are made from the 16-bit step input and multiply float32 inputs.
    model, layer = _recipe_model(cls, mixed_policy, dropout=0.2, recurrent_dropout=0.2, seed=3)
    x = _inputs()[:, :10]
    outs = [np64(o) for o in model(x, training=True)]
    assert all(np.all(np.isfinite(o)) for o in outs)
    assert np.abs(outs[0] - np64(model(x, training=False)[0])).max() > 1e-4  # guard: dropout applied
    keras.backend.clear_session()
    whole, _ = _recipe_model(cls, mixed_policy)
    stateful_model, _ = _recipe_model(cls, mixed_policy, stateful=True)
    stateful_model.set_weights(whole.get_weights())
    x = _inputs()[:, :40]
    expected = whole(x)[-1]
    stateful_model(x[:, :20])
    # The layer is float32: its states, returned and kept, are float32 between calls too.
    np.testing.assert_allclose(np64(stateful_model(x[:, 20:])[-1]), np64(expected), rtol=1e-6, atol=1e-6)


def test_rnn_recipe_on_a_generic_rnn_runs_its_float32_cell_with_16bit_matmuls():
    # RNN(LSTMCell): the cell (saved in the RNN's config) stays float32 and the matmul rule reads
    # the enclosing RNN's Matmul16DTypePolicy.
    keras_amp.enable("mixed_bfloat16")
    x = _inputs()
    lstm = _make(keras.layers.LSTM)
    inp = keras.Input((None, 3))
    generic = keras.layers.RNN(keras.layers.LSTMCell(UNITS), return_state=True)
    model = keras.Model(inp, generic(inp))
    generic.set_weights(lstm.get_weights())
    keras_amp.apply_recipe(model, "rnn")
    assert generic.cell.dtype_policy.name == "float32"
    ref_c = ref_lstm(np64(x), lstm.cell)[2]
    rel = np.max(np.abs(np64(model(x)[2]) - ref_c) / np.abs(ref_c))
    assert 2e-6 < rel < _tol("mixed_bfloat16"), rel  # 16-bit matmuls, float32 state


@pytest.mark.parametrize("stock", [True, False], ids=["recipe", "keras_amp.layers.LSTM"])
def test_kernel_casts_are_hoisted_out_of_the_time_loop(stock):
    keras_amp.enable("mixed_bfloat16")
    layer = keras.layers.LSTM(UNITS) if stock else LSTM(UNITS)
    inp = keras.Input((5, 3))
    model = keras.Model(inp, layer(inp))
    if stock:
        keras_amp.apply_recipe(model, "rnn")
    graph = tf.function(model).get_concrete_function(tf.TensorSpec((2, 5, 3))).graph
    kernel_shapes = {tuple(w.shape) for w in layer.cell.weights if len(w.shape) == 2}

    def kernel_casts(g):
        return [op for op in g.get_operations() if op.type == "Cast"
                and op.outputs[0].dtype == tf.bfloat16 and tuple(op.outputs[0].shape) in kernel_shapes]

    bodies = list(while_bodies(graph))
    assert bodies  # guard: the layer ran a tf.while_loop (control flow v2)
    assert all(not kernel_casts(body) for body in bodies)
    # Kernel and recurrent kernel, before the loop (Keras's TF `rnn` also runs the step once before
    # its loop, to learn the output structure: 2 more there).
    assert len(kernel_casts(graph)) == 4


@pytest.mark.parametrize("unroll", [False, True], ids=["loop", "unrolled"])
def test_weights_assigned_in_a_traced_training_loop_are_read_each_iteration(unroll):
    # A tf.range loop around the model (a custom training loop) may change the weights between its
    # iterations: reads are hoisted out of the RNN's own time loop only, never out of that one.
    keras_amp.enable("mixed_bfloat16")
    layer = keras.layers.LSTM(UNITS, unroll=unroll)
    inp = keras.Input((5, 3))
    model = keras_amp.apply_recipe(keras.Model(inp, layer(inp)), "rnn")
    x = tf.constant(_inputs()[:, :5])
    kernel = layer.cell.kernel

    @tf.function
    def run():
        outputs = tf.TensorArray(tf.float32, size=3)
        for i in tf.range(3):
            outputs = outputs.write(i, model(x))
            kernel.assign_add(tf.fill(kernel.shape, 0.05))
        return outputs.stack()

    start = kernel.numpy()
    traced = run().numpy()
    kernel.assign(start)
    expected = []
    for _ in range(3):
        expected.append(np64(model(x)))
        kernel.assign_add(np.full(kernel.shape, 0.05, "float32"))
    np.testing.assert_allclose(traced, np.stack(expected), rtol=0, atol=1e-6)
    assert np.abs(np.diff(traced, axis=0)).max() > 1e-3  # guard: the weights did change the outputs

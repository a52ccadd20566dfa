"""keras_amp.op_rules.fused_batch_norm: batch normalisation of a 16-bit activation, and of a float32
layer's activation in a mixed model, as TensorFlow's fused kernels; and the round-trip cast rule.

Numerics against float64 NumPy references (one 16-bit rounding of y, or float32 arithmetic alone;
float32 statistics); stock's float32-op path is held to the same bounds, so the two are shown
equivalent, not just close.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import hardware
from keras_amp.op_rules import fused_batch_norm, installer
from tests.helpers import live_ops

pytestmark = [
    pytest.mark.usefixtures("no_op_rules"),
    pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning"),  # float16 on a CPU
]

POLICIES = [pytest.param("mixed_bfloat16", id="bfloat16"), pytest.param("mixed_float16", id="float16")]
# A float32 layer in a model keras_amp runs in mixed_bfloat16 (the "cnn" recipe's stem, a per-layer rule).
WITH_FLOAT32 = [*POLICIES, pytest.param("float32", id="float32_layer")]
# One ulp at 1.0; for float32, the bound on float32 arithmetic over these sizes' reductions instead.
ULP = {"mixed_bfloat16": 2.0**-7, "mixed_float16": 2.0**-10, "float32": 2.0**-17}
DTYPE = {"mixed_bfloat16": tf.bfloat16, "mixed_float16": tf.float16, "float32": tf.float32}
EPSILON = 1e-3


def _reference(x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> dict:
    """float64 training-mode batch normalisation over every axis but the last: y, its gradients, the
    batch mean and biased variance."""
    axes = tuple(range(x.ndim - 1))
    n = x.size // x.shape[-1]
    mean, var = x.mean(axes), x.var(axes)
    inv = 1.0 / np.sqrt(var + EPSILON)
    xhat = (x - mean) * inv
    dxhat = dy * gamma
    dx = inv / n * (n * dxhat - dxhat.sum(axes) - xhat * (dxhat * xhat).sum(axes))
    return {"y": xhat * gamma + beta, "gamma": gamma, "dx": dx, "dgamma": (dy * xhat).sum(axes), "dbeta": dy.sum(axes),
            "mean": mean, "var": var, "xhat": xhat}


def _layer(shape, policy, **kwargs):
    bn = keras.layers.BatchNormalization(dtype=policy, momentum=0.5, epsilon=EPSILON, **kwargs)
    bn.build(shape)
    channels = shape[-1]
    bn.gamma.assign(np.linspace(0.5, 2.0, channels))
    bn.beta.assign(np.linspace(-1.0, 1.0, channels))
    return bn


def _step(bn, training=True):
    @tf.function(autograph=False)
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = bn(x, training=training)
        return [y] + tape.gradient(y, [x, bn.gamma, bn.beta], output_gradients=dy)

    return step


def _enable(policy):
    """keras_amp on, mixed: in `policy`, or in mixed_bfloat16 for a float32 layer."""
    keras_amp.enable("mixed_bfloat16" if policy == "float32" else policy)


def _data(shape, policy, seed=0, loc=3.0, scale=2.0):
    dtype = DTYPE[policy]
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(loc, scale, shape), dtype)
    dy = tf.constant(rng.normal(0.0, 1.0, shape), dtype)
    return x, dy, np.asarray(tf.cast(x, tf.float64)), np.asarray(tf.cast(dy, tf.float64))


def _run(shape, policy, amp, seed=0, **kwargs):
    x, dy, x64, dy64 = _data(shape, policy, seed)
    if amp:
        _enable(policy)
    try:
        bn = _layer(shape, policy, **kwargs)
        step = _step(bn)
        out = [np.asarray(tf.cast(t, tf.float64)) for t in step(x, dy)]
        graph = step.get_concrete_function(x, dy).graph
        types = collections.Counter(op.type for op in graph.get_operations())
    finally:
        keras_amp.disable()
    ref = _reference(x64, dy64, bn.gamma.numpy().astype(np.float64), bn.beta.numpy().astype(np.float64))
    moving = (bn.moving_mean.numpy(), bn.moving_variance.numpy())
    return out, ref, moving, types


def _check(out, ref, moving, policy, what):
    y, dx, dgamma, dbeta = out
    # y: one 16-bit rounding of the float32 result (half an ulp of |y|), plus float32 arithmetic, plus
    # the float32 mean's error (a few ulps of |mean|; Keras's moments and the kernels alike), which y
    # carries as |mean| / std times gamma: 32 ulps allowed. Statistics taken as E[x^2] - E[x]^2 would
    # be |mean| / std times further off (test_large_mean_small_spread_keeps_float32_statistics).
    conditioning = np.abs(ref["mean"]) / np.sqrt(ref["var"] + EPSILON) * np.abs(ref["gamma"])
    bound = ULP[policy] / 2 * np.abs(ref["y"]) + 1e-5 * (np.abs(ref["xhat"]) + 1.0) * 2.0 + 32 * 2.0**-24 * conditioning
    assert np.all(np.abs(y - ref["y"]) <= bound), f"{what}: y off by {np.abs(y - ref['y']).max():.3g}"
    # dx: one rounding of the result, relative to its largest entry (cancelling terms).
    err = np.abs(dx - ref["dx"]).max() / np.abs(ref["dx"]).max()
    assert err <= ULP[policy], f"{what}: dx relative error {err:.3g}"
    # d gamma = sum(dy xhat) carries the mean's error (above) times sum(dy) / std.
    mean_term = 32 * 2.0**-24 * np.abs(ref["mean"]) / np.sqrt(ref["var"] + EPSILON) * np.abs(ref["dbeta"])
    assert np.all(np.abs(dgamma - ref["dgamma"]) <= 1e-4 * np.abs(ref["dgamma"]) + 1e-4 * np.abs(ref["dgamma"]).max()
                  + mean_term), f"{what}: d gamma off by {np.abs(dgamma - ref['dgamma']).max():.3g}"
    np.testing.assert_allclose(dbeta, ref["dbeta"], rtol=1e-5, atol=1e-5 * np.abs(ref["dbeta"]).max())
    np.testing.assert_allclose(moving[0], 0.5 * ref["mean"], rtol=1e-6, atol=1e-6)
    # float32 variance: at |mean| / std = 200 both TensorFlow's float32 moments (stock) and the fused
    # kernel are a few 1e-5 off (relative), far below what one 16-bit rounding of y amounts to.
    np.testing.assert_allclose(moving[1], 0.5 + 0.5 * ref["var"], rtol=1e-4)


@pytest.mark.parametrize("policy", WITH_FLOAT32)
@pytest.mark.parametrize("shape", [(64, 6), (8, 12, 5), (8, 9, 7, 6), (4, 3, 5, 4, 6)], ids=["2d", "3d", "4d", "5d"])
def test_layer_runs_the_fused_kernels_within_one_rounding_of_float64_as_stock_does(policy, shape):
    ours, ref, moving, types = _run(shape, policy, amp=True)
    assert types["FusedBatchNormV3"] == 2 and types["FusedBatchNormGradV3"] == 1, types
    _check(ours, ref, moving, policy, "keras_amp")
    stock, ref_s, moving_s, stock_types = _run(shape, policy, amp=False)
    assert stock_types["FusedBatchNormV3"] == 0
    _check(stock, ref_s, moving_s, policy, "stock")  # the same bounds hold for Keras's float32 ops


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32"], ids=["bfloat16", "float32_layer"])
def test_large_mean_small_spread_keeps_float32_statistics(policy):
    # |mean| >> std: 16-bit statistics would cancel, and so would float32 ones taken as E[x^2] - E[x]^2;
    # the fused kernels keep them in float32, centred as Keras's moments are.
    # Stock's float32 ops are held to the same bounds.
    shape = (256, 4, 4, 8)
    x, dy, x64, dy64 = _data(shape, policy, loc=200.0, scale=1.0)
    for amp in (True, False):
        if amp:
            _enable(policy)
        try:
            bn = _layer(shape, policy)
            step = _step(bn)
            assert _graph_types(step, x, dy)["FusedBatchNormGradV3"] == (1 if amp else 0)
            out = [np.asarray(tf.cast(t, tf.float64)) for t in step(x, dy)]
        finally:
            keras_amp.disable()
        ref = _reference(x64, dy64, bn.gamma.numpy().astype(np.float64), bn.beta.numpy().astype(np.float64))
        _check(out, ref, (bn.moving_mean.numpy(), bn.moving_variance.numpy()), policy,
               f"{'keras_amp' if amp else 'stock'}, loc 200")


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32"], ids=["bfloat16", "float32_layer"])
def test_step_runs_no_full_size_arithmetic_or_cast_beside_the_kernels(policy):
    # Full-size live ops of one training step (y, dx, d gamma, d beta), stock against keras_amp. Ours
    # are the two kernels forward and one backward, with reshapes and identities (no copies): no
    # upcast, no cast pair for the gradient (the rules differentiate x16 itself), no arithmetic.
    shape = (4, 6, 6, 8)
    x, dy, _, _ = _data(shape, policy)
    counts = {}
    for amp in (False, True):
        if amp:
            _enable(policy)
        try:
            graph = _step(_layer(shape, policy)).get_concrete_function(x, dy).graph
        finally:
            keras_amp.disable()
        counts[amp] = collections.Counter(op.type for op in live_ops(graph)
                                          if op.outputs and op.outputs[0].shape == shape)
    assert counts[False]["SquaredDifference"] == 1, counts[False]
    assert counts[False]["Cast"] >= (2 if policy != "float32" else 0), counts[False]
    moves = {"Placeholder", "Identity", "IdentityN", "Reshape"}
    assert {k: v for k, v in counts[True].items() if k not in moves} == {
        "FusedBatchNormV3": 2, "FusedBatchNormGradV3": 1}, counts[True]


def test_relu_after_the_layer_reads_the_kernels_y_directly():
    # TensorFlow's remapper fuses FusedBatchNormV3 + Relu (`_FusedBatchNormEx`, oneDNN on a CPU: Relu
    # applied to the float32 result before its one rounding, so the same numbers) only where the Relu
    # reads the kernel's y; identities are forwarded first, a Reshape between them is not.
    shape = (4, 6, 6, 8)
    x, _, x64, _ = _data(shape, "mixed_bfloat16")
    _enable("mixed_bfloat16")
    try:
        bn = _layer(shape, "mixed_bfloat16")
        relu = keras.layers.ReLU(dtype="mixed_bfloat16")
        step = tf.function(lambda x: relu(bn(x, training=True)), autograph=False)
        y = np.asarray(tf.cast(step(x), tf.float64))
        graph = step.get_concrete_function(x).graph
    finally:
        keras_amp.disable()
    (relu_op,) = [op for op in graph.get_operations() if op.type == "Relu"]
    t = relu_op.inputs[0]
    while t.op.type == "IdentityN":
        t = t.op.inputs[t.value_index]
    assert t.op.type == "FusedBatchNormV3" and t.value_index == 0, t
    ref = _reference(x64, np.zeros(shape), bn.gamma.numpy().astype(np.float64), bn.beta.numpy().astype(np.float64))
    bound = ULP["mixed_bfloat16"] / 2 * np.abs(ref["y"]) + 1e-5 * (np.abs(ref["xhat"]) + 1.0) * 2.0
    assert np.all(np.abs(y - np.maximum(ref["y"], 0.0)) <= bound)


@pytest.mark.parametrize("policy", WITH_FLOAT32)
@pytest.mark.parametrize("frozen", [False, True], ids=["inference", "frozen_layer_in_training"])
def test_moving_statistics_run_the_fused_kernels_within_one_rounding(policy, frozen):
    shape = (8, 5, 6, 4)
    x, dy, x64, dy64 = _data(shape, policy, seed=2)
    _enable(policy)
    try:
        bn = _layer(shape, policy)
        bn.moving_mean.assign(np.linspace(2.0, 4.0, 4))
        bn.moving_variance.assign(np.linspace(1.0, 5.0, 4))
        bn.trainable = not frozen  # frozen: training=True still normalises with the moving statistics
        step = _step(bn, training=frozen)
        types = _graph_types(step, x, dy)
        y, dx, dgamma, dbeta = [np.asarray(tf.cast(t, tf.float64)) for t in step(x, dy)]
    finally:
        keras_amp.disable()
    assert types["FusedBatchNormV3"] == 1 and types["FusedBatchNormGradV3"] == 1, types
    g, b = bn.gamma.numpy().astype(np.float64), bn.beta.numpy().astype(np.float64)
    m, v = np.linspace(2.0, 4.0, 4), np.linspace(1.0, 5.0, 4)
    r = 1.0 / np.sqrt(v + EPSILON)
    ref = (x64 - m) * r * g + b
    assert np.all(np.abs(y - ref) <= ULP[policy] / 2 * np.abs(ref) + 1e-5 * (np.abs(x64) + 1.0)), np.abs(y - ref).max()
    ref_dx = dy64 * g * r
    assert np.all(np.abs(dx - ref_dx) <= ULP[policy] / 2 * np.abs(ref_dx) + 1e-6), np.abs(dx - ref_dx).max()
    np.testing.assert_allclose(dgamma, (dy64 * (x64 - m) * r).sum((0, 1, 2)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dbeta, dy64.sum((0, 1, 2)), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), np.linspace(2.0, 4.0, 4).astype(np.float32))


def test_given_statistics_get_their_own_gradients():
    # Statistics that are not the batch's (any per-channel tensors) are inputs with gradients.
    x, dy, x64, dy64 = _data((16, 3, 5), "mixed_bfloat16", seed=4)
    m64, v64, g64, b64 = np.linspace(2, 4, 5), np.linspace(0.5, 3, 5), np.linspace(0.5, 2, 5), np.linspace(-1, 1, 5)
    stats = [tf.constant(t, tf.float32) for t in (m64, v64, g64, b64)]

    @tf.function(autograph=False)
    def grads(x, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, *stats])
            y = keras.ops.batch_normalization(
                keras.ops.cast(x, "float32"), stats[0], stats[1], axis=-1, scale=stats[2], offset=stats[3],
                epsilon=EPSILON)
            value = tf.reduce_sum(tf.cast(keras.ops.cast(y, "bfloat16"), tf.float32) * tf.cast(dy, tf.float32))
        return tape.gradient(value, [x, *stats])

    keras_amp.enable("mixed_bfloat16")
    try:
        assert _graph_types(grads, x, dy)["FusedBatchNormGradV3"] == 1
        dx, dm, dv, dg, db = [np.asarray(tf.cast(t, tf.float64)) for t in grads(x, dy)]
    finally:
        keras_amp.disable()
    r, axes = 1.0 / np.sqrt(v64 + EPSILON), (0, 1)
    centred = (dy64 * (x64 - m64)).sum(axes)
    np.testing.assert_allclose(dx, dy64 * g64 * r, rtol=2.0**-8, atol=1e-6)
    np.testing.assert_allclose(dm, -g64 * r * dy64.sum(axes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv, -0.5 * g64 * r**3 * centred, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dg, centred * r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, dy64.sum(axes), rtol=1e-5, atol=1e-5)


def _moments_and_normalize(x, mean_shift=0.0, axis=-1):
    x32 = keras.ops.cast(x, "float32")
    axes = [a for a in range(len(x.shape)) if a != axis % len(x.shape)]
    mean, var = keras.ops.moments(x32, axes)
    y = keras.ops.batch_normalization(x32, mean + mean_shift if mean_shift else mean, var, axis=axis, epsilon=EPSILON)
    return keras.ops.cast(y, x.dtype), mean, var


def _graph_types(fn, *args):
    fn = fn if hasattr(fn, "get_concrete_function") else tf.function(fn, autograph=False)
    return collections.Counter(op.type for op in fn.get_concrete_function(*args).graph.get_operations())


def _check_shifted_gradient(fn, x, x64):
    """d/dx of sum(y * w), y = (x - mean(x) - 1) r(x), r = (var(x) + eps)^-1/2, against float64."""
    w64 = np.random.default_rng(6).normal(size=x64.shape)

    @tf.function(autograph=False)
    def grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = tf.reduce_sum(tf.cast(fn(x), tf.float32) * w64.astype(np.float32))
        return tape.gradient(value, x)

    axes, n = tuple(range(x64.ndim - 1)), x64.size // x64.shape[-1]
    mu = x64.mean(axes)
    r = 1.0 / np.sqrt(x64.var(axes) + EPSILON)
    ref = r * w64 - r / n * w64.sum(axes) - r**3 / n * (x64 - mu) * (w64 * (x64 - mu - 1.0)).sum(axes)
    ours = np.asarray(tf.cast(grad(x), tf.float64))
    # Two roundings: the normalisation's 16-bit dx, then its sum with the moments' term.
    assert np.abs(ours - ref).max() <= 2 * 2.0**-8 * np.abs(ref).max(), np.abs(ours - ref).max()


@pytest.mark.parametrize("case", ["eager", "channels_first", "altered_mean", "16bit_input", "float64_input"])
def test_other_dataflow_runs_the_unfused_rules_and_stays_correct(case):
    x, _, x64, _ = _data((6, 4, 5, 3), "mixed_bfloat16", seed=3)
    shift = 1.0 if case == "altered_mean" else 0.0
    keras_amp.enable("mixed_bfloat16")
    try:
        if case == "eager":
            y, _, _ = _moments_and_normalize(x)
        elif case == "channels_first":
            assert _graph_types(lambda x: _moments_and_normalize(x, axis=1)[0], x)["FusedBatchNormV3"] == 0
            y = tf.function(lambda x: _moments_and_normalize(x, axis=1)[0])(x)
            x64 = np.moveaxis(x64, 1, -1)
            y = np.moveaxis(np.asarray(tf.cast(y, tf.float64)), 1, -1)
        elif case == "altered_mean":
            # Statistics that are not the batch's own: normalised as given ones (fixed-statistics
            # gradient), whose gradients reach the moments' closed form.
            fn = lambda x: _moments_and_normalize(x, mean_shift=1.0)[0]  # noqa: E731
            assert _graph_types(fn, x)["FusedBatchNormV3"] == 2
            y = tf.function(fn)(x)
            _check_shifted_gradient(fn, x, x64)
        else:  # a 16-bit or a float64 tensor passed directly: the kernels take neither
            x = tf.constant(x64) if case == "float64_input" else x
            fn = lambda x: keras.ops.moments(x, [0, 1, 2])  # noqa: E731
            assert _graph_types(fn, x)["FusedBatchNormV3"] == 0
            mean, var = tf.function(fn)(x)
            np.testing.assert_allclose(np.asarray(tf.cast(mean, tf.float64)), x64.mean((0, 1, 2)), rtol=2**-8)
            return
    finally:
        keras_amp.disable()
    axes = tuple(range(x64.ndim - 1))
    ref = (x64 - x64.mean(axes) - shift) / np.sqrt(x64.var(axes) + EPSILON)
    y = np.asarray(tf.cast(y, tf.float64))
    assert np.all(np.abs(y - ref) <= 2.0**-8 * np.abs(ref) + 1e-4), np.abs(y - ref).max()


def test_statistics_used_elsewhere_get_their_gradient_as_well():
    # The normalisation gives the moments no gradient (its own covers them); other consumers do.
    x, dy, x64, dy64 = _data((16, 3, 3, 4), "mixed_bfloat16", seed=5)
    a, b = np.linspace(-1, 1, 4), np.linspace(0.5, 2, 4)

    def loss(x):
        y, mean, var = _moments_and_normalize(x)
        return (tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(dy, tf.float32))
                + tf.reduce_sum(mean * a.astype(np.float32)) + tf.reduce_sum(var * b.astype(np.float32)))

    @tf.function(autograph=False)
    def grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = loss(x)
        return tape.gradient(value, x)

    keras_amp.enable("mixed_bfloat16")
    try:
        assert _graph_types(grad, x)["FusedBatchNormGradV3"] == 1
        ours = np.asarray(tf.cast(grad(x), tf.float64))
    finally:
        keras_amp.disable()
    n = x64.size // 4
    ref = _reference(x64, dy64, np.ones(4), np.zeros(4))
    expected = ref["dx"] + a / n + b * 2.0 * (x64 - ref["mean"]) / n
    err = np.abs(ours - expected).max() / np.abs(expected).max()
    assert err <= 2.0**-8, err


def test_fit_trains_a_convolutional_model_as_the_unfused_rules_do(monkeypatch):
    rng = np.random.default_rng(0)
    images, labels = rng.normal(2.0, 1.0, (64, 8, 8, 3)).astype("float32"), rng.integers(0, 4, 64)

    def train():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3, padding="same"), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(images, labels, batch_size=16, epochs=3, shuffle=False, verbose=0)
        batch = (tf.constant(images[:16]), tf.constant(labels[:16]))
        types = _graph_types(model.train_step, batch)  # the step fit ran, traced again (not run)
        return history.history["loss"], model.get_weights(), types

    keras_amp.enable("mixed_bfloat16")
    try:
        fused_loss, fused_weights, fused_types = train()
        monkeypatch.setattr(fused_batch_norm, "available", lambda: False)
        unfused_loss, unfused_weights, unfused_types = train()
    finally:
        keras_amp.disable()
    assert fused_types["FusedBatchNormGradV3"] == 1 and unfused_types["FusedBatchNormGradV3"] == 0
    assert fused_loss[-1] < fused_loss[0]
    np.testing.assert_allclose(fused_loss, unfused_loss, rtol=2e-2)
    for ours, theirs in zip(fused_weights, unfused_weights):
        np.testing.assert_allclose(ours, theirs, rtol=5e-2, atol=5e-3)


def test_available_on_cpus_only(monkeypatch):
    fused_batch_norm.available.cache_clear()
    try:
        monkeypatch.setattr(hardware, "detect", lambda: hardware.DeviceInfo(gpus=(hardware.GpuInfo("NVIDIA A100"),)))
        assert not fused_batch_norm.available()
        fused_batch_norm.available.cache_clear()
        monkeypatch.setattr(hardware, "detect", lambda: hardware.DeviceInfo(tpu_count=8))
        assert not fused_batch_norm.available()
        fused_batch_norm.available.cache_clear()
        monkeypatch.setattr(hardware, "detect", lambda: hardware.DeviceInfo(cpu_model="AMD EPYC"))
        assert fused_batch_norm.available()
    finally:
        fused_batch_norm.available.cache_clear()


CAST = installer.ORIGINALS["keras.src.backend.tensorflow.core.cast"]


def test_round_trip_cast_is_the_source_in_graph_mode_only():
    rule = fused_batch_norm.round_trip_cast(CAST)
    x16 = tf.constant([1.5, -2.25, 3e38], tf.bfloat16)
    seen = {}

    @tf.function(autograph=False)
    def f(x16):
        up = tf.cast(x16, tf.float32)
        seen["same"] = rule(up, "bfloat16") is x16
        seen["other dtype"] = rule(up, "float16").dtype == tf.float16
        seen["not an upcast"] = rule(up * 2.0, "bfloat16").op.type == "Cast"
        return rule(up, "bfloat16")

    np.testing.assert_array_equal(np.asarray(f(x16), np.float64), np.asarray(x16, np.float64))
    assert seen == {"same": True, "other dtype": True, "not an upcast": True}
    eager = rule(tf.cast(x16, tf.float32), "bfloat16")  # eager: TensorFlow's cast, the same values
    np.testing.assert_array_equal(np.asarray(eager, np.float64), np.asarray(x16, np.float64))


def test_round_trip_cast_passes_the_gradient_unchanged():
    rule = fused_batch_norm.round_trip_cast(CAST)
    x16 = tf.constant(np.linspace(-3, 3, 7), tf.bfloat16)

    @tf.function(autograph=False)
    def grads(x16):
        with tf.GradientTape() as tape:
            tape.watch(x16)
            y = rule(tf.cast(x16, tf.float32), "bfloat16")
            value = tf.reduce_sum(tf.cast(y, tf.float32) * tf.range(7, dtype=tf.float32))
        return tape.gradient(value, x16)

    np.testing.assert_array_equal(np.asarray(grads(x16), np.float64), np.arange(7.0))

"""The census's own audit (`census_models.audit_graph`) on hand-written graphs, so that a census
that passes means the 16-bit ops are absent, not that the walk missed them."""

import numpy as np
import pytest
import tensorflow as tf

import census_models

F16 = tf.float16


def _findings(fn, *args):
    return census_models.audit_graph(tf.function(fn).get_concrete_function(*args).graph)


def _low(findings):
    return [f for f in findings if f.kind == "norm" or f.dtype in ("float16", "bfloat16")]


QK = (tf.TensorSpec((2, 4, 8), F16), tf.TensorSpec((2, 4, 8), F16))


def test_finds_16bit_scores_under_a_float32_softmax():
    def attention(q, k):
        scores = tf.einsum("bqd,bkd->bqk", q, k) * tf.constant(0.35, F16)
        return tf.reduce_sum(tf.nn.softmax(tf.cast(scores, tf.float32)))

    findings = _findings(attention, *QK)
    assert [(f.kind, f.op_type, f.dtype) for f in findings] == [("qk", "Einsum", "float16"), ("softmax", "Softmax", "float32")]


def test_finds_a_16bit_softmax_and_matmul_scores_through_reshapes_and_masks():
    def attention(q, k):
        scores = tf.matmul(q, k, transpose_b=True)
        scores = tf.where(tf.linalg.band_part(tf.ones((4, 4), tf.bool), -1, 0), scores, tf.constant(-1e4, F16))
        return tf.reduce_sum(tf.nn.softmax(tf.reshape(scores, (2, 16))))

    kinds = sorted((f.kind, f.op_type, f.dtype) for f in _low(_findings(attention, *QK)))
    assert kinds == [("qk", "BatchMatMulV2", "float16"), ("softmax", "Softmax", "float16")]


def test_finds_16bit_scores_through_a_key_bias_add():
    # keras_amp's bias rule turns `ops.add(scores, key_bias)` into a BiasAdd: the walk passes it.
    def attention(q, k, key_bias):
        scores = tf.nn.bias_add(tf.einsum("bqd,bkd->bqk", q, k), key_bias)
        return tf.reduce_sum(tf.nn.softmax(scores))

    findings = _findings(attention, *QK, tf.TensorSpec((4,), F16))
    assert sorted((f.kind, f.op_type, f.dtype) for f in findings) == [("qk", "Einsum", "float16"),
                                                                       ("softmax", "Softmax", "float16")]


def test_dead_16bit_ops_do_not_count():
    # keras_amp's rules leave the 16-bit originals unused beside the float32 rebuild.
    def attention(q, k):
        tf.nn.softmax(tf.einsum("bqd,bkd->bqk", q, k))  # dead
        tf.math.rsqrt(tf.reduce_mean(tf.square(q), axis=-1))  # dead
        scores = tf.einsum("bqd,bkd->bqk", tf.cast(q, tf.float32), tf.cast(k, tf.float32))
        return tf.reduce_sum(tf.nn.softmax(scores))

    findings = _findings(attention, *QK)
    assert _low(findings) == []
    assert [(f.kind, f.dtype) for f in findings] == [("qk", "float32"), ("softmax", "float32")]


def test_follows_nested_xla_calls_and_custom_gradient():
    # keras_amp's float32 scores: an XLA-compiled function, wrapped in tf.custom_gradient (IdentityN).
    @tf.function(jit_compile=True)
    def scores_f32(q, k):
        return tf.einsum("bqd,bkd->bqk", tf.cast(q, tf.float32), tf.cast(k, tf.float32))

    @tf.custom_gradient
    def scores(q, k):
        def grad(g):
            return tf.cast(tf.einsum("bqk,bkd->bqd", g, tf.cast(k, tf.float32)), F16), tf.zeros_like(k)

        return scores_f32(q, k), grad

    def step(q, k):
        with tf.GradientTape() as tape:
            tape.watch(q)
            loss = tf.reduce_sum(tf.nn.softmax(scores(q, k)) * tf.range(4.0))
        return loss, tape.gradient(loss, q)

    findings = _findings(step, *QK)
    assert _low(findings) == []
    assert [(f.kind, f.op_type, f.dtype) for f in findings] == [("qk", "Einsum", "float32"), ("softmax", "Softmax", "float32")]
    assert "PartitionedCall" in findings[0].path  # guard: found inside the called body


def test_a_weight_times_activations_is_not_qk():
    kernel = tf.Variable(np.ones((8, 4), "float16"))

    def classifier(x):
        return tf.reduce_sum(tf.nn.softmax(tf.cast(tf.matmul(x, kernel), tf.float32)))

    findings = _findings(classifier, tf.TensorSpec((2, 8), F16))
    assert [(f.kind, f.dtype) for f in findings] == [("softmax", "float32")]


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_finds_16bit_norm_statistics_forward_and_backward(dtype):
    def rms_norm_loss(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + tf.constant(1e-6, dtype))
            z = x / tf.sqrt(tf.reduce_mean(tf.math.squared_difference(x, tf.reduce_mean(x)), axis=-1, keepdims=True))
            loss = tf.reduce_sum(tf.cast(y + z, tf.float32))
        return loss, tape.gradient(loss, x)

    ops = sorted(f.op_type for f in _findings(rms_norm_loss, tf.TensorSpec((2, 8), dtype)))
    assert ops == sorted(["Rsqrt", "RsqrtGrad", "Sqrt", "SquaredDifference"])


def test_a_root_of_a_constant_is_not_a_norm():
    # VideoPrism scales its queries by rsqrt(key_dim) in the compute dtype.
    def scaled(x):
        x = x * tf.math.rsqrt(tf.constant(8.0, F16))
        return tf.reduce_sum(tf.cast(x / tf.sqrt(tf.constant(8.0, F16)), tf.float32))

    assert _findings(scaled, tf.TensorSpec((2, 8), F16)) == []


@pytest.mark.parametrize("policy", census_models.POLICIES)
def test_finds_what_stock_keras_runs_in_16_bits_on_a_census_model(policy):
    # Guard against a vacuous census: without keras_amp, GPT-NeoX's QK^T runs in 16 bits under a
    # float32 softmax and T5's RMS norms take 16-bit roots.
    import keras

    keras.config.set_dtype_policy(policy)  # conftest restores it
    low = {}
    for name in ("gpt_neo_x", "t5"):
        case = next(c for c in census_models.CASES if c.name == name)
        model = case.build()
        x, y = census_models._tensors(census_models.batch(case, model))
        step = census_models.step_function(model, case.loss(), keras.optimizers.SGD())
        low[name] = {(f.kind, f.op_type) for f in _low(census_models.audit_graph(step.get_concrete_function(x, y).graph))}
    assert low["gpt_neo_x"] == {("qk", "BatchMatMulV2")}, low
    assert ("norm", "Rsqrt") in low["t5"], low


# Backbone classes exported by keras_hub.models that are not a family: a base other backbones extend.
_BASES = {"feature_pyramid_backbone": "FeaturePyramidBackbone, the base class of backbones with pyramid outputs"}


def test_every_keras_hub_backbone_family_is_in_the_census_or_skipped_with_a_reason():
    import keras_hub

    families = {}
    for name in dir(keras_hub.models):
        obj = getattr(keras_hub.models, name)
        if isinstance(obj, type) and issubclass(obj, keras_hub.models.Backbone) and obj is not keras_hub.models.Backbone:
            families.setdefault(obj.__module__.split(".")[3], []).append(name)  # keras_hub.src.models.<family>
    assert len(families) >= 60  # guard: the walk found keras-hub's families
    covered = {c.name for c in census_models.CASES} | {k.split("/")[0] for k in census_models.SKIPPED} | set(_BASES)
    missing = {f: names for f, names in families.items() if f not in covered}
    assert not missing, f"keras-hub families neither in the census nor skipped: {missing}"


def test_readme_census_table_is_what_the_census_runs():
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert census_models.census_markdown().strip() in readme

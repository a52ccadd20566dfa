"""audit_model: the dtype each sensitive op really ran in, by layer path, for any kind of model."""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import op_rules
from keras_amp.diagnostics import audit

pytestmark = [
    pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning"),
    pytest.mark.usefixtures("no_op_rules"),
]
# What the op rules promise to keep out of 16 bits (reductions are reported but not promised).
PROMISED = {"attention", "softmax", "normalization", "exp", "loss"}


def bert():
    model = keras_hub.models.BertBackbone(
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=16
    )
    rng = np.random.RandomState(0)
    x = {
        "token_ids": rng.randint(0, 50, (2, 8)),
        "padding_mask": np.ones((2, 8), "int32"),
        "segment_ids": np.zeros((2, 8), "int32"),
    }
    return model, x


class Transformer(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(50, 16)
        self.attention = keras.layers.MultiHeadAttention(2, 8)
        self.norm = keras.layers.LayerNormalization()
        self.head = keras.layers.Dense(16)

    def call(self, x):
        h = self.embedding(x)
        return self.head(self.norm(h + self.attention(h, h)))


def subclassed():
    return Transformer(name="transformer"), np.random.RandomState(0).randint(0, 50, (2, 8))


def functional():
    inp = keras.Input((8, 16))
    a = keras.layers.MultiHeadAttention(2, 8, name="mha")(inp, inp)
    x = keras.layers.LayerNormalization(name="ln")(inp + a)
    return keras.Model(inp, keras.layers.Dense(4)(x)), np.random.RandomState(0).rand(2, 8, 16).astype("float32")


def promised(report):
    return sorted({(r.category, r.layer_path, r.op_type) for r in report.low_precision() if r.category in PROMISED})


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("build", [bert, subclassed, functional], ids=["bert", "subclassed", "functional"])
def test_no_sensitive_op_in_16_bits_under_enable_and_stock_has_them(policy, build):
    keras_amp.enable(policy)
    model, x = build()
    report = audit.audit_model(model, x)
    # Forward and backward ops, by layer (the subclassed model is unbuilt until the audit runs it).
    assert {r.phase for r in report.records if r.layer_path} == {"forward", "backward"}
    assert promised(report) == [], str(report)
    # ... and not because the audit lost sight of QK^T: it is seen, computing in float32
    # (through the IdentityN that tf.custom_gradient puts between it and the softmax).
    assert any(r.category == "attention" and r.dtype == "float32" for r in report.records), str(report)
    op_rules.uninstall()  # stock Keras under the same policy
    stock_report = audit.audit_model(model, x)
    stock = promised(stock_report)
    compute = keras_amp.config().compute_dtype
    assert stock and all(r.dtype == compute for r in stock_report.low_precision())
    # Every stock model computes its attention scores (QK^T) in 16 bits.
    assert any(kind == "attention" for kind, _, _ in stock), stock


def test_bert_stock_findings_name_the_layers():
    keras_amp.enable("mixed_float16")
    op_rules.uninstall()
    model, x = bert()
    stock = promised(audit.audit_model(model, x))
    assert ("attention", "transformer_layer_0/self_attention_layer", "BatchMatMulV2") in stock
    assert any(  # the MHA's Softmax sublayer (its auto-generated name carries a counter)
        kind == "softmax" and path.startswith("transformer_layer_0/self_attention_layer/softmax") and op == "Softmax"
        for kind, path, op in stock
    )
    assert ("exp", "transformer_layer_0/feedforward_intermediate_dense", "Pow") in stock  # gelu's x**3


class RawOps(keras.layers.Layer):
    """A layer that calls TensorFlow directly, inside a while loop too: no op rule reaches it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x):
        self.calls.assign_add(1.0)
        y = tf.nn.log_softmax(x)

        def body(i, v):
            return i + 1, tf.nn.softmax(v)

        _, z = tf.while_loop(lambda i, v: i < 2, body, (tf.constant(0), x))
        return y + z


def test_paths_phases_loops_and_that_the_batch_runs():
    keras_amp.enable("mixed_float16")
    inner = keras.Sequential([keras.layers.Dense(8, name="d"), RawOps(name="raw")], name="inner")
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(4, name="out")(inner(inp)), name="outer")
    x = np.random.RandomState(0).rand(2, 8).astype("float32")
    raw = inner.get_layer("raw")
    report = audit.audit_model(model, x)
    assert float(raw.calls.numpy()) == 1.0  # the batch really ran, once
    low = {(r.category, r.layer_path, r.op_type, r.phase) for r in report.low_precision()}
    assert ("softmax", "inner/raw", "LogSoftmax", "forward") in low  # raw tf.* calls are seen
    assert any(r.op_type == "Softmax" and "/while/" in r.op_name and r.layer_path == "inner/raw"
               for r in report.low_precision())  # inside the loop body
    assert ("exp", "inner/raw", "Exp", "backward") in low  # LogSoftmax's gradient, float16
    assert all(r.dtype == "float16" for r in report.low_precision())
    text = str(report)
    assert text.startswith("audit_model('outer'):") and "[softmax] inner/raw: LogSoftmax in float16 (forward)" in text
    forward_only = audit.audit_model(model, x, backward=False)
    assert {r.phase for r in forward_only.records} == {"forward"}


def test_a_dense_head_softmax_is_not_taken_for_attention():
    keras_amp.enable("mixed_bfloat16")
    op_rules.uninstall()
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(4, activation="softmax", name="probs")(inp))
    low = audit.audit_model(model, np.ones((2, 8), "float32")).low_precision()
    assert [(r.category, r.layer_path) for r in low] == [("softmax", "probs")]


@tf.function(jit_compile=True)
def _compiled_scores(q, k):
    return tf.einsum("btd,bsd->bts", q, k)


@tf.function(jit_compile=True)
def _compiled_matmul(x, kernel):
    return tf.matmul(tf.cast(x, tf.float32), tf.cast(kernel, tf.float32))


class CompiledScores(keras.layers.Layer):
    """QK^T inside an XLA-compiled call (as keras_amp's float32 scores run), optionally 16-bit."""

    def __init__(self, float32, **kwargs):
        super().__init__(**kwargs)
        self.float32 = float32

    def call(self, x):
        q = tf.cast(x, tf.float32) if self.float32 else x
        return tf.nn.softmax(_compiled_scores(q, q))


class CompiledHead(keras.layers.Dense):
    """A Dense whose matmul runs in a compiled call: its weight is a call argument, not QK^T."""

    def call(self, x):
        return tf.nn.softmax(_compiled_matmul(x, keras.ops.cast(self.kernel, self.compute_dtype)))


@pytest.mark.parametrize("float32", [True, False])
def test_qk_inside_a_compiled_call_is_seen_in_the_dtype_its_body_computes(float32):
    keras_amp.enable("mixed_bfloat16")
    op_rules.uninstall()
    inp = keras.Input((4, 8))
    model = keras.Model(inp, CompiledScores(float32, name="scores")(inp))
    report = audit.audit_model(model, np.ones((2, 4, 8), "float32"))
    attention = [r for r in report.records if r.category == "attention"]
    # The einsum inside the call body, named through the call and owned by the calling layer;
    # its dtype is the body's (bfloat16 operands cast to float32 there) not the call's inputs.
    assert [(r.op_type, r.layer_path, r.dtype) for r in attention] == [
        ("Einsum", "scores", "float32" if float32 else "bfloat16")
    ], str(report)
    assert "PartitionedCall" in attention[0].op_name and attention[0].op_name.endswith("/Einsum")
    low = sorted((r.category, r.layer_path) for r in report.low_precision())
    assert low == ([] if float32 else [("attention", "scores"), ("softmax", "scores")]), str(report)


def test_a_weight_passed_into_a_compiled_call_is_not_taken_for_attention():
    keras_amp.enable("mixed_bfloat16")
    op_rules.uninstall()
    inp = keras.Input((8,))
    model = keras.Model(inp, CompiledHead(4, name="head")(inp))
    report = audit.audit_model(model, np.ones((2, 8), "float32"))
    assert not [r for r in report.records if r.category == "attention"], str(report)
    assert any(r.op_type == "Softmax" and r.layer_path == "head" for r in report.records)


class _TFSilu(keras.layers.Layer):
    """TensorFlow's own `tf.nn.silu` (keras.ops.silu is keras_amp's silu rule while enabled)."""

    def call(self, x):
        return tf.nn.silu(x)


def test_backward_ops_made_outside_the_gradient_scope_are_backward():
    # TF's silu gradient makes its Sums outside "gradient_tape/": by creation order they are
    # backward, not the 16-bit forward reductions a reading of name scopes took them for.
    keras_amp.enable("mixed_float16")
    inp = keras.Input((4,))
    model = keras.Model(inp, _TFSilu(name="silu")(keras.layers.Dense(4, name="d")(inp)))
    report = audit.audit_model(model, np.ones((2, 4), "float32"))
    sums = [r for r in report.records if r.op_type == "Sum" and r.dtype == "float16"]
    assert sums and not any(r.op_name.startswith("gradient_tape/") for r in sums)  # guard
    assert {r.phase for r in sums} == {"backward"}
    assert not [r for r in report.low_precision() if r.category == "reduction"]


class _Standardise(keras.layers.Layer):
    """(x - mean) / sqrt(var + eps) with keras.ops: no Rsqrt anywhere."""

    def call(self, x):
        mean = keras.ops.mean(x, axis=-1, keepdims=True)
        var = keras.ops.mean(keras.ops.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) / keras.ops.sqrt(var + 1e-6) + keras.ops.sqrt(keras.ops.abs(x))


def test_a_root_of_a_statistic_is_normalisation_any_other_sqrt_is_not():

    x = np.random.RandomState(0).normal(size=(2, 8)).astype("float32")
    keras.config.set_dtype_policy("mixed_float16")
    stock = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), _Standardise(name="standardise")])
    found = [r for r in audit.audit_model(stock, x).low_precision() if r.op_type == "Sqrt"]
    # One Sqrt is the statistic's root (recorded, in float16); sqrt(|x|) is not a statistic.
    assert [(r.category, r.layer_path, r.dtype) for r in found] == [("normalization", "standardise", "float16")]
    keras.config.set_dtype_policy("float32")
    keras_amp.enable("mixed_float16")
    ours = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), _Standardise(name="standardise")])
    records = [r for r in audit.audit_model(ours, x).records if r.op_type == "Sqrt" and r.phase == "forward"]
    assert records and all(r.category == "normalization" for r in records)  # guard: seen
    assert not [r for r in records if r.low_precision], records

"""keras_amp.diagnostics.evidence: check_model's op findings from the dynamic audit, on the user's batch
or a probe batch of ones."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import op_rules
from keras_amp.diagnostics import audit, check, evidence
from keras_amp.diagnostics.finding import Finding
from tests.helpers import Scaler

pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning")


class Block(keras.layers.Layer):
    """A composite layer: its sublayer runs in its own code, outside the model's graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16, name="dense")
        self.scaler = Scaler(name="scaler")

    def call(self, x):
        return self.scaler(self.dense(x))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_16_bit_normalisation_inside_a_layer_is_found_by_the_audit(policy):
    keras_amp.enable(policy)
    inp = keras.Input((16,))
    model = keras.Model(inp, keras.layers.Dense(8, dtype="float32")(Block(name="block")(inp)))
    dtype = keras_amp.config().compute_dtype
    for x in (None, np.random.RandomState(0).rand(2, 16).astype("float32")):  # a probe batch, then a real one
        report = check.check_model(model, x)
        (finding,) = report.of_kind("low_precision_normalization")
        assert finding.layer == "block/scaler" and f"Rsqrt, RsqrtGrad ran in {dtype}" in finding.message, str(report)
        # Reported once, as a normalisation (float16's 16-bit Mean is a reduction finding of its own).
        assert not [f for f in report.of_kind("low_precision_op") if f.message.startswith("normalization")]
    assert "probe batch of ones (2, 16)" in str(check.check_model(model))
    model.get_layer("block").dtype_policy = "float32"
    model.get_layer("block").scaler.dtype_policy = "float32"
    assert check.check_model(model).of_kind("low_precision_normalization") == []


def test_a_subclassed_model_without_input_specs_says_it_was_not_audited():
    keras_amp.enable("mixed_bfloat16")

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.block = Block(name="block")

        def call(self, x):
            return self.block(x)

    model = Net()
    x = np.ones((2, 16), "float32")
    model(x)
    report = check.check_model(model)
    assert not report.of_kind("low_precision_normalization") and "not audited" in report.notes[0]
    assert [f.layer for f in check.check_model(model, x).of_kind("low_precision_normalization")] == ["block/scaler"]


class RawSoftmax(keras.layers.Layer):
    """Calls TensorFlow directly: invisible to the static check, not reached by the op rules."""

    def call(self, x):
        return tf.nn.softmax(x)


class OpsSoftmax(keras.layers.Layer):
    def call(self, x):
        return keras.ops.softmax(x)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_batch_adds_the_ops_that_ran_in_16_bits(policy):
    keras_amp.enable(policy)
    x = np.random.RandomState(0).rand(2, 8).astype("float32")
    inp = keras.Input((8,))
    raw = keras.Model(inp, keras.layers.Dense(8, dtype="float32")(RawSoftmax(name="raw")(keras.layers.Dense(8)(inp))))
    assert not check.check_model(raw).of_kind("low_precision_softmax")  # statically invisible
    (finding,) = check.check_model(raw, x).of_kind("low_precision_op")
    dtype = keras_amp.config().compute_dtype
    assert finding.layer == "raw" and f"Softmax ran in {dtype} in the forward pass" in finding.message
    assert "raw tf.* calls" in finding.fix and "'raw': 'float32'" in finding.fix
    # keras.ops in the same place: the op rules compute it in float32; stock does not.
    model = keras.Model(inp, keras.layers.Dense(8, dtype="float32")(OpsSoftmax(name="ops")(keras.layers.Dense(8)(inp))))
    assert check.check_model(model, x).of_kind("low_precision_op") == []
    op_rules.uninstall()
    assert [f.layer for f in check.check_model(model, x).of_kind("low_precision_op")] == ["ops"]


def test_a_batch_reports_one_finding_per_layer_and_kind_for_stock_attention():
    keras_amp.enable("mixed_float16")
    op_rules.uninstall()
    inp = keras.Input((4, 8))
    mha = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="mha")
    model = keras.Model(inp, mha(inp, inp))
    x = np.random.RandomState(0).rand(2, 4, 8).astype("float32")
    found = [(f.layer, f.message.split(" op(s)")[0]) for f in check.check_model(model, x).of_kind("low_precision_op")]
    softmax_layer = f"mha/{mha._softmax.name}"
    assert sorted(found) == sorted([("mha", "attention"), (softmax_layer, "softmax")])
    assert check.KINDS.index("low_precision_op") < check.KINDS.index("output_not_float32")


def test_probe_batch_is_ones_shaped_like_the_inputs_with_unknown_dimensions_filled():
    seq, ids = keras.Input((None, 3), name="seq"), keras.Input((5,), dtype="int32", name="ids")
    model = keras.Model({"seq": seq, "ids": ids}, keras.layers.Dense(1)(seq))
    batch, note = evidence.probe_batch(model)
    assert {k: (tuple(t.shape), t.dtype.name) for k, t in batch.items()} == {
        "seq": ((2, 8, 3), "float32"), "ids": ((2, 5), "int32")}
    assert all(np.all(t.numpy() == 1) for t in batch.values())
    # keras.tree.flatten orders a dict by key: "ids" before "seq".
    assert note == "ops audited on a probe batch of ones (2, 5), (2, 8, 3); pass x= to audit your data's ops"
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert tuple(evidence.probe_batch(sequential)[0].shape) == (2, 4)


def test_no_probe_batch_says_why():
    class Net(keras.Model):
        def call(self, x):
            return x

    batch, note = evidence.probe_batch(Net())  # never called: no input specs
    assert batch is None and note.startswith("not audited: no batch given and the model records no input specs")
    text = keras.Input((1,), dtype="string")
    batch, note = evidence.probe_batch(keras.Model(text, text))
    assert batch is None and note.startswith("not audited: no probe batch for the model's inputs (")
    assert note.endswith("); pass x= for the op findings")


def _record(path, category, op_type, dtype="float16", phase="forward"):
    return audit.OpRecord(op_type, category, path, dtype, phase, f"{path}/{op_type}")


def test_one_finding_per_layer_and_category_naming_the_ops_dtypes_and_passes():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="net")
    report = audit.AuditReport("net", (
        _record("blk/sm", "softmax", "Softmax"),
        _record("blk/sm", "softmax", "Softmax", dtype="bfloat16", phase="backward"),
        _record("blk/sm", "softmax", "LogSoftmax"),
        _record("", "exp", "Exp"),  # outside every layer: the model's
        _record("mha", "attention", "BatchMatMulV2"),
        _record("norm", "normalization", "Rsqrt"),
        _record("blk/sm", "softmax", "Softmax", dtype="float32"),  # float32: no hazard
        _record("blk/sm", "reduction", "Sum", phase="backward"),  # backward reductions are not
    ))
    static = [Finding("low_precision_normalization", "norm", "static", "fix")]
    found = {(f.layer, f.message): f.fix for f in evidence.audit_findings(model, report, static, probe=False)}
    softmax = ("blk/sm", "softmax op(s) LogSoftmax, Softmax ran in bfloat16/float16 in the forward and backward pass")
    attention = ("mha", "attention op(s) BatchMatMulV2 ran in float16 in the forward pass")
    exp = ("net", "exp op(s) Exp ran in float16 in the forward pass")
    assert sorted(found) == [softmax, attention, exp]  # "norm": its static normalisation finding says it
    assert "rules={'blk/sm': 'float32'}" in found[softmax] and "not raw tf.* calls" in found[softmax]
    assert found[attention].startswith("under keras_amp.enable() a traced step computes in float32 every matmul")
    kinds = {f.layer: f.kind for f in evidence.audit_findings(model, report, [], probe=False)}
    assert kinds["norm"] == "low_precision_normalization" and kinds["blk/sm"] == "low_precision_op"


def test_a_probe_batch_adds_only_what_no_static_finding_of_the_layer_or_above_says():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="net")
    report = audit.AuditReport("net", (_record("blk/sm", "softmax", "Softmax"), _record("other", "exp", "Exp")))
    static = [Finding("low_precision_softmax", "blk", "static", "fix")]
    with_batch = evidence.audit_findings(model, report, static, probe=False)
    assert [f.layer for f in with_batch] == ["blk/sm", "other"]  # the user's batch: every op found
    assert [f.layer for f in evidence.audit_findings(model, report, static, probe=True)] == ["other"]
    # A layer named like a prefix is not above it.
    static = [Finding("low_precision_softmax", "bl", "static", "fix")]
    assert [f.layer for f in evidence.audit_findings(model, report, static, probe=True)] == ["blk/sm", "other"]

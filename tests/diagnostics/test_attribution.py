"""keras_amp.diagnostics.attribution: each op of a traced step owned by the layer whose call created it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import model_graph, op_rules
from keras_amp.diagnostics import attribution, audit
from keras_amp.diagnostics.traced_step import DiagnosticStep

pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning")


def test_a_shared_layer_and_a_layer_named_like_its_uniquified_scope_are_told_apart():
    # "dense" (softmax) is called twice, then "dense_1" (exp) once: TF uniquifies a call's name
    # scope of "dense" to "dense_1", the scope a name-scope reading takes for the layer "dense_1".
    keras_amp.enable("mixed_float16")
    op_rules.uninstall()
    shared = keras.layers.Dense(4, activation="softmax", name="dense")
    other = keras.layers.Dense(4, activation="exponential", name="dense_1")
    inp = keras.Input((4,))
    model = keras.Model(inp, other(shared(shared(inp))), name="model")
    report = audit.audit_model(model, np.random.RandomState(0).rand(2, 4).astype("float32"))
    softmax = [r for r in report.low_precision() if r.op_type == "Softmax"]
    exp = [r for r in report.low_precision() if r.op_type == "Exp" and r.phase == "forward"]
    # Guard: the edge case is reached, one of dense's softmaxes sits under a "dense_1" scope.
    scopes = [r.op_name.split("/")[:-1] for r in softmax]
    assert any("dense_1" in s and "dense" not in s for s in scopes), [r.op_name for r in softmax]
    assert [r.layer_path for r in softmax] == ["dense", "dense"]  # both calls, the right layer
    assert [r.layer_path for r in exp] == ["dense_1"]
    # The softmax gradients' reductions too, one of them under "gradient_tape/.../dense_1/".
    assert {r.layer_path for r in report.records if r.phase == "backward" and r.op_type == "Sum"} == {"dense"}


def test_an_rnn_cell_owns_its_ops_inside_the_loop_and_the_loop_layer_the_rest():
    keras_amp.enable("mixed_float16")
    op_rules.uninstall()
    inp = keras.Input((3, 4))
    cell = keras.layers.SimpleRNNCell(4, activation="exponential", name="cell")
    model = keras.Model(inp, keras.layers.RNN(cell, name="rnn")(inp), name="model")
    report = audit.audit_model(model, np.ones((2, 3, 4), "float32"))
    exp = [r for r in report.low_precision() if r.op_type == "Exp" and r.phase == "forward"]
    assert any("/while/" in r.op_name for r in exp)  # guard: the cell really ran in the loop body
    assert {r.layer_path for r in exp} == {"rnn/cell"}
    # The gradient loop runs no layer call: its ops lead back to the cell's forward ops by name.
    trace = audit.trace(model, np.ones((2, 3, 4), "float32"))
    grad_body = [(name, path) for name, _, path, phase in audit.graph_ops(trace)
                 if phase == "backward" and "/while_grad/" in name]
    assert any(name.endswith("/Exp_grad/mul") and path == "rnn/cell" for name, path in grad_body)
    assert {path for _, path in grad_body} == {"rnn", "rnn/cell"}  # the loop's bookkeeping: rnn


def _shared_and_nested():
    """Model "m": a Dense "a" called twice, "blk/b" inside a Sequential, a float32 head."""
    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="a")
    h = keras.Sequential([keras.layers.Dense(3, name="b")], name="blk")(shared(shared(inp)))
    return keras.Model(inp, keras.layers.Dense(1, dtype="float32", name="head")(h), name="m")


def _traced(model):
    x = np.ones((2, 4), "float32")
    return DiagnosticStep(model, x, None, None, lambda trace, grads, reference, loss: loss).traced()


def test_forward_and_backward_ops_belong_to_the_layer_that_created_them():
    keras.config.set_dtype_policy("mixed_float16")
    trace = _traced(_shared_and_nested())
    forward = list(zip(trace.ops[:trace.backward_start], trace.owners))
    backward = list(zip(trace.ops[trace.backward_start:], trace.owners[trace.backward_start:]))
    assert [owner for op, owner in forward if op.type == "MatMul"] == ["a", "a", "blk/b", "head"]
    grads = [owner for op, owner in backward if op.type == "MatMul"]
    assert {owner: grads.count(owner) for owner in grads} == {"head": 2, "blk/b": 2, "a": 3}
    # The input's cast to float16 (made by Layer.__call__, outside "a"'s call) is "a"'s.
    assert [owner for op, owner in forward if op.type == "Cast" and op.inputs[0].op.name == "x"] == ["a"]
    assert [owner for op, owner in forward if op.type == "Placeholder" and op.name == "x"] == [attribution.INPUT]
    assert set(trace.owners[trace.model_end:trace.backward_start]) == {attribution.LOSS}
    # The shared layer's two kernel (and bias) gradients are summed outside every layer.
    assert {owner for op, owner in backward if op.type == "AddN"} == {attribution.GRADIENT_SUM}
    assert all(not op.name.startswith("gradient_tape/") for op, _ in forward)
    assert [tuple(t.shape) for t in trace.layer_outputs["a"]] == [(2, 4), (2, 4)]  # both calls
    assert trace.layer_dtypes == {"a": "float16", "blk": "float16", "blk/b": "float16", "head": "float32"}


def test_attributing_wraps_every_call_while_tracing_and_restores_them():
    model = _shared_and_nested()
    custom = model.get_layer("head")
    own = custom.call  # a call set on the instance itself must come back as it was

    def head_call(x):
        return own(x)

    object.__setattr__(custom, "call", head_call)
    targets = dict(model_graph.walk(model, operations=True))
    originals = {path: t.call for path, t in targets.items()}
    with attribution.attributing(model, attribution.Trace()):
        for path, target in targets.items():
            assert vars(target)["call"].__wrapped__ == originals[path], path
    assert set(targets) == {"a", "blk", "blk/b", "head"}
    assert vars(custom)["call"] is head_call
    assert [p for p, t in targets.items() if "call" in vars(t)] == ["head"]


def test_an_operator_node_of_a_functional_model_owns_its_ops_forward_and_backward():
    # `h * 2.0` between the layers is an operator node of the model's graph ("multiply"), no layer's.
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, name="a")(inp) * 2.0
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(h), name="m")
    trace = _traced(model)
    muls = [(i >= trace.backward_start, op.name.startswith("gradient_tape/mul/"), owner)
            for i, (op, owner) in enumerate(zip(trace.ops, trace.owners)) if op.type == "Mul"]
    # The step's own `loss * scale` is the loss's; its gradient, outside every layer, a gradient sum.
    assert sorted(muls) == [(False, False, attribution.LOSS), (False, False, "multiply"),
                            (True, False, "multiply"), (True, True, attribution.GRADIENT_SUM)]


def test_the_gradient_of_a_boundary_cast_belongs_to_the_layer_on_its_16_bit_side():
    # Layer.__call__ casts the float32 head's float16 input in the model's scope, outside every
    # layer's; the gradient of that cast (float32 down to float16, the gradient of blk/b's output)
    # is blk/b's: by what it casts, not by where it sits. The wider cast of x stays a's.
    keras.config.set_dtype_policy("mixed_float16")
    trace = _traced(_shared_and_nested())
    backward = list(zip(trace.ops[trace.backward_start:], trace.owners[trace.backward_start:]))
    casts = [(op, owner) for op, owner in backward
             if op.type == "Cast" and (op.inputs[0].dtype, op.outputs[0].dtype) == (tf.float32, tf.float16)]
    assert [owner for _, owner in casts] == ["blk/b"], [op.name for op, _ in casts]
    (op, _), = casts
    # Guard: the edge case is reached, the cast sits in the model's scope (no layer's) and casts the
    # gradient of head's input.
    assert op.name.rpartition("/")[0].rpartition("/")[0] == "gradient_tape/m_1", op.name
    assert trace.owners[trace.ops.index(op.inputs[0].op)] == "head"
    assert attribution.linked_owners(trace.ops, trace.owners, trace.ops.index(op), trace.backward_start,
                                     downstream=False) == ["head"]
    # The layers' own backward casts (float16 weight gradients to their float32 variables) stay theirs.
    assert {owner for op, owner in backward if op.type == "Cast"
            and (op.inputs[0].dtype, op.outputs[0].dtype) == (tf.float16, tf.float32)} == {"a", "blk/b"}

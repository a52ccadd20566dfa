"""ProgressivePrecision: policies change at the scheduled point, one retrace per change, state intact."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from auto_precision_models import regression_data, sensitive_model
from keras_amp.auto_precision import ProgressivePrecision, search_precision
from tests.helpers import WalkSpy, count_walks

X, Y = regression_data(n=64)


class TraceCounter(keras.Model):
    """Functional-style wrapper counting train_step traces (Python runs only while tracing)."""

    traces = 0

    def train_step(self, data):
        TraceCounter.traces += 1
        return super().train_step(data)


def _model():
    base = sensitive_model("mixed_bfloat16")
    model = TraceCounter(base.inputs, base.outputs, name="counted")
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


class Recorder(keras.callbacks.Callback):
    """Per step: the sensitive layer's policy, iterations, and the optimizer's variables."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        self.rows.append((
            self.model.get_layer("sensitive").dtype_policy.name,
            int(opt.iterations.numpy()),
            [v.numpy().copy() for v in opt.variables],
        ))


@pytest.mark.parametrize("unit, at, steps_before", [("step", 5, 5), ("epoch", 2, 8)], ids=["step", "epoch"])
def test_policies_change_at_schedule_with_one_retrace_and_state_intact(unit, at, steps_before):
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)  # 4 steps per epoch
    TraceCounter.traces = 0
    _model().fit(ds, epochs=3, verbose=0)
    baseline = TraceCounter.traces  # traces of a fit without any change
    model = _model()
    schedule = ProgressivePrecision({at: ["sensitive"]}, unit=unit)
    recorder = Recorder()  # runs after the schedule: sees the policy the step will use
    TraceCounter.traces = 0
    model.fit(ds, epochs=3, callbacks=[schedule, recorder], verbose=0)
    policies = [r[0] for r in recorder.rows]
    assert policies == ["mixed_bfloat16"] * steps_before + ["float32"] * (12 - steps_before)
    assert [(c.unit, c.at, c.layers) for c in schedule.changes] == [(unit, at, ("sensitive",))]
    assert baseline >= 1 and TraceCounter.traces == baseline + 1  # one retrace for the one change
    # Optimizer state carries over the switch: iterations continue, Adam moments are those the
    # last 16-bit step left (the step right before the switch ran with the old function).
    iterations = [r[1] for r in recorder.rows]
    assert iterations == list(range(12))
    before, after = recorder.rows[steps_before - 1][2], recorder.rows[steps_before][2]
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))  # a step happened in between
    # ... and nothing was reset: the moments at the switch are nonzero and finite.
    assert all(np.all(np.isfinite(v)) for v in after) and any(np.any(v != 0) for v in after[2:])


def test_from_search_raises_only_the_layers_the_search_keeps_float32():
    model = sensitive_model("mixed_bfloat16")
    result = search_precision(model, [(X[:32], Y[:32])], tolerance=0.01, batches=1, verbose=0)
    assert result.float32_layers == ("sensitive",)
    assert any(d.decision != "float32" and d.sensitivity.loss > 0 for d in result.layers)  # guard: 16-bit ones exist
    schedule = ProgressivePrecision.from_search(result, at=1)
    recorder = Recorder()
    model.fit(X, Y, batch_size=16, epochs=2, callbacks=[schedule, recorder], verbose=0)  # as the search measured it
    assert [r[0] for r in recorder.rows] == ["mixed_bfloat16"] * 4 + ["float32"] * 4
    assert [(c.unit, c.at, c.layers) for c in schedule.changes] == [("epoch", 1, ("sensitive",))]
    assert {model.get_layer(p).dtype_policy.name for p in ("d1", "out")} == {"mixed_bfloat16"}  # left as searched


def test_from_search_top_counts_the_chosen_layers_only():
    # A layer float32 because a chosen block holds it is not itself chosen: `top` had counted it, dropped
    # the block and raised its inner layer alone.
    model = sensitive_model("mixed_bfloat16")
    result = search_precision(model, [(X[:32], Y[:32])], tolerance=0.01, batches=1, verbose=0)
    sensitive = next(d for d in result.layers if d.path == "sensitive")
    inner = dataclasses.replace(sensitive, path="block/inner", reason="float32 with block")
    block = dataclasses.replace(sensitive, path="block")
    rows = (inner, block) + tuple(d for d in result.layers if d.path != "sensitive")
    fake = dataclasses.replace(result, layers=rows, float32_layers=("block",))
    assert ProgressivePrecision.from_search(fake, at=0, top=1).schedule[0][0].pattern == "block"


def test_from_search_with_no_float32_layer_has_nothing_to_raise():
    model = sensitive_model("mixed_bfloat16", sensitive=lambda name: keras.layers.Identity(name=name))
    result = search_precision(model, [(X[:32], Y[:32])], tolerance=0.05, batches=1, verbose=0)
    assert result.float32_layers == () and result.layers  # guard: candidates, all within tolerance in 16 bits
    with pytest.raises(ValueError, match=r"keeps no layer in float32.*Received: result.float32_layers=\(\)"):
        ProgressivePrecision.from_search(result, at=1)
    with pytest.raises(ValueError, match="top"):
        ProgressivePrecision.from_search(result, at=1, top=0)
    with pytest.raises(ValueError, match=r"`at` must be an integer >= 0\. Received: at=-1"):
        ProgressivePrecision.from_search(result, at=-1)


def test_unknown_layer_fails_loudly_before_any_step():
    # A later entry's typo had surfaced only when training reached it, the epochs before it lost.
    model = _model()
    with pytest.raises(ValueError, match=r"schedule\[3\] names no layer .*\['no_such_layer'\]"):
        model.fit(X, Y, batch_size=16, epochs=4, verbose=0,
                  callbacks=[ProgressivePrecision({0: ["sensitive"], 3: ["no_such_layer"]})])
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_step_change_inside_a_multi_step_execution_applies_before_it():
    # steps_per_execution=4: the batch hook runs before steps 0 and 4 only; a change at step 5 had
    # been left for a hook that never came.
    model = _model()
    model.compile(keras.optimizers.Adam(1e-2), "mse", steps_per_execution=4)
    schedule = ProgressivePrecision({5: ["sensitive"]}, unit="step")
    model.fit(X[:32], Y[:32], batch_size=4, epochs=1, verbose=0, callbacks=[schedule])  # 8 steps
    assert [(c.unit, c.at, c.layers) for c in schedule.changes] == [("step", 5, ("sensitive",))]
    assert model.get_layer("sensitive").dtype_policy.name == "float32"


def test_restarted_callbacks_in_another_order_each_restore_their_own_state(tmp_path):
    # States had been named by class and order: the step callback took the epoch one's changes.
    model = _model()
    by_epoch, by_step = ProgressivePrecision({1: ["sensitive"]}), ProgressivePrecision({100: ["d1"]}, unit="step")
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0, callbacks=[by_epoch, by_step])
    assert [c.at for c in by_epoch.changes] == [1] and by_step.changes == []  # guard
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    again = _model()
    again.load_weights(path)
    step_again, epoch_again = ProgressivePrecision({100: ["d1"]}, unit="step"), ProgressivePrecision({1: ["sensitive"]})
    for callback in (step_again, epoch_again):  # the other order
        callback.set_model(again)
    assert epoch_again.changes == by_epoch.changes and step_again.changes == []
    assert epoch_again._applied == {1} and step_again._applied == set()


def test_a_state_of_another_schedule_is_not_taken():
    schedule = ProgressivePrecision({4: ["d1"]}, unit="step")
    schedule.restore_state({"unit": "epoch", "applied": [1], "changes": [["epoch", 1, ["sensitive"]]]})
    assert schedule.changes == [] and schedule._applied == set()


def test_moving_an_rnn_cell_to_float32_moves_its_matmul16_recurrence_too():
    # The "rnn" recipe gives a generic RNN a Matmul16DTypePolicy and leaves its cell float32 (the
    # matmul rule reads the RNN's policy): a cell moved to float32 alone would keep 16-bit matmuls.
    import keras_amp

    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((6, 4))
    h = keras.layers.RNN(keras.layers.LSTMCell(8), return_sequences=True, name="rnn")(inp)
    model = keras_amp.apply_recipe(keras.Model(inp, keras.layers.Dense(1, name="out")(h)), "rnn")
    x = np.random.default_rng(0).normal(size=(2, 6, 4)).astype("float32")
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    before = np.asarray(model(x), np.float64)
    reference = keras.layers.RNN(keras.layers.LSTMCell(8, dtype="float32"), return_sequences=True, dtype="float32")
    reference.build((None, 6, 4))
    reference.set_weights(model.get_layer("rnn").get_weights())
    float32_out = np.asarray(reference(x), np.float64)  # no Matmul16 policy: float32 matmuls
    recurrent = lambda: np.asarray(model.get_layer("rnn")(x), np.float64)  # noqa: E731
    assert np.abs(recurrent() - float32_out).max() > 1e-5  # guard: 16-bit matmuls before the move
    assert model.get_layer("rnn").cell.dtype_policy.name == "float32"
    schedule = ProgressivePrecision({0: ["rnn/lstm_cell"]}, unit="step")
    schedule.set_model(model)
    schedule.on_train_begin()
    schedule.on_train_batch_begin(0)
    assert model.get_layer("rnn").dtype_policy.name == "float32"  # moved with its cell
    assert schedule.changes[0].layers == ("rnn",)  # the layer whose policy changed
    np.testing.assert_allclose(recurrent(), float32_out, rtol=1e-6, atol=1e-6)  # float32 matmuls now
    assert np.abs(np.asarray(model(x), np.float64) - before).max() > 0


def test_each_callback_hook_walks_the_model_at_most_once(monkeypatch):
    model = _model()
    schedule = ProgressivePrecision({1: ["sensitive"]}, unit="epoch")
    walked = count_walks(monkeypatch)
    spy = WalkSpy(walked)
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=3, callbacks=[schedule, spy], verbose=0)
    assert [(c.at, c.layers) for c in schedule.changes] == [(1, ("sensitive",))]  # guard: a change was made
    # The start checks every name with one read; epoch 1 applies the change with one; epoch 2 re-applies
    # (a no-op) with one.
    assert [(hook, n) for hook, n in spy.per_hook if n] == [("train_begin", 1), ("epoch_begin 1", 1),
                                                            ("epoch_begin 2", 1)], spy.per_hook

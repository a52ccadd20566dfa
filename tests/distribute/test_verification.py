"""keras_amp.distribute.verification in one process: verify(), VerifyPrecision, Keras's build order.

The cross-worker behaviour (a mismatch fails every worker, naming the field) runs on two worker
processes in test_distribute_multi_worker.py.
"""

import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp.distribute import VerifyPrecision, verification, verify

# float16 on a CPU without a fast float16 path: the warning is right, and beside the point here.
pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested on CPU")


class _Lazy(keras.Model):
    """Creates its only layer in build(): it exists only once Keras has built the model."""

    def build(self, input_shape):
        self.inner = keras.layers.Dense(1, name="lazy_dense")
        self.inner.build(input_shape)

    def call(self, x):
        return self.inner(x)


def _compiled(strategy):
    keras_amp.enable("mixed_float16")
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = _Lazy(name="lazy")
        model.compile(optimizer=keras_amp.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    return model


def _data():
    x = np.ones((8, 3), np.float32)
    return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4)


def test_verify_single_replica_returns_fields_of_global_policy_when_not_enabled():
    keras.config.set_dtype_policy("mixed_float16")
    fields = verify(tf.distribute.get_strategy())
    assert fields["policy"] == "mixed_float16" and fields["loss_scaling"] == "True"
    cfg = keras_amp.enable("mixed_bfloat16")
    assert verify(tf.distribute.get_strategy()) == cfg.fingerprint_fields()


def test_verify_adds_model_and_optimizer_fields():
    keras_amp.enable("mixed_bfloat16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")])
    fields = verify(tf.distribute.get_strategy(), model=model, optimizer=keras.optimizers.SGD())
    assert ["d", "mixed_bfloat16"] in json.loads(fields["layer_policies"])  # model_graph.walk paths, as the recipes
    assert fields["loss_scale"] == "none"


@pytest.mark.parametrize("stage", ["fit", "evaluate"])
def test_callback_sees_built_model_and_optimizer_under_a_strategy(stage):
    """Keras 3.15 builds model and optimizer (`_maybe_symbolic_build`) before on_train_begin /
    on_test_begin. VerifyPrecision relies on that order; this fails if Keras changes it."""
    model = _compiled(tf.distribute.MirroredStrategy(["/cpu:0"]))
    assert not model.built and not model.optimizer.built  # guard: nothing is built before fit
    seen = []
    probe = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: seen.append((model.built, model.optimizer.built)),
        on_test_begin=lambda logs: seen.append((model.built, model.optimizer.built)),
    )
    check = VerifyPrecision(timeout_seconds=30)
    if stage == "fit":
        model.fit(_data(), epochs=1, verbose=0, shuffle=False, callbacks=[check, probe])
    else:
        model.evaluate(_data(), verbose=0, callbacks=[check, probe])
    assert seen[0][0], "Keras no longer builds the model before the first callback"
    if stage == "fit":
        assert seen[0][1], "Keras no longer builds the optimizer before on_train_begin"
    # The lazily created layer and the loss-scale settings were part of the comparison.
    assert "lazy_dense" in check.fields["layer_policies"] and "mixed_float16" in check.fields["layer_policies"]
    assert "LossScaleOptimizer" in check.fields["loss_scale"]


def test_without_a_strategy_keras_builds_later():
    """Why the test above compiles under a strategy: with none, Keras defers the build to the
    first traced step, so at on_train_begin the model is still unbuilt (one replica: nothing to
    compare, so VerifyPrecision loses nothing)."""
    keras_amp.enable("mixed_float16")
    model = _Lazy(name="lazy")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    seen = []
    probe = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: seen.append(model.built))
    model.fit(_data(), epochs=1, verbose=0, shuffle=False, callbacks=[probe])
    assert seen == [False] and model.built


def test_callback_checks_at_fit_start_and_each_validation(monkeypatch):
    calls = []
    original = verification.verify

    def counting(strategy, **kwargs):
        calls.append(sorted(kwargs))
        return original(strategy, **kwargs)

    monkeypatch.setattr(verification, "verify", counting)
    model = _compiled(tf.distribute.MirroredStrategy(["/cpu:0"]))
    model.fit(_data(), validation_data=_data(), epochs=2, verbose=0, shuffle=False, callbacks=[VerifyPrecision()])
    assert len(calls) == 3  # on_train_begin + one on_test_begin per epoch's validation
    assert calls[0] == ["model", "optimizer", "timeout_seconds"]


def test_verify_argument_errors():
    strategy = tf.distribute.get_strategy()
    with pytest.raises(TypeError, match="`strategy` must be a tf.distribute.Strategy"):
        verify("mirrored")
    for bad, error in [(0, ValueError), (math.nan, ValueError), (True, TypeError), ("10", TypeError)]:
        with pytest.raises(error, match="timeout_seconds"):
            verify(strategy, timeout_seconds=bad)
        with pytest.raises(error, match="timeout_seconds"):
            VerifyPrecision(timeout_seconds=bad)
    with pytest.raises(TypeError, match=r"`model` must be a Keras model.*Received: model='x'"):
        verify(strategy, model="x")
    with pytest.raises(TypeError, match=r"`optimizer` must be a Keras optimizer.*Received: optimizer='x'"):
        verify(strategy, optimizer="x")
    assert VerifyPrecision(timeout_seconds=np.float32(5)).timeout_seconds == 5.0


def test_mismatch_message_names_fields_and_workers():
    class _TwoWorkers:
        num_replicas_in_sync = 2
        extended = type("E", (), {"worker_devices": ("/cpu:0",)})()

    values = {"loss_scale": [json.dumps({"a": 1, "tier": "small"}), json.dumps({"a": 1, "tier": "large"})]}
    text = verification._message(_TwoWorkers(), ["loss_scale"], values)
    assert 'loss_scale: worker 0: {"tier": "small"}, worker 1: {"tier": "large"}' in text
    assert "Received different loss_scale" in text


def test_differing_parts_narrow_json_values():
    parts = verification._differing_parts(
        {0: json.dumps({"a": 1, "tier": "small"}), 1: json.dumps({"a": 1, "tier": "large"})}
    )
    assert parts == {0: '{"tier": "small"}', 1: '{"tier": "large"}'}


def test_hash64_is_stable_int64():
    h = verification._hash64("mixed_float16")
    assert h == verification._hash64("mixed_float16") and -(2**63) <= h < 2**63
    assert h != verification._hash64("float32")


def test_repeated_gathers_trace_once_per_shape(caplog):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    for n in [1, 3] * 4:  # as verify() does each call: new options, arrays of a few lengths
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=30)
        gathered = verification._all_gather(strategy, np.arange(n), options)
        np.testing.assert_array_equal(gathered, np.arange(n)[None, :])
    assert not [r for r in caplog.records if "retracing" in r.getMessage()]  # TensorFlow warns after five
    (gather,) = verification._GATHERS[strategy].values()
    assert gather.experimental_get_tracing_count() <= 2

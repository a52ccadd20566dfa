"""keras_amp.matmul16_policy: the Matmul16DTypePolicy object (name, dtypes, repr, equality, copies, a bad
source) and its saved form (RNN layers restore it; Keras 3.15 flattens it to its name elsewhere)."""

import copy
import pickle

import keras
import pytest

import keras_amp


def test_policy_object_behaves_as_before():
    policy = keras_amp.Matmul16DTypePolicy("mixed_float16")
    assert repr(policy) == '<Matmul16DTypePolicy "matmul16_from_mixed_float16">'
    assert policy.get_config() == {"name": "float32"}  # stock DTypePolicy's config: stock reads float32
    assert keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(policy)) == policy
    assert policy == keras_amp.Matmul16DTypePolicy("mixed_float16") != keras_amp.Matmul16DTypePolicy()
    assert keras_amp.Matmul16DTypePolicy.from_config({"source_name": "mixed_float16"}) == policy
    assert pickle.loads(pickle.dumps(policy)) == policy == copy.deepcopy(policy)
    with pytest.raises(ValueError, match="source_name"):
        keras_amp.Matmul16DTypePolicy("float32")


def test_matmul16_policy_serialises_with_rnn_layers_and_keras_flattens_it_elsewhere():
    policy = keras_amp.Matmul16DTypePolicy("mixed_float16")
    assert (policy.name, policy.compute_dtype, policy.variable_dtype, policy.matmul_dtype) == (
        "matmul16_from_mixed_float16", "float32", "float32", "float16")
    assert policy != keras.DTypePolicy("float32")  # not a plain float32 policy
    for layer in (keras.layers.LSTM(3, dtype=policy), keras.layers.RNN(keras.layers.GRUCell(3), dtype=policy)):
        restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
        assert restored.dtype_policy == policy and isinstance(restored.dtype_policy, keras_amp.Matmul16DTypePolicy)
    # Guard (Keras 3.15 `Operation.from_config`): other layers and RNN cells get the policy's name,
    # which Keras cannot parse. This is why the "rnn" recipe leaves a saved cell float32 and the
    # rule reads the enclosing RNN's policy; if Keras keeps the object here, revisit that.
    with pytest.raises(TypeError, match="Cannot convert 'matmul16_from_mixed_float16'"):
        keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(keras.layers.Dense(3, dtype=policy)))

"""Shared helpers for the float32-island layer tests: policies, unit roundoff, float64 references."""

import keras
import numpy as np
import pytest

def pytest_configure(config):
    # Keras's own layer test files (run by test_keras_suites.py) carry this marker; with
    # --strict-markers it must be registered. The TensorFlow backend trains, so it selects nothing out.
    config.addinivalue_line("markers", "requires_trainable_backend: Keras test needing a backend that trains")


POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
MIXED = ["mixed_float16", "mixed_bfloat16"]

# Unit roundoff (half the spacing at 1) of each compute dtype.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


@pytest.fixture(params=POLICIES, ids=lambda p: p)
def policy(request):
    """Sets the global dtype policy (conftest.py restores it) and returns its name."""
    keras.config.set_dtype_policy(request.param)
    return request.param


@pytest.fixture(params=MIXED, ids=lambda p: p)
def mixed_policy(request):
    keras.config.set_dtype_policy(request.param)
    return request.param


def compute_dtype(policy_name):
    return keras.dtype_policies.get(policy_name).compute_dtype


def u(policy_name):
    """Unit roundoff of the policy's compute dtype."""
    return UNIT_ROUNDOFF[compute_dtype(policy_name)]


def np64(x):
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")), np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)

"""Fixtures for the float32-island layer tests; the shared helpers live in tests/helpers.py."""

import keras
import pytest

from tests.helpers import MIXED, POLICIES


def pytest_configure(config):
    # Keras's own layer test files (run by test_keras_suites.py) carry this marker; with
    # --strict-markers it must be registered. The TensorFlow backend trains, so it selects nothing out.
    config.addinivalue_line("markers", "requires_trainable_backend: Keras test needing a backend that trains")


@pytest.fixture(params=POLICIES, ids=lambda p: p)
def policy(request):
    """Sets the global dtype policy (conftest.py restores it) and returns its name."""
    keras.config.set_dtype_policy(request.param)
    return request.param


@pytest.fixture(params=MIXED, ids=lambda p: p)
def mixed_policy(request):
    keras.config.set_dtype_policy(request.param)
    return request.param

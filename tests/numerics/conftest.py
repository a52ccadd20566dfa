"""Fixtures of the numerics tests."""

import pytest

from keras_amp import hardware


@pytest.fixture(params=[True, False], ids=["emulated", "native"])
def emulated(request, monkeypatch):
    """Whether this test's "device" emulates 16-bit kernels (`hardware.emulated`), so that both the
    float32-kernel path and TensorFlow's own 16-bit kernels run on any machine."""
    monkeypatch.setattr(hardware, "emulated", lambda dtype: request.param)
    return request.param

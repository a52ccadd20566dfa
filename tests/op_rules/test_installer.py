"""keras_amp.op_rules.installer: install() replaces the Keras objects, uninstall() and disable() restore
each exactly; another Keras version, or a changed Keras source, installs nothing where it applies."""

import keras
import pytest

import keras_amp
from keras_amp import _compat, op_rules
from keras_amp.op_rules import installer

pytestmark = [
    pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning"),
    pytest.mark.usefixtures("no_op_rules"),
]


def _attr(name):
    owner, attr = installer._TARGETS[name]
    return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


def test_public_ops_call_the_replaced_backend_modules():
    # keras.ops reach the backend by attribute at call time, so replacing the attribute reaches them.
    from keras.src import backend
    from keras.src.backend.tensorflow import math as tf_math
    from keras.src.backend.tensorflow import nn as tf_nn
    from keras.src.backend.tensorflow import numpy as tf_numpy

    assert backend.nn is tf_nn and backend.math is tf_math and backend.numpy is tf_numpy
    op_rules.install("float16")
    for name in op_rules.replaced():
        assert _attr(name) is installer._REPLACEMENTS[True][name]  # install() default: xla_scores=True


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_enable_installs_and_disable_restores_every_object_exactly(policy):
    before = {name: _attr(name) for name in installer._TARGETS}
    keras_amp.enable(policy)
    compute = keras_amp.config().compute_dtype
    assert op_rules.installed() == compute
    # Two rows may share a target (gelu's float16 row and its backward-pass row): replaced once.
    expected = {n for r in op_rules.RULES if r.by == "keras_amp" and compute in r.dtypes for n in r.targets}
    assert sorted(op_rules.replaced()) == sorted(expected)
    assert all(_attr(name) is not before[name] for name in expected)
    keras_amp.disable()
    assert op_rules.installed() is None and op_rules.replaced() == ()
    assert all(_attr(name) is before[name] for name in installer._TARGETS)


def test_no_rules_under_float32():
    keras_amp.enable("float32")
    assert op_rules.installed() is None and op_rules.replaced() == ()
    assert all(_attr(name) is op_rules.ORIGINALS[name] for name in installer._TARGETS)
    keras_amp.enable("mixed_bfloat16")
    assert op_rules.installed() == "bfloat16"
    keras_amp.enable("float32")  # switching back to float32 removes them
    assert op_rules.replaced() == ()


def test_other_keras_version_installs_nothing_and_warns(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.16.0")
    with pytest.warns(keras_amp.AmpWarning, match="Keras 3.16.0 is installed; keras_amp was written for 3.15.x"):
        op_rules.install("float16")
    assert op_rules.replaced() == ()


def test_changed_keras_source_skips_only_that_rule(monkeypatch):
    name = "keras.src.backend.tensorflow.nn.softmax"
    monkeypatch.setitem(_compat.PIN_BY_NAME, name, _compat.Pin(name, "0" * 16, (_compat.OP_RULES,)))
    with pytest.warns(keras_amp.AmpWarning, match=r"keras.src.backend.tensorflow.nn.softmax changed \(source digest"):
        op_rules.install("bfloat16")
    assert name not in op_rules.replaced() and not op_rules.rule_installed("softmax")
    assert op_rules.rule_installed("log_softmax")
    with pytest.raises(ValueError, match="Received: op='softmaxx'"):
        op_rules.rule_installed("softmaxx")
    with pytest.raises(ValueError, match="Received: compute_dtype='float32'"):
        op_rules.install("float32")

"""keras_amp.op_rules.float32_ops: single-op rules (here: arange with dtype float16)."""

import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_amp
from keras_amp import op_rules

pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning")


def _table(n):
    # keras-hub's pattern (Flux's timestep embedding, SAM3's box coordinates): a float16 range, scaled.
    return ops.arange(0, n, dtype="float16") / n


def test_float16_arange_traces_stock_fails():
    keras_amp.enable("mixed_float16")
    op_rules.uninstall()
    with pytest.raises(ValueError, match="Range"):  # stock: no float16 Range kernel in a graph
        tf.function(_table).get_concrete_function(100)
    op_rules.install("float16")
    out = tf.function(_table)(100)
    assert out.dtype == tf.float16
    # float64 reference, rounded once to float16 (the range is exact; the division rounds in float16).
    ref = (np.arange(100, dtype=np.float64).astype(np.float16) / np.float16(100)).astype(np.float64)
    np.testing.assert_array_equal(out.numpy().astype(np.float64), ref)


def test_other_dtypes_are_left_to_keras():
    keras_amp.enable("mixed_float16")
    assert op_rules.rule_installed("arange with dtype float16")
    for dtype in ("float32", "int32", "bfloat16"):
        out = tf.function(lambda: ops.arange(1, 9, 2, dtype=dtype))()
        assert out.dtype == tf.as_dtype(dtype)
        np.testing.assert_array_equal(out.numpy().astype(np.float64), [1, 3, 5, 7])

"""keras_amp.dtypes: the 16-bit compute dtypes and, per hazard kind, those in which it is a hazard."""

import ml_dtypes
import numpy as np
import pytest

from keras_amp import dtypes, op_rules


def test_low_precision_is_exactly_the_two_16bit_floats():
    assert dtypes.LOW_PRECISION == ("float16", "bfloat16")
    assert [ml_dtypes.finfo(name).bits for name in dtypes.LOW_PRECISION] == [16, 16]
    assert dtypes.BOTH == dtypes.LOW_PRECISION and dtypes.FLOAT16 == ("float16",)


def test_every_hazard_kind_has_an_op_rule_and_every_rule_kind_a_hazard_entry():
    kinds = {rule.kind for rule in op_rules.RULES} - {""}  # "" marks a rule that fixes no hazard
    assert kinds == set(dtypes.HAZARD_DTYPES)
    assert op_rules.HAZARD_DTYPES is dtypes.HAZARD_DTYPES  # one vocabulary, re-exported


@pytest.mark.parametrize("kind", sorted(dtypes.HAZARD_DTYPES))
def test_hazard_dtypes_are_16bit_and_include_float16(kind):
    assert set(dtypes.HAZARD_DTYPES[kind]) <= set(dtypes.LOW_PRECISION) and "float16" in dtypes.HAZARD_DTYPES[kind]


def test_range_hazards_are_float16_only_because_bfloat16_has_float32s_range():
    assert {k for k, v in dtypes.HAZARD_DTYPES.items() if v == dtypes.FLOAT16} == {"exp", "reduction"}
    # exp(12) = 162754.79... and a sum of 300 values of 300 (90000) overflow float16 (max 65504) ...
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(np.exp(12.0))) and np.isinf(np.sum(np.full(300, 300, np.float16)))
    # ... and are finite in bfloat16, which has float32's exponent range (8 bits; float16 has 5).
    assert np.isfinite(np.float32(ml_dtypes.bfloat16(np.exp(12.0))))
    assert np.isfinite(np.float32(np.sum(np.full(300, 300, ml_dtypes.bfloat16))))
    bf16, f32 = ml_dtypes.finfo(ml_dtypes.bfloat16), np.finfo(np.float32)
    assert bf16.maxexp == f32.maxexp == 128 and ml_dtypes.finfo(np.float16).maxexp == 16
    assert float(bf16.max) == (2 - 2.0**-7) * 2.0**127 and float(ml_dtypes.finfo(np.float16).max) == 65504.0

"""keras_amp.op_rules.table: each row's kind, dtypes and targets agree with the installer and the pins;
the Keras sources are the ones the rules were written against."""

import keras
import pytest

from keras_amp import _compat, op_rules
from keras_amp.diagnostics import audit
from keras_amp.op_rules import installer

pytestmark = pytest.mark.usefixtures("no_op_rules")


def test_table_rows_targets_and_digests_agree():
    kinds = set(audit.KIND_DTYPES) | {""}
    for rule in op_rules.RULES:
        assert rule.kind in kinds and rule.by in ("keras_amp", "keras", "none") and rule.reason
        assert bool(rule.targets) == (rule.by == "keras_amp"), rule.op
        for name in rule.targets:
            assert name in installer._TARGETS and name in _compat.PIN_BY_NAME
        # A hazard's rule is for the dtypes where it is a hazard; a rule fixing none (kind "") names
        # the compute dtypes it is installed under.
        allowed = op_rules.HAZARD_DTYPES[rule.kind] if rule.kind else op_rules.LOW_PRECISION
        assert set(rule.dtypes) <= set(allowed), rule.op
    text = op_rules.rules_markdown()
    assert all(f"| {rule.op} |" in text for rule in op_rules.RULES)
    assert all(item in text for item in op_rules.NOT_REACHED)


def test_keras_sources_are_the_ones_the_rules_were_written_against():
    # Fails when a Keras upgrade changes a replaced (or relied-on) function: review the rule.
    assert keras.__version__.startswith(_compat.TESTED_KERAS)
    assert op_rules.source_digests() == {name: _compat.PIN_BY_NAME[name].digest for name in op_rules.ORIGINALS}


def test_exp_rule_is_float16_only():
    op_rules.install("bfloat16")  # bfloat16 has float32's range: no gelu overflow rule ...
    assert not op_rules.rule_installed("gelu") and op_rules.rule_installed("softmax")
    assert op_rules.rule_installed(op_rules.GELU_BACKWARD_OP)  # ... only its memory row

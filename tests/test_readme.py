"""The README's generated sections are what the code prints: the op-rule table and the troubleshooting tree."""

import pathlib
import re

from keras_amp import op_rules
from keras_amp.diagnostics import symptoms

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


def _unindent(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines())


def test_rule_table_matches_op_rules():
    table = op_rules.rules_markdown().strip()
    assert table.count("\n") >= 10  # guard: a real table
    assert _unindent(table) in _unindent(README)


def test_troubleshooting_section_matches_the_decision_tree():
    tree = symptoms.render_markdown().strip()
    assert tree.startswith("## Troubleshooting")
    assert tree in README


def test_every_test_named_in_the_adds_table_exists():
    root = pathlib.Path(__file__).resolve().parents[1]
    named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", README)
    assert len(named) >= 10  # guard: the table cites tests
    for path, test in named:
        source = (root / path).read_text()
        if test:
            assert re.search(rf"def {test}\(", source), f"{path}::{test} is cited in README but does not exist"

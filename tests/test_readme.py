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


def _adds_table_rows():
    """The rows of README's "what keras_amp adds" table, as lists of cells."""
    section = README[README.index("## What keras_amp adds"):README.index("## Usage")]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header, rows = lines[0], lines[1:]
    assert header.split(" | ")[-2:] == ["stock fails in", "keras_amp holds in |"], header
    return [row.strip().strip("|").split(" | ") for row in rows]


def test_every_row_of_the_adds_table_cites_the_stock_failure_and_the_fix():
    root = pathlib.Path(__file__).resolve().parents[1]
    rows = _adds_table_rows()
    assert len(rows) >= 10  # guard: the table was found and parsed
    for cells in rows:
        assert len(cells) == 4, cells
        for column, cell in zip(("stock fails in", "keras_amp holds in"), cells[2:]):
            cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", cell)
            assert cited, f"README row {cells[0][:50]!r}: no test in column {column!r}"
            # Every citation is a test function of a file, and nothing else is in the cell.
            assert len(cited) == cell.count("`") // 2, f"README row {cells[0][:50]!r}: {cell!r}"
            for path, test in cited:
                assert re.search(rf"^def {test}\(", (root / path).read_text(), re.M), f"{path}::{test} does not exist"


def test_every_test_named_in_the_adds_table_exists():
    root = pathlib.Path(__file__).resolve().parents[1]
    named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", README)
    assert len(named) >= 10  # guard: the table cites tests
    for path, test in named:
        source = (root / path).read_text()
        if test:
            assert re.search(rf"def {test}\(", source), f"{path}::{test} is cited in README but does not exist"

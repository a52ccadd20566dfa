"""keras_amp.diagnostics.finding: a hazard as frozen data, and the kinds in report order."""

import ast
import dataclasses
import pathlib

import pytest

import keras_amp
from keras_amp import diagnostics
from keras_amp.diagnostics import check
from keras_amp.diagnostics.finding import KINDS, Finding

PACKAGE = pathlib.Path(keras_amp.__file__).parent


def _kind_strings():
    """(module -> the kinds its string constants name, first arguments of `Finding(...)` that are no kind),
    over the package's modules but finding.py."""
    named, unknown = {}, []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "finding.py":
            continue
        module = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in KINDS:
                named.setdefault(module, set()).add(node.value)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding" and node.args \
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value not in KINDS:
                unknown.append((module, node.args[0].value))
    return named, unknown


def test_a_finding_is_frozen_data_compared_by_value():
    f = Finding("no_loss_scaling", "model", "float16 without loss scaling", "wrap the optimizer")
    assert dataclasses.astuple(f) == ("no_loss_scaling", "model", "float16 without loss scaling",
                                      "wrap the optimizer")
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.kind = "low_precision_op"
    same = Finding(**dataclasses.asdict(f))
    assert same == f and len({f, same}) == 1
    assert dataclasses.replace(f, layer="other") != f


def test_kinds_are_unique_and_the_public_face_is_this_table():
    assert len(set(KINDS)) == len(KINDS) == 12
    assert diagnostics.KINDS is KINDS and check.KINDS is KINDS
    assert diagnostics.Finding is Finding and keras_amp.Finding is Finding


def test_every_kind_is_produced_by_some_module_of_the_package():
    found, unknown = _kind_strings()
    assert unknown == []  # every Finding the package makes has a kind of the table
    produced = set().union(*found.values())
    assert produced == set(KINDS), sorted(set(KINDS) - produced)
    assert len(found) >= 3  # guard: the scan reached check.py, evidence.py and outputs.py
    # The dynamic audit's two kinds come from evidence.py, the rest from the static check.
    assert {"low_precision_normalization", "low_precision_op"} <= found["diagnostics/evidence.py"]
    assert KINDS[0] == "built_before_enable"  # listed before all else: it says enable() did nothing

"""keras_amp.diagnostics.symptoms: the symptom table, the decision tree, its walk and its printers."""

import ast
import re

import pytest

from keras_amp.diagnostics import symptoms


def test_decision_tree_is_one_table_for_every_printer():
    names = {s.name for s in symptoms.SYMPTOMS}
    assert names == {"non_finite_loss", "zero_gradients", "scale_at_floor", "validation_swing",
                     "memory_growth", "step_time_jump", "updates_vanish"}
    ids = {n.id for n in symptoms.NODES}
    for node in symptoms.NODES:  # every branch leads somewhere, every leaf acts
        assert (node.yes in ids and node.no in ids) if not node.is_leaf else node.actions
    markdown, text = symptoms.render_markdown(), symptoms.render_text()
    for node in symptoms.NODES:
        for line in (node.question,) if not node.is_leaf else ():
            assert line in markdown and line in text
    d = symptoms.diagnose("non_finite_loss", {"data_non_finite": False, "loss_scaled": True,
                                              "scale_at_floor_or_overflowing": True, "forward_overflow": False},
                          half_scale="16384")
    assert d.actions[0] == "Lower the initial loss scale 2x: LossScaleOptimizer(..., initial_scale=16384)."
    # An unknown fact stops the walk: one action (find it out), never both branches' actions.
    unknown = symptoms.diagnose("non_finite_loss", {})
    assert unknown.steps == (("Does the batch itself (inputs or labels) contain NaN/inf?", "unknown"),)
    assert len(unknown.actions) == 1 and unknown.actions[0].startswith("Answer first:")
    # Every template is filled: with the caller's values, else with an expression to evaluate.
    for name in symptoms.SYMPTOM_NAMES:
        for facts in ({}, {"data_non_finite": True}, {"data_non_finite": False, "loss_scaled": False,
                                                      "forward_overflow": True}):
            assert not re.search(r"<[a-z]", " ".join(symptoms.diagnose(name, facts).actions)), (name, facts)
    assert not re.search(r"<[a-z]", symptoms.render_markdown() + symptoms.render_text())


def test_an_unknown_symptom_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"Unknown `symptom`\. Received: symptom='nan_loss'\. "
                                         r"Allowed: non_finite_loss, zero_gradients, scale_at_floor, "):
        symptoms.diagnose("nan_loss")
    assert symptoms.symptom("memory_growth").start == "memory"


def test_the_named_layers_fill_the_float32_action_and_rules_that_match_them_in_full():
    facts = {"data_non_finite": False, "loss_scaled": True, "scale_at_floor_or_overflowing": True,
             "forward_overflow": True}
    d = symptoms.diagnose("non_finite_loss", facts, "loss=nan after 4 steps", layers=["block/k", "a.b"])
    assert [answer for _, answer in d.steps] == ["no", "yes", "yes", "yes"]
    assert d.actions[0].startswith("Compute 'block/k', 'a.b' in float32: dtype='float32' on the layer")
    rules = ast.literal_eval(re.search(r"rules=(\{.*\})\)\.$", d.actions[0]).group(1))
    assert rules == {"block/k": "float32", r"a\.b": "float32"}
    # apply_recipe matches each rule against a whole name: the dot is escaped, not a wildcard.
    assert re.fullmatch(r"a\.b", "a.b") and not any(re.fullmatch(p, "axb") for p in rules)
    assert d.actions[1] == ("Run keras_amp.find_overflow(model, x, y) again: it should report no producer, or name "
                            "the next layer to move (values that overflowed before may overflow one layer on).")


def test_values_not_given_are_said_as_expressions_to_evaluate():
    d = symptoms.diagnose("zero_gradients", {"loss_scaled": True, "gradient_underflow": True},
                          layers=[], probe_scale=None)
    assert d.actions[0] == ("Raise the loss scale to where the zeros are values: initial_scale="
                            "float(optimizer.dynamic_scale) * 4096 (it backs off if steps overflow), or a larger min_scale.")
    assert "compute the layers keras_amp.find_overflow(model, x, y) names in float32" in d.actions[1]
    assert "rules={layer.name: 'float32'}" in d.actions[1]


def test_a_diagnosis_prints_its_walk_then_its_actions():
    d = symptoms.diagnose("updates_vanish", {"weights_16bit": False}, "'dense': 90% lost")
    assert str(d).splitlines() == [
        "keras_amp diagnosis: Weight updates vanish ('dense': 90% lost)",
        "  Are the layer's weights stored in 16 bits (pure 16-bit policy or LeanAdam)? -> no",
        "  action: The float32 master loses the update (the step is below float32's 2**-24 of the weight): "
        "raise the learning rate, or rescale the weights.",
    ]


def test_render_text_of_one_symptom_is_that_symptom_only():
    text = symptoms.render_text("memory_growth")
    lines = text.splitlines()
    assert lines[0] == "Memory grows epoch over epoch [memory_growth]"
    assert lines[1].startswith("  detected: device memory in use (GPU) or process RSS rises")
    assert len(lines) == 4 and all(line.startswith("  - ") for line in lines[2:])
    assert lines[2].startswith("  - Check how long tensors live") and "is a leak, not precision" in lines[3]
    assert text.endswith(".\n")
    everything = symptoms.render_text()
    assert all(f"[{name}]" in everything for name in symptoms.SYMPTOM_NAMES)
    assert symptoms.render_markdown().startswith("## Troubleshooting\n\n")

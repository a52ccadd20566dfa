"""keras_amp._compat: one verdict at import, and features that turn off cleanly on another Keras.

Each scenario changes Keras in a fresh process before keras_amp is imported (a private method
renamed, a replaced function whose source changed, a module gone, another minor version), then
imports keras_amp and reports what it says and does. keras_amp must import without an exception,
warn once per affected feature naming it and the cause, and leave the unaffected features on.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from keras_amp import _compat

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[1]

_REPORT = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import keras_amp
    from keras_amp import _compat, op_rules
    from keras_amp.distribute import trainer_fix
    config = keras_amp.enable("mixed_bfloat16")
    installed = sorted(r.op for r in op_rules.RULES if r.by == "keras_amp" and op_rules.rule_installed(r.op))
    fit_fix = trainer_fix.install_fit_fix()
    keras_amp.enable("mixed_float16")
    import keras
    try:
        keras_amp.LossScaleOptimizer(keras.optimizers.SGD())
        lso = "constructed"
    except _compat.FeatureOff as e:
        lso = "FeatureOff: " + str(e)
    wrapped = type(keras_amp.wrap(keras.optimizers.SGD())).__module__
    keras_amp.disable()
print(json.dumps({
    "off": {f: list(r) for f, r in _compat.off_features().items()},
    "warnings": [str(w.message) for w in caught if "is off on Keras" in str(w.message)],
    "rule_warnings": [str(w.message) for w in caught if "op rule for" in str(w.message)],
    "installed": installed,
    "fit_fix": fit_fix,
    "policy": config.policy,
    "lso": lso,
    "wrapped": wrapped,
}))
"""


def _run(change: str) -> dict:
    script = textwrap.dedent(change) + _REPORT
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]  # keras_amp imported and ran: no crash
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _all_rules() -> list[str]:
    from keras_amp import op_rules

    return sorted(r.op for r in op_rules.RULES if r.by == "keras_amp" and "bfloat16" in r.dtypes)


def test_the_tested_keras_has_every_feature_on():
    report = _run("")
    assert report["off"] == {} and report["warnings"] == [] and report["rule_warnings"] == []
    assert report["installed"] == _all_rules() and report["fit_fix"] is True
    assert report["lso"] == "constructed" and report["wrapped"].startswith("keras_amp.")


def test_a_renamed_private_method_turns_off_what_overrides_it():
    report = _run("""
        from keras.src.optimizers import loss_scale_optimizer as lso
        lso.LossScaleOptimizer._tf_apply_v2 = lso.LossScaleOptimizer._tf_apply
        del lso.LossScaleOptimizer._tf_apply
    """)
    name = "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._tf_apply"
    assert list(report["off"]) == [_compat.LSO]
    assert report["off"][_compat.LSO] == [f"{name} is missing"]
    assert len(report["warnings"]) == 1 and _compat.LSO in report["warnings"][0] and name in report["warnings"][0]
    assert report["installed"] == _all_rules() and report["fit_fix"] is True  # the rest stays on
    # Our optimizer refuses to run without its override (it would be bypassed in silence); wrap()
    # falls back to stock loss scaling, under the one warning already given.
    assert report["lso"].startswith(f"FeatureOff: keras_amp: {_compat.LSO} is off") and name in report["lso"]
    assert report["wrapped"].startswith("keras.src.optimizers.")


def test_a_changed_source_turns_off_only_the_rules_standing_on_it():
    report = _run("""
        import importlib, sys, tempfile, pathlib
        from keras.src.backend.tensorflow import nn
        folder = tempfile.mkdtemp()
        pathlib.Path(folder, "changed_nn.py").write_text(
            "def softmax(x, axis=-1):  # another implementation of the same function\\n"
            "    import tensorflow as tf\\n"
            "    return tf.nn.softmax(x, axis=axis)\\n")
        sys.path.insert(0, folder)
        nn.softmax = importlib.import_module("changed_nn").softmax
    """)
    name = "keras.src.backend.tensorflow.nn.softmax"
    assert set(report["off"]) == {_compat.OP_RULES}
    assert report["off"][_compat.OP_RULES][0].startswith(f"{name} changed (source digest")
    assert len(report["warnings"]) == 1
    # Both rows replacing softmax (the softmax rule and the dataflow scores rule) are skipped, with
    # a warning each; every other rule is installed.
    skipped = {"softmax", "attention scores feeding softmax / log_softmax (any matmul, einsum or `@` of two activations)"}
    assert report["installed"] == sorted(set(_all_rules()) - skipped)
    # Said at each install (mixed_bfloat16, then mixed_float16): the same two rows each time.
    assert len(set(report["rule_warnings"])) == 2 and all(name in w for w in report["rule_warnings"])


def test_a_missing_module_turns_off_what_imports_it():
    report = _run("""
        import sys
        import keras.src.backend.tensorflow as backend
        del backend.trainer
        sys.modules["keras.src.backend.tensorflow.trainer"] = None  # import now fails
    """)
    assert _compat.FIT_FIX in report["off"] and report["fit_fix"] is False
    assert all("keras.src.backend.tensorflow.trainer" in r for r in report["off"][_compat.FIT_FIX])
    assert len(report["warnings"]) == len(report["off"])  # one warning per feature
    assert report["installed"] == _all_rules()  # the op rules do not stand on the trainer


def test_another_minor_version_turns_every_feature_off():
    report = _run("""
        import keras
        keras.__version__ = "3.16.0"
    """)
    assert set(report["off"]) == set(_compat.VERDICT)
    assert all(r[0] == "Keras 3.16.0 is installed; keras_amp was written for 3.15.x" for r in report["off"].values())
    assert report["installed"] == [] and report["fit_fix"] is False and report["policy"] == "mixed_bfloat16"


def test_evaluate_is_a_pure_verdict():
    pins = (_compat.Pin("a.b", "0" * 16, ("F",)), _compat.Pin("c.d", None, ("G",)))
    verdict = _compat.evaluate(pins, {"a.b": len}, "3.15.1", "2.21.0")
    assert verdict["G"] == ("c.d is missing",)
    assert verdict["F"] == ("a.b has no readable source",)  # a builtin: nothing to digest
    with pytest.raises(KeyError, match="Received: name='nope'"):
        _compat.original("nope")
    with pytest.raises(KeyError, match="Received: feature='nope'"):
        _compat.is_on("nope")

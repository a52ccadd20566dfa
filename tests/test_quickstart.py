"""examples/quickstart.py: the README quick start runs end to end on real text (short)."""

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _keras_amp_calls(source: str) -> dict[str, list[str]]:
    """{"keras_amp.check_model": ["model", "x[:8]"], ...}: each keras_amp call and its arguments."""
    calls = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func).startswith("keras_amp."):
            calls[ast.unparse(node.func)] = [ast.unparse(a) for a in node.args + node.keywords]
    return calls


def test_quickstart_makes_the_calls_of_the_readme_quick_start():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    snippet = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 3)]
    documented = _keras_amp_calls(snippet)
    script = _keras_amp_calls((ROOT / "examples" / "quickstart.py").read_text())
    assert {"keras_amp.enable", "keras_amp.apply_recipe", "keras_amp.check_model"} <= set(documented)  # guard
    for call, arguments in documented.items():
        assert call in script, f"README's quick start calls {call}; examples/quickstart.py does not"
        if call != "keras_amp.enable":  # README: the default ("auto"); the script: --policy, default "auto"
            assert script[call] == arguments, (call, arguments, script[call])
    assert script["keras_amp.enable"] == ["FLAGS.policy"]
    assert 'DEFINE_enum("policy", "auto"' in (ROOT / "examples" / "quickstart.py").read_text()


@pytest.mark.parametrize("policy", ["auto", "mixed_bfloat16", "float32"])
def test_quickstart_trains(policy):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), f"--policy={policy}", "--epochs=2",
         "--steps_per_epoch=15", "--width=64"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "check_model(" in out.stdout
    loss = float(out.stdout.split("final loss ")[1].split(",")[0])
    accuracy = float(out.stdout.split("accuracy ")[-1].split()[0])
    # Uniform over 256 bytes: loss log(256) = 5.55, accuracy 0.004; 30 steps learn at least the
    # byte frequencies (the space alone is ~15% of the text). mixed_float16 is covered by
    # test_examples.py at tiny sizes: float16 convolutions have no fast CPU kernel (~50x slower).
    assert loss < math.log(256) - 1.5 and accuracy > 0.1, out.stdout

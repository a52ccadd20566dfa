"""The examples' flags fail before any work: stray positional arguments, result files that cannot be written."""

import sys
import time

import pytest

from tests.test_examples import EXAMPLES, launch


def _fails_at_parse(name, tmp_path, *args):
    """Runs examples/<name>.py; asserts it stopped with one error line (absl's, for a flag's value), quickly,
    writing nothing; returns that line."""
    start = time.perf_counter()
    folder = [] if name == "quickstart" else [f"--model_dir={tmp_path / 'runs'}"]  # quickstart writes no files
    out = launch(name, tmp_path, *folder, *args, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip() and "--helpshort" not in line]
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(("FATAL Flags parsing error: ", "error: ")), lines
    assert not (tmp_path / "runs").exists() and not out.stdout  # no training, no output
    assert time.perf_counter() - start < 30  # before TensorFlow is imported
    return lines[0]


@pytest.mark.parametrize("name", ["cnn", "quickstart", "multi_worker"])
def test_a_stray_positional_argument_stops_the_example(name, tmp_path):
    line = _fails_at_parse(name, tmp_path, "--epochs=1", "stray", "words")
    assert line == "error: unexpected arguments 'stray words': every setting is a --flag (--help lists them)", line


def test_a_results_file_that_cannot_be_written_stops_the_run_before_it_trains(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    line = _fails_at_parse("cnn", tmp_path, "--epochs=1", f"--results_file={blocker / 'x.json'}")
    assert line.endswith(f"--results_file must be a file path that can be written (missing folders are made), but "
                         f"{blocker} is a file. Received: --results_file={blocker / 'x.json'}"), line
    line = _fails_at_parse("transformer", tmp_path, f"--results_file={tmp_path}")
    assert f"but {tmp_path} is a folder. Received: --results_file={tmp_path}" in line, line
    if sys.platform.startswith("linux"):  # /proc: a folder, but no files can be made in it (even by root)
        line = _fails_at_parse("rnn", tmp_path, "--results_file=/proc/results.json")
        assert "but no file can be written in /proc. Received: --results_file=/proc/results.json" in line, line
    line = _fails_at_parse("demo", tmp_path, f"--plot_file={blocker / 'sub' / 'demo.png'}")
    assert f"--plot_file must be a file path that can be written (missing folders are made), but {blocker} is a file" \
        in line, line


@pytest.fixture
def demo(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import demo as module  # noqa: PLC0415  (its flags are defined only when run as a script)

    yield module
    for name in [n for n in sys.modules if n == "common" or n.startswith("common.") or n == "demo"]:
        del sys.modules[name]


def test_the_demo_names_the_policy_it_was_given(demo):
    def results(label, policy, reason):
        return [{"label": label, "policy": policy, "reason": reason}, {"label": "float32", "policy": "float32"}]

    assert demo.policy_line(results("auto", "mixed_bfloat16", "native bfloat16 (avx512_bf16)")) == \
        '"auto" chose mixed_bfloat16: native bfloat16 (avx512_bf16)'
    assert demo.policy_line(results("auto", "float32", "no fast 16-bit path")) == \
        '"auto" chose float32 on this machine (no fast 16-bit path): nothing to compare.'
    assert demo.policy_line(results("mixed_float16", "mixed_float16", "requested explicitly")) == \
        "--policy=mixed_float16, against float32."
    assert demo.policy_line(results("float32", "float32", "requested explicitly")) == \
        "--policy=float32: nothing to compare."

"""benchmarks/bench_hub.py: keras-hub backbones timed under float32, stock and keras_amp (smoke sizes,
no figure asserted: speed lives in the benchmark's own output)."""

import json
import sys
from pathlib import Path

import keras
import pytest

import keras_amp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_hub  # noqa: E402
import bench_time  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_after():
    yield
    keras_amp.disable()
    keras.config.set_dtype_policy("float32")


def test_each_configuration_is_what_it_names():
    s = bench_hub.SMOKE
    model = bench_hub.make("llama", "float32", "mixed_bfloat16", s)
    assert not keras_amp.config().enabled and model.get_layer("head").compute_dtype == "float32"
    model = bench_hub.make("llama", "stock", "mixed_float16", s)
    assert not keras_amp.config().enabled and model.get_layer("head").compute_dtype == "float16"
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    model = bench_hub.make("llama", "keras_amp", "mixed_float16", s)
    assert keras_amp.config().enabled and keras_amp.config().policy == "mixed_float16"
    assert isinstance(model.optimizer, keras_amp.LossScaleOptimizer)
    for family in sorted(bench_hub.IMAGES):  # images in, class logits out of the last feature map's mean
        model = bench_hub.make(family, "float32", "mixed_bfloat16", s)
        assert model.output.shape == (None, s.classes), family


def test_blocks_rotate_so_each_configuration_runs_in_each_position():
    orders = [bench_time.rotated(("a", "b", "c"), block) for block in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


@pytest.mark.slow
def test_a_family_is_timed_in_interleaved_blocks_after_one_that_fails(monkeypatch, tmp_path, capsys):
    def broken(s):
        raise ValueError("this keras-hub version builds it differently")

    monkeypatch.setitem(bench_hub.FAMILIES, "broken", broken)
    out = tmp_path / "hub.json"
    args = ["--smoke", "--families", "broken", "gpt2", "--blocks", "2", "--steps", "1", "--warmup", "1",
            "--json", str(out)]
    assert bench_hub.main(args) == 1  # a family failed: reported, and the others still timed
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["policy"] == "mixed_bfloat16" and [r["family"] for r in saved["results"]] == ["broken", "gpt2"]
    error = "ValueError: this keras-hub version builds it differently"
    assert saved["results"][0] == {"family": "broken", "error": error}
    assert f"| broken | failed: {error} |" in printed
    for result in saved["results"][1:]:
        assert len(result["blocks"]) == 2 and result["traces"] == {c: 1 for c in bench_hub.CONFIGS}
        assert all(set(block) == set(bench_hub.CONFIGS) and min(block.values()) > 0 for block in result["blocks"])
        # Each block's configurations in the order they ran: rotated from block to block.
        assert [list(block) for block in result["blocks"]] == [bench_time.rotated(bench_hub.CONFIGS, i) for i in (0, 1)]
        median, low, high = result["keras_amp/stock"]
        assert low <= median <= high
        assert f"| {result['family']} | {result['ms']['float32']:.1f} |" in printed
    assert not keras_amp.config().enabled  # main leaves keras_amp off whatever it ran


@pytest.mark.parametrize(
    "args, message",
    [
        (["--families", "gpt3"], "argument --families: invalid choice: 'gpt3'"),
        (["--blocks", "0"], "argument --blocks: must be a positive integer, got 0"),
        (["--policy", "float32"], "argument --policy: invalid choice: 'float32'"),
    ],
)
def test_bad_arguments_name_the_argument(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_hub.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


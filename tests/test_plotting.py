"""keras_amp.plotting: the precision-plan picture, matplotlib as an optional extra, and the demo's picture."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import keras
import pytest
from matplotlib.colors import to_rgba

import keras_amp
from keras_amp import plotting

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = Path(path).read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000, (path, len(data))
    assert len(data) < 400_000, len(data)  # small settings, small pictures


def table_rows(figure):
    """The drawn table's body rows: {row index: [cell texts]} (row 0, the header, left out)."""
    (table,) = figure.axes[0].tables
    rows = {}
    for (row, col), cell in sorted(table.get_celld().items()):
        if row:
            rows.setdefault(row, []).append(cell.get_text().get_text())
    return rows, table


def tiny_model():
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(64, 16, name="embed")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.LSTM(16, return_sequences=True, name="lstm")(x)
    x = keras.layers.Dense(64, name="logits")(x)
    outputs = keras.layers.Softmax(name="probabilities")(x)
    return keras.Model(inputs, outputs, name="tiny")


def test_plan_picture_has_one_row_per_planned_layer(tmp_path):
    keras_amp.enable("mixed_bfloat16")
    model = tiny_model()
    plan = keras_amp.plan_recipe(model, "rnn")
    figure = keras_amp.plot_precision_plan(model, tmp_path / "plan.png", recipe="rnn")
    assert_png(tmp_path / "plan.png")
    rows, table = table_rows(figure)
    assert len(rows) == len(plan.layers) >= 5  # lstm and its cell included
    by_path = {cells[0]: (i, cells) for i, cells in rows.items()}
    for entry in plan.layers:
        i, (path, cls, compute, variables, why) = by_path[entry.path]
        assert cls == entry.layer_class and why.replace("\n", " ") == entry.reason
    _, lstm = by_path["lstm"]
    assert lstm[2:4] == ["float32", "float32"] and lstm[4].startswith("rnn: recurrence")
    colour = {path: table[i, 0].get_facecolor() for path, (i, _) in by_path.items()}
    assert colour["lstm"] == to_rgba(plotting.COLOURS["float32, 16-bit matmuls"])
    assert colour["probabilities"] == to_rgba(plotting.COLOURS["float32"])  # deny list: softmax
    assert colour["embed"] == to_rgba(plotting.COLOURS["bfloat16 / float16"])


def test_plan_picture_of_a_recipe_plan_and_of_the_model_as_it_is(tmp_path):
    keras_amp.enable("mixed_bfloat16")
    model = tiny_model()
    plan = keras_amp.plan_recipe(model, "cnn")
    planned, _ = table_rows(keras_amp.plot_precision_plan(plan))
    assert [cells[0] for cells in planned.values()] == [e.path for e in plan.layers]
    keras_amp.apply_recipe(model, "cnn")
    now, _ = table_rows(keras_amp.plot_precision_plan(model, str(tmp_path / "now.png")))
    assert_png(tmp_path / "now.png")
    walked = [path for path, _ in keras_amp.model_graph.walk(model)]
    assert [cells[0] for cells in now.values()] == walked
    cells = {c[0]: c for c in now.values()}
    # As it is: the applied policies; a reason only where the layer itself tells it.
    assert cells["embed"][2] == "float32" and cells["lstm"][2] == "bfloat16"  # "cnn": first layer float32
    assert cells["probabilities"][4] == "deny list: softmax" and cells["lstm"][4] == cells["embed"][4] == "–"


def test_plan_picture_says_why_an_island_is_float32():
    keras_amp.enable("mixed_bfloat16")
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="dense")(inputs)
    model = keras.Model(inputs, keras_amp.layers.Float32(keras.layers.Dense(4), name="head")(x))
    assert model.get_layer("head").compute_dtype == "bfloat16"  # the wrapper's policy; float32 inside
    for recipe in (None, "cnn"):
        rows, _ = table_rows(keras_amp.plot_precision_plan(model, recipe=recipe))
        cells = {c[0]: c for c in rows.values()}
        assert cells["head"][2] == "float32" and "float32 island" in cells["head"][4], (recipe, cells)
        assert "head/dense" not in "".join(cells)  # an island's inside is its own


def test_readme_plan_picture_script_draws_every_layer(tmp_path):
    # docs/plan_example.py draws README's docs/plan.png (`make pictures`).
    build = runpy.run_path(str(ROOT / "docs" / "plan_example.py"))["build"]
    keras_amp.enable("mixed_bfloat16")
    model = build()
    rows, _ = table_rows(keras_amp.plot_precision_plan(model, tmp_path / "plan.png", recipe="rnn"))
    assert_png(tmp_path / "plan.png")
    assert [c[0] for c in rows.values()] == [e.path for e in keras_amp.plan_recipe(model, "rnn").layers]
    assert {c[2] for c in rows.values()} == {"bfloat16", "float32"}


def test_plan_picture_refuses_bad_arguments(tmp_path):
    model = tiny_model()
    with pytest.raises(TypeError, match="`model` must be a built keras.Model or a keras_amp.RecipePlan"):
        keras_amp.plot_precision_plan("tiny")
    with pytest.raises(ValueError, match="Received: recipe='resnet'"):
        keras_amp.plot_precision_plan(model, recipe="resnet")
    with pytest.raises(ValueError, match="`rules` needs a `recipe`"):
        keras_amp.plot_precision_plan(model, rules={"logits": "float32"})
    with pytest.raises(ValueError, match="`recipe` and `rules` apply to a model, not to a RecipePlan"):
        keras_amp.plot_precision_plan(keras_amp.plan_recipe(model, "cnn"), recipe="cnn")
    with pytest.raises(ValueError, match="built=False"):
        keras_amp.plot_precision_plan(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(TypeError, match="`path` must be a file path"):
        keras_amp.plot_precision_plan(model, 3)
    with pytest.raises(ValueError, match="`width` must be"):
        plotting.new_figure(0, 2)
    assert not list(tmp_path.iterdir())


# Hides matplotlib (as if not installed), imports keras_amp, then asks for a picture.
_WITHOUT_MATPLOTLIB = """
import importlib.abc, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
import keras, keras_amp
assert "matplotlib" not in sys.modules
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
try:
    keras_amp.plot_precision_plan(model)
except ImportError as e:
    print("ImportError:", e)
assert "matplotlib" not in sys.modules
"""


def test_keras_amp_imports_without_matplotlib_and_names_the_extra():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", _WITHOUT_MATPLOTLIB], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'ImportError: keras_amp\'s pictures need matplotlib, an optional extra: pip install "keras-amp[plot]"' \
        in out.stdout, out.stdout


@pytest.fixture
def examples_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    yield
    for name in [n for n in sys.modules if n == "common" or n.startswith("common.") or n == "demo"]:
        del sys.modules[name]


@pytest.mark.slow
def test_demo_picture_from_two_tiny_runs(tmp_path, examples_path):
    # The demo's results from the real code path (common.compare, tiny sizes), each run in this
    # process one after the other (the demo spawns them side by side: same results structure).
    import demo  # noqa: PLC0415
    from common import compare  # noqa: PLC0415
    from common.trainer import Settings  # noqa: PLC0415

    settings = Settings(family="cnn", recipe="cnn", dataset="pydoc", epochs=2, batch_size=8, steps_per_epoch=2,
                        seq_len=16, width=8, depth=1, learning_rate=1e-2, tier="auto", seed=0,
                        model_dir=str(tmp_path / "runs"), eval_steps=1, verbose=0)
    results = compare.run(settings, [("auto", "auto")]) + compare.run(settings, [("float32", "float32")])
    figure = demo.plot(results, tmp_path / "demo.png")
    assert_png(tmp_path / "demo.png")
    loss_ax, time_ax, rss_ax, alloc_ax = figure.axes[:4]
    curves = [line for line in loss_ax.get_lines() if len(line.get_xdata()) > 1]
    assert [list(line.get_xdata()) for line in curves] == [[1, 2], [1, 2]]  # one curve per run, one point an epoch
    for curve, result in zip(curves, results):  # read back from the TensorBoard logs: fit's epoch losses
        assert curve.get_ydata()[-1] == pytest.approx(result["train_loss"], rel=1e-6)
    assert len(time_ax.patches) == 2 and time_ax.patches[1].get_height() == pytest.approx(
        1e3 * results[1]["median_step_s"])
    assert rss_ax.patches[0].get_height() == pytest.approx(results[0]["rss_above_baseline_mib"])

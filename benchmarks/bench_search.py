"""Figures for automatic precision on the examples' Transformer and CNN (pydoc text, offline).

For each model, under mixed_bfloat16: the search's cost in seconds and its float32 layers vs the
recipe's; then float32, the recipe's model and the searched model train from the same initial
weights on the same batches, and the script prints the final held-out loss of each and the
median step time of the searched model vs the recipe's (per-batch callback timing, warm-up
discarded, the two interleaved in blocks).

    python benchmarks/bench_search.py [--steps 120] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from keras_amp_console import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # the start-up banner filtered out; a TF_CPP_MIN_LOG_LEVEL the user set is kept
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_amp  # noqa: E402
from common import data as data_lib  # noqa: E402
from common import models  # noqa: E402
from bench_time import BatchTimer  # noqa: E402
from keras_amp.auto_precision import search_precision  # noqa: E402

POLICY = "mixed_bfloat16"
RECIPES = {"transformer": "transformer", "cnn": "cnn"}


def _float32_count(model) -> int:
    return sum(1 for _, layer in keras_amp.model_graph.walk(model) if layer.compute_dtype == "float32")


def _compile(model):
    model.compile(keras_amp.wrap(keras.optimizers.Adam(1e-3)),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def run(family: str, steps: int, width: int, depth: int, seq_len: int, batch: int) -> dict:
    data = data_lib.load("pydoc", seq_len=seq_len, batch_size=batch, seed=0)
    keras_amp.enable(POLICY)
    keras.utils.set_random_seed(0)
    plain = _compile(models.build(family, data, width=width, depth=depth))
    init = plain.get_weights()
    probe = list(data.train.take(2).as_numpy_iterator())
    start = time.perf_counter()
    result = search_precision(plain, probe, tolerance=0.01)
    search_s = time.perf_counter() - start

    recipe = _compile(keras_amp.apply_recipe(models.build(family, data, width=width, depth=depth), RECIPES[family]))
    recipe.set_weights(init)
    searched = _compile(models.build(family, data, width=width, depth=depth))
    searched.set_weights(init)
    result.apply(searched)
    keras_amp.disable()
    keras.config.set_dtype_policy("float32")
    f32 = _compile(models.build(family, data, width=width, depth=depth))
    f32.set_weights(init)

    batches = list(data.train_epoch(1).take(steps).as_numpy_iterator())  # other batches than the probe's
    times = {"recipe": BatchTimer(), "searched": BatchTimer()}
    block = max(steps // 6, 1)
    for i in range(0, steps, block):  # interleave the two timed models in blocks
        chunk = batches[i:i + block]
        xs, ys = np.concatenate([b[0] for b in chunk]), np.concatenate([b[1] for b in chunk])
        for name, model in (("recipe", recipe), ("searched", searched), ("float32", f32)):
            model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                      callbacks=[times[name]] if name in times else [])
    evals = list(data.eval.take(8).as_numpy_iterator())
    ex, ey = np.concatenate([b[0] for b in evals]), np.concatenate([b[1] for b in evals])
    losses = {name: float(m.evaluate(ex, ey, batch_size=batch, verbose=0))
              for name, m in (("float32", f32), ("recipe", recipe), ("searched", searched))}
    warm = lambda t: t.times[len(t.times) // 5:]  # noqa: E731  (warm-up: the first fifth)
    step = {k: statistics.median(warm(v)) for k, v in times.items()}
    return {
        "family": family, "search_s": search_s, "passes": result.passes_per_batch,
        "candidates": len(result.layers), "search_float32": len(result.float32_layers),
        "chosen": result.float32_layers, "recipe_float32": _float32_count(recipe),
        "losses": losses, "step_ms": {k: 1e3 * v for k, v in step.items()},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    args = parser.parse_args(argv)
    sizes = dict(width=32, depth=1, seq_len=32, batch=8) if args.quick else dict(width=128, depth=2, seq_len=128, batch=32)
    steps = 12 if args.quick else args.steps
    print(f"automatic precision on the examples, {POLICY}, pydoc text, {steps} training steps, keras {keras.__version__}")
    print(f"{'model':<12} {'search s':>8} {'passes/batch':>12} {'fp32 layers search/recipe':>26} "
          f"{'loss fp32':>9} {'recipe':>8} {'searched':>8} {'step searched/recipe':>21}")
    for family in ("transformer", "cnn"):
        r = run(family, steps, **sizes)
        l, s = r["losses"], r["step_ms"]
        print(f"{family:<12} {r['search_s']:8.1f} {r['passes']:12d} "
              f"{str(r['search_float32']) + ' / ' + str(r['recipe_float32']):>26} "
              f"{l['float32']:9.4f} {l['recipe']:8.4f} {l['searched']:8.4f} "
              f"{s['searched'] / s['recipe']:21.3f}")
        print(f"{'':<12} chosen: {', '.join(r['chosen']) or '(none)'}; "
              f"step ms recipe {s['recipe']:.1f}, searched {s['searched']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

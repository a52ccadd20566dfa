"""`make demo`: what mixed precision bought, measured against float32 on the same data and seed.

    python examples/demo.py                     # about 3-5 minutes on 2 CPU cores

Trains the default example (examples/cnn.py: a causal dilated ResNet, next byte of Python's
documentation text, offline) twice: under `keras_amp.enable("auto")` with the "cnn" recipe, and
under float32. Each configuration runs in its own process (so each one's peak memory is its
own), the two taking turns epoch by epoch (so load from other programs hits both alike), from
the same initial weights over the same batches. Then it prints the held-out loss and accuracy of
each, the median step time after warm-up and the speed-up, the peak memory of each, the loss
scale and skipped steps under float16, the `check_model` verdict and where the logs went.
"""

from __future__ import annotations

import time

from absl import app

from common import compare, flags

flags.define(epochs=4, batch_size=32, steps_per_epoch=30, width=256, depth=4)
FLAGS = flags.FLAGS
# Targets of issue 11, for the 2-core CPU with bf16 instructions this project was built on.
MIN_SPEEDUP = 1.4
MAX_ACCURACY_DROP_POINTS = 1.0
MAX_LOSS_INCREASE = 0.02


def verdict(results) -> list[str]:
    """How the mixed-precision run compares with float32, against the targets above."""
    amp, base = results
    if amp["policy"] == "float32":
        return [f'"auto" chose float32 on this machine ({amp["reason"]}): nothing to compare.']
    speedup = base["median_step_s"] / amp["median_step_s"]
    drop = 100 * (base["eval_accuracy"] - amp["eval_accuracy"])
    loss_up = amp["eval_loss"] / base["eval_loss"] - 1
    quality = drop <= MAX_ACCURACY_DROP_POINTS or loss_up <= MAX_LOSS_INCREASE
    return [
        f'"auto" chose {amp["policy"]}: {amp["reason"]}',
        f"speed-up {speedup:.2f}x (target >= {MIN_SPEEDUP}x on the 2-core bf16 CPU this was built on): {'met' if speedup >= MIN_SPEEDUP else 'NOT met'}",
        f"accuracy {-drop:+.2f} points, loss {100 * loss_up:+.2f}% vs float32 (target: within "
        f"{MAX_ACCURACY_DROP_POINTS:g} point or {100 * MAX_LOSS_INCREASE:g}%): {'met' if quality else 'NOT met'}",
    ]


def main(argv):
    del argv
    start = time.perf_counter()
    settings = flags.settings("cnn", "cnn", "demo")
    results = compare.run(settings, [(FLAGS.policy, FLAGS.policy), ("float32", "float32")])
    print("\n" + compare.summary(results))
    print("\n".join(verdict(results)))
    print(f"demo wall time {time.perf_counter() - start:.0f} s (the runs' set-up included, this "
          "interpreter's start-up excluded)", flush=True)
    flags.write_results(results)
    return 0


if __name__ == "__main__":
    app.run(main)

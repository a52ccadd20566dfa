"""`make demo`: what mixed precision bought, measured against float32 on the same data and seed.

    python examples/demo.py                     # about 3-5 minutes on 2 CPU cores

Trains the default example (examples/cnn.py: a causal dilated ResNet, next byte of Python's
documentation text, offline) twice: under `keras_amp.enable("auto")` with the "cnn" recipe, and
under float32. Each configuration runs in its own process (so each one's peak memory is its
own), the two taking turns epoch by epoch (so load from other programs hits both alike), from
the same initial weights over the same batches. Then it prints the held-out loss and accuracy of
each, the median step time after warm-up and the speed-up, the peak memory of each, the loss
scale and skipped steps under float16, the `check_model` verdict and where the logs went, and
draws them in one picture (`--plot_file`; matplotlib: `pip install "keras-amp[plot]"`): the
training-loss curves read back from the runs' TensorBoard logs, step time and peak memory.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from absl import app
from absl import flags as absl_flags

from common import compare, flags

FLAGS = flags.FLAGS
# Same colour for a run in every panel.
_COLOURS = ("tab:orange", "tab:blue", "tab:green", "tab:red")


def define_flags() -> None:
    """The cnn example's flags with the demo's defaults, and --plot_file."""
    flags.define(epochs=4, batch_size=32, steps_per_epoch=30, width=256, depth=4, compare=False)
    absl_flags.DEFINE_string(
        "plot_file", None, "Write the picture (loss curves, step time, memory) here; default: "
        "demo.png in the run's folder; '' for none. Needs matplotlib: pip install \"keras-amp[plot]\".")
    flags.output_file("plot_file")


def policy_line(results) -> str:
    """What "auto" chose on this machine, and why; or the policy --policy asked for (the run's label)."""
    amp, requested = results[0], results[0]["label"]
    if requested != "auto":
        chose = f"--policy={requested}"
        return f"{chose}: nothing to compare." if amp["policy"] == "float32" else f"{chose}, against float32."
    if amp["policy"] == "float32":
        return f'"auto" chose float32 on this machine ({amp["reason"]}): nothing to compare.'
    return f'"auto" chose {amp["policy"]}: {amp["reason"]}'


def loss_curve(log_dir: str) -> list[tuple[int, float]]:
    """(epoch, training loss) pairs from a run's TensorBoard logs (its `epoch_loss` scalars)."""
    import tensorflow as tf

    points: dict[int, float] = {}
    for path in sorted(Path(log_dir, "logs").rglob("events.out.tfevents.*")):
        if "validation" in path.parts:
            continue
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.tag == "epoch_loss":
                    number = value.simple_value if value.HasField("simple_value") else tf.make_ndarray(value.tensor)
                    points[int(event.step)] = float(number)
    if not points:
        raise RuntimeError(f"No `epoch_loss` scalars in the TensorBoard logs under {log_dir}/logs")
    return sorted(points.items())


def _bars(ax, labels, values, unit, spec):
    """One bar per value (None: no bar, "n/a" written), each labelled with its value."""
    for i, (label, value) in enumerate(zip(labels, values)):
        height = 0.0 if value is None else value
        ax.bar(i, height, color=_COLOURS[i % len(_COLOURS)])
        ax.annotate("n/a" if value is None else f"{value:{spec}} {unit}", (i, height), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.margins(y=0.15)


def plot(results, path: str | os.PathLike | None = None):
    """The demo's picture of `compare.run` results: loss curves, median step time, peak memory.

    Returns the matplotlib Figure; writes it to `path` if given.
    """
    from keras_amp import plotting

    figure = plotting.new_figure(12.0, 3.8)
    loss_ax, time_ax, rss_ax, alloc_ax = figure.subplots(1, 4, width_ratios=(2.2, 1, 1, 1))
    labels = [f"{r['label']}\n{r['policy']}" for r in results]
    for i, r in enumerate(results):
        epochs, losses = zip(*loss_curve(r["log_dir"]))
        # The first run wide and faint, the others thin and dashed: curves that agree stay visible.
        style = dict(color=_COLOURS[i % len(_COLOURS)], alpha=0.55 if i == 0 else 1.0)
        loss_ax.plot([e + 1 for e in epochs], losses, marker="o", markersize=9 if i == 0 else 4,
                     linewidth=4 if i == 0 else 1.5, linestyle="-" if i == 0 else "--",
                     label=f"{r['label']} ({r['policy']}): training", **style)
        loss_ax.plot([epochs[-1] + 1], [r["eval_loss"]], marker="*", markersize=16 if i == 0 else 8,
                     linestyle="none", label=f"{r['label']}: held-out, end", **style)
    loss_ax.set(xlabel="epoch", ylabel="loss (cross-entropy)", title="training loss (epoch mean)")
    loss_ax.xaxis.get_major_locator().set_params(integer=True)
    loss_ax.legend(fontsize=7)
    steps = [r["median_step_s"] and 1e3 * r["median_step_s"] for r in results]
    _bars(time_ax, labels, steps, "ms", ".1f")
    base = next((r for r in results if r["policy"] == "float32"), None)
    speedups = [f"{base['median_step_s'] / r['median_step_s']:.2f}x" for r in results
                if base is not None and r is not base and r["median_step_s"] and base["median_step_s"]]
    time_ax.set_title("median step" + (f" (speed-up {', '.join(speedups)})" if speedups else ""), fontsize=9)
    _bars(rss_ax, labels, [r["rss_above_baseline_mib"] for r in results], "MiB", ".3g")
    rss_ax.set_title("peak RSS above start", fontsize=9)
    _bars(alloc_ax, labels, [r["allocator_peak_mib"] for r in results], "MiB", ".3g")
    alloc_ax.set_title("TF allocator peak", fontsize=9)
    figure.suptitle(f"make demo: {results[0]['data'].split(':')[0]}, {results[0]['params']:,} parameters\n"
                    + policy_line(results), fontsize=9, x=0.01, ha="left")
    if path is not None:
        plotting.save(figure, path)
    return figure


def main(argv):
    del argv
    start = time.perf_counter()
    if FLAGS.plot_file != "":
        from keras_amp import plotting

        try:
            plotting.require_matplotlib()  # before minutes of training, not after
        except ImportError as e:
            sys.exit(f"{e}\nOr pass --plot_file='' to run the demo without its picture.")
    settings = flags.settings("cnn", "cnn", "demo")
    results = flags.run(settings, [(FLAGS.policy, FLAGS.policy), ("float32", "float32")])
    print("\n" + compare.summary(results))
    print(policy_line(results))
    if FLAGS.plot_file != "":
        path = FLAGS.plot_file or os.path.join(settings.model_dir, "demo.png")
        plot(results, path)
        print(f"picture: {path}")
    print(f"demo wall time {time.perf_counter() - start:.0f} s (the runs' set-up included, this "
          "interpreter's start-up excluded)", flush=True)
    flags.write_results(results)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=flags.parse)

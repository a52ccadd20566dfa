"""The benchmark table as a picture: step time against float32, and peak memory, per workload.

`run_all.py` calls `plot()` with the raw results it builds its table from (the structures its
`--json` writes) and writes the picture beside its report (RESULTS.png; `--plot PATH`,
`--no-plot`). matplotlib is an optional extra (`pip install "keras-amp[plot]"`).

    python benchmarks/plot_table.py raw.json out.png    # redraw from `run_all.py --json raw.json`
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import textwrap

from keras_amp_console import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # before workloads imports TensorFlow: its start-up banner filtered out
import workloads  # noqa: E402

# Colour by kind of configuration; variants ("amp_bf16+head32") get the lighter shade.
_COLOURS = {"float32": "#6baed6", "stock": "#969696", "amp": "#fd8d3c"}
_VARIANT_COLOURS = {"float32": "#c6dbef", "stock": "#d9d9d9", "amp": "#fdd0a2"}


def _colour(name: str) -> str:
    kind, _, variant = workloads.parse_config(name)
    return (_VARIANT_COLOURS if variant else _COLOURS)[kind]


def _grouped(ax, groups: dict[str, dict[str, float | None]], spec: str) -> None:
    """Bars grouped by workload, one per configuration, each labelled with its value."""
    x = 0.0
    ticks, labels = [], []
    for workload, values in groups.items():
        start = x
        for name, value in values.items():
            height = 0.0 if value is None else value
            ax.bar(x, height, width=0.9, color=_colour(name), label=name)
            ax.annotate("n/a" if value is None else format(value, spec), (x, height), ha="center", va="bottom",
                        fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
            x += 1.0
        ticks.append((start + x - 1.0) / 2)
        labels.append(workload)
        x += 0.8  # gap between workloads
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.margins(y=0.25)


def time_vs_float32(results: dict) -> dict[str, dict[str, float]]:
    """Per workload, each configuration's median over blocks of its step time / float32's."""
    return {w: {name: statistics.median(blk[name] / blk["float32"] for blk in res["blocks"])
                for name in res["configs"]} for w, res in results.items()}


def memory_figure(memory: dict, figure: str) -> dict[str, dict[str, float | None]]:
    """Per workload, each measured configuration's `figure` ("tf_peak_mib", "rss_mib")."""
    return {w: {name: m.get(figure) for name, m in mem.items()} for w, mem in memory.items()}


def add_arguments(parser) -> None:
    """run_all.py's --plot and --no-plot."""
    parser.add_argument("--plot", help="write the picture here (default: the report's path with .png; "
                                       "with --smoke and no --results, none)")
    parser.add_argument("--no-plot", action="store_true", help="no picture (matplotlib not needed)")


def planned_path(parser, args, results_path: str | None) -> str | None:
    """Where the picture goes (None: none); a usage error now if matplotlib is missing."""
    path = None if args.no_plot else args.plot or (results_path and os.path.splitext(results_path)[0] + ".png")
    if path:
        from keras_amp import plotting  # noqa: PLC0415

        try:
            plotting.require_matplotlib()  # before the measurements, not after them
        except ImportError as e:
            parser.error(f"{e}. Or pass --no-plot.")
    return path


def plot(results: dict, memory: dict, loss_scale: dict | None, title: list[str], path=None):
    """Draws the table's figures; returns the matplotlib Figure and writes it to `path` if given.

    Args:
        results: Dict. Workload -> `bench_time.py` result (its "configs" and "blocks").
        memory: Dict. Workload -> configuration -> `report.median_memory` result.
        loss_scale: Dict or None. `bench_loss_scale.py`'s result.
        title: List of strings. Lines above the panels (the suite, the machine).
    """
    from keras_amp import plotting

    if not results and not memory:
        raise ValueError("`results` or `memory` must hold a measured workload. Received: results={}, memory={}")
    panels = [("step time / float32\n(median of per-block ratios; lower is faster)", time_vs_float32(results),
               ".2f", True)] if results else []
    if memory:
        panels += [("TF allocator peak (MiB)", memory_figure(memory, "tf_peak_mib"), ".3g", False),
                   ("peak RSS above import (MiB)", memory_figure(memory, "rss_mib"), ".3g", False)]
    bars = max(sum(len(v) for v in groups.values()) + len(groups) for _, groups, _, _ in panels)
    figure = plotting.new_figure(max(9.0, 0.3 * bars * len(panels)), 4.6)
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, groups, spec, unit_line) in zip(axes, panels):
        _grouped(ax, groups, spec)
        ax.set_title(name, fontsize=9)
        if unit_line:
            ax.axhline(1.0, color="black", linewidth=0.8)
    names = {}  # one legend entry per configuration
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            names.setdefault(label, handle)
    figure.legend(names.values(), names.keys(), loc="outside lower center", ncols=min(len(names), 6), fontsize=8,
                  frameon=False)
    lines = [line.lstrip("#- ").strip() for line in title]
    if loss_scale is not None:
        lines.append(f"loss scaling (mixed_float16 MLP): keras_amp / stock LossScaleOptimizer step time "
                     f"{loss_scale['median_ratio']:.3f}")
    figure.suptitle("\n".join(textwrap.shorten(line, 160, placeholder=" ...") for line in lines), fontsize=8,
                    x=0.01, ha="left")
    if path is not None:
        plotting.save(figure, path)
    return figure


def write(path: str | None, results: dict, memory: dict, loss_scale: dict | None, title: list[str]) -> None:
    """run_all.py's picture: drawn to `path` unless `path` is None or nothing was measured."""
    if path and (results or memory):
        plot(results, memory, loss_scale, title, path)
        print(f"picture: {path}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.exit("usage: python benchmarks/plot_table.py RAW_JSON OUT_PNG (RAW_JSON from run_all.py --json)")
    raw_path, out = argv
    with open(raw_path) as f:
        raw = json.load(f)
    plot(raw["time"], raw["memory"], raw["loss_scale"], [f"keras_amp benchmark suite: {os.path.basename(raw_path)}"],
         out)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The suite's report: the markdown tables of `run_all.py` (step time, forward pass, memory, loss
scaling) and the target lines, from the raw results its child processes return."""

from __future__ import annotations

import statistics

import targets

MEMORY_FIGURES = ("rss_mib", "tf_peak_mib", "saved_mib")  # compared, each against stock and float32
MEDIAN_FIGURES = (*MEMORY_FIGURES, "rss_file_mib")  # rss_file_mib: of rss_mib, mapped files paged in


def paired(blocks: list[dict], a: str, b: str) -> tuple[float, float, float]:
    """Median, min and max over blocks of a/b (each ratio from runs made side by side)."""
    ratios = [blk[a] / blk[b] for blk in blocks]
    return statistics.median(ratios), min(ratios), max(ratios)


def _fmt(x, spec=".3f", none="–"):
    return none if x is None else format(x, spec)


def _quartiles(values: list[float]) -> str:
    """'a–b', the middle half of `values` (one value: itself)."""
    if len(values) < 2:
        return _fmt(values[0]) if values else "–"
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{q1:.3f}–{q3:.3f}"


def median_memory(samples: list[dict]) -> dict:
    """One configuration's memory: the median of each figure over its processes, and their range."""
    found = dict(samples[0])
    for fig in MEDIAN_FIGURES:
        values = [r[fig] for r in samples if r.get(fig) is not None]
        found[fig] = statistics.median(values) if values else None
        found[fig + "_range"] = (min(values), max(values)) if values else None
    found["samples"] = len(samples)
    return found


def _memory_rows(memory: dict) -> list[str]:
    lines = [
        "",
        "| model | config | RSS MiB (of it files) | TF peak MiB (range) | saved MiB | RSS vs stock | TF peak vs stock "
        "| saved vs stock | RSS vs float32 | TF peak vs float32 | saved vs float32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, mem in memory.items():
        for name, m in mem.items():
            m32, ms = mem.get("float32") or {}, mem.get(targets.stock_of(name)) or {}
            span = m.get("tf_peak_mib_range")
            spread = f" ({span[0]:.0f}–{span[1]:.0f})" if span and m["samples"] > 1 else ""
            peak = _fmt(m.get("tf_peak_mib"), ".0f") + spread
            saved = _fmt(m.get("saved_mib"), ".1f") + (" + loops" if m.get("saved_unsized") else "")
            files = m.get("rss_file_mib")
            rss = _fmt(m.get("rss_mib"), ".0f") + ("" if files is None else f" ({files:.0f})")
            cells = [rss, peak, saved]
            for ref in (ms, m32):
                cells += [_fmt(targets.ratio(m.get(f), ref.get(f)) if ref is not m else None) for f in MEMORY_FIGURES]
            lines.append(f"| {workload} | {name} | " + " | ".join(cells) + " |")
    return lines


def build_table(results: dict, memory: dict, loss_scale: dict | None, header: list[str],
                amx: bool = False) -> tuple[str, list[str]]:
    """The markdown report and the list of target lines (each ending in OK or MISSED); `amx`: whether
    the machine has the AMX CPU that issue 26's vs-float32 floors are set for."""
    lines = list(header)
    lines += [
        "",
        "| model | config | head | step ms | throughput | vs float32 | vs stock | block spread vs stock "
        "| CPU-time vs stock |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    found: list[str] = []
    for workload in dict.fromkeys([*results, *memory]):
        res = results.get(workload)
        mem = memory.get(workload, {})
        for name in (res["configs"] if res else mem):
            if res is None:  # memory measured, time failed: memory targets only
                found += targets.memory_targets(workload, name, mem)
                continue
            blocks = res["blocks"]
            median = statistics.median(blk[name] for blk in blocks)
            rate = res["units_per_step"] / median
            vs32 = paired(blocks, name, "float32")[0] if name != "float32" else None
            stock = targets.stock_of(name)
            vs_stock = paired(blocks, name, stock) if stock in res["configs"] else None
            cpu_blocks = res.get("cpu_blocks")
            cpu_vs_stock = paired(cpu_blocks, name, stock)[0] if vs_stock and cpu_blocks else None
            if name.startswith("stock_"):
                vs_stock = cpu_vs_stock = None
            lines.append(
                f"| {workload} | {name} | {res['head_dtype'].get(name, '?')} | {median * 1e3:.1f} "
                f"| {rate:,.0f} {res['unit']}/s | {_fmt(vs32)} | {_fmt(vs_stock and vs_stock[0])} "
                f"| {'–' if not vs_stock else f'{vs_stock[1]:.3f}–{vs_stock[2]:.3f}'} "
                f"| {_fmt(cpu_vs_stock)} |"
            )
            if "+" in name or not name.startswith("amp_"):
                continue
            forward = res.get("forward_blocks")
            forward_vs32 = paired(forward, name, "float32")[0] if forward and name in forward[0] else None
            found += targets.time_targets(workload, name, vs32, vs_stock and vs_stock[0], cpu_vs_stock, forward_vs32)
            found += targets.memory_targets(workload, name, mem)
    lines += _forward_rows(results)
    if memory:
        lines += _memory_rows(memory)
        lines += ["", "Memory: RSS above the import baseline (of it, in brackets, the growth of mapped files: "
                      "shared-library code paged in, such as XLA's CPU compiler where a configuration compiles "
                      "with XLA) and TF's allocator peak (medians over the processes, range in brackets), saved "
                      "= the forward tensors the backward pass reads "
                      "(`keras_amp.diagnostics.saved_activations`, deterministic; \"+ loops\": an RNN loop's "
                      "per-step tensors, TensorLists without a static size, come on top)."]
    if loss_scale is not None:
        found.append(targets.line("loss scaling keras_amp/stock LossScaleOptimizer (mixed_float16, MLP) time",
                                  loss_scale["median_ratio"], targets.LOSS_SCALE_TARGET))
        lines += ["", f"Loss scaling (bench_loss_scale.py, {loss_scale['params']:,}-parameter MLP, batch "
                      f"{loss_scale['batch']}, mixed_float16, {loss_scale['blocks']} blocks x "
                      f"{loss_scale['block_steps']} steps): stock {loss_scale['median_step_ms']['stock']:.1f} ms, "
                      f"keras_amp {loss_scale['median_step_ms']['keras_amp']:.1f} ms per step; median ratio "
                      f"{loss_scale['median_ratio']:.3f} (middle half of the blocks "
                      f"{_quartiles(loss_scale['block_ratios'])})."]
    lines += ["", "Targets (keras_amp = amp_*, ratios are medians of per-block ratios). "
              + targets.float32_note(amx), ""]
    lines += [f"- {t}" for t in found]
    return "\n".join(lines), found


def _forward_rows(results: dict) -> list[str]:
    """The inference forward pass alone, from the same blocks as the steps (`bench_time.py --forward`)."""
    rows = []
    for workload, res in results.items():
        blocks = res.get("forward_blocks")
        for name in blocks[0] if blocks else ():
            stock = targets.stock_of(name)
            vs_stock = paired(blocks, name, stock) if stock in blocks[0] else None
            rows.append(f"| {workload} | {name} | {statistics.median(b[name] for b in blocks) * 1e3:.1f} "
                        f"| {_fmt(paired(blocks, name, 'float32')[0] if name != 'float32' else None)} "
                        f"| {_fmt(vs_stock and vs_stock[0])} "
                        f"| {'–' if not vs_stock else f'{vs_stock[1]:.3f}–{vs_stock[2]:.3f}'} |")
    if not rows:
        return []
    return ["", "Forward pass alone (inference: `model(x, training=False)`, compiled as the model's steps are), "
                "timed in the same blocks:", "",
            "| model | config | forward ms | vs float32 | vs stock | block spread vs stock |",
            "|---|---|---|---|---|---|", *rows]

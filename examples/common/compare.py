"""Runs configurations and prints what mixed precision bought.

One configuration trains in this process. Several (the mixed-precision run and its float32
twin) each train in their own spawned process, so each one's peak memory is its own, and they
take turns epoch by epoch (the order alternating), so load from other programs on the machine
hits both alike. Both see the same seed, hence the same initial weights and the same batches.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

from common.resume import ResumeError
from common.trainer import Settings, Trainer


def die_with_parent(parent: int) -> None:
    """Ends this process when process `parent` dies (Linux: `PR_SET_PDEATHSIG`). A twin whose run was
    killed would otherwise train on to its epoch's end and write a checkpoint the run never saw, racing
    a `--resume` started at once. Elsewhere the pipe ends it at its next message."""
    if not sys.platform.startswith("linux"):
        return
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1: PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def _child(conn, settings: Settings, policy: str, label: str, parent: int) -> None:
    die_with_parent(parent)
    import common

    common.import_tensorflow_quietly()  # a spawned process: absl's app.run did not start it
    try:
        trainer = Trainer(settings, policy, label=label)
        conn.send(("ready", trainer.start_epoch))
        while True:
            command, arg = conn.recv()
            if command == "epoch":
                conn.send(("logs", trainer.run_epoch(arg)))
            else:
                conn.send(("result", trainer.finish()))
                return
    except ResumeError as e:  # the parent reports it as its own (one line, no traceback)
        conn.send(("resume_error", str(e)))
    except BaseException as e:  # report, then let the parent stop
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise


class _Remote:
    """A `Trainer` in a spawned process, driven over a pipe."""

    def __init__(self, context, settings: Settings, policy: str, label: str):
        self.label = label
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_child, args=(child_conn, settings, policy, label, os.getpid()),
                                       daemon=True)
        self.process.start()
        self.start_epoch = self._expect("ready")

    def _expect(self, kind: str):
        try:
            got, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"{self.label} run died (exit code {self.process.exitcode})") from None
        if got == "resume_error":
            raise ResumeError(value)
        if got == "error":
            raise RuntimeError(f"{self.label} run failed: {value}")
        return value

    def run_epoch(self, epoch: int) -> dict[str, float]:
        self.conn.send(("epoch", epoch))
        return self._expect("logs")

    def finish(self) -> dict[str, Any]:
        self.conn.send(("finish", None))
        result = self._expect("result")
        self.process.join(60)
        return result

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def take_turns(runs: list, epochs: int) -> list[float]:
    """Trains `runs` up to `epochs` epochs, taking turns by epoch (the order alternating); returns each
    run's training seconds. A resumed run starts after its last saved epoch (`start_epoch`): twins
    killed between their turns have saved different counts, and each goes on from its own."""
    train_s = [0.0] * len(runs)
    order = list(range(len(runs)))
    for epoch in range(min((r.start_epoch for r in runs), default=epochs), epochs):
        for i in order if epoch % 2 == 0 else order[::-1]:
            if epoch < runs[i].start_epoch:
                continue
            print(f"[{runs[i].label}] epoch {epoch + 1}/{epochs}", flush=True)
            start = time.perf_counter()
            runs[i].run_epoch(epoch)
            train_s[i] += time.perf_counter() - start
    return train_s


def run(settings: Settings, configs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Trains each `(label, policy)` for `settings.epochs` epochs; returns their results in order."""
    runs: list = []
    print(f"TensorBoard logs and checkpoints: {settings.model_dir}", flush=True)
    try:
        if len(configs) == 1:
            runs.append(Trainer(settings, configs[0][1], label=configs[0][0]))
        else:
            context = multiprocessing.get_context("spawn")
            runs.extend(_Remote(context, settings, policy, label) for label, policy in configs)
        train_s = take_turns(runs, settings.epochs)
        results = [r.finish() for r in runs]
        for result, seconds in zip(results, train_s):
            result["train_s"] = seconds
        return results
    finally:
        for remote in runs:
            if isinstance(remote, _Remote):
                remote.close()


def _fmt(value, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def summary(results: list[dict[str, Any]]) -> str:
    """A table of the runs, the speed-up and memory ratio against the float32 run, and the checks."""
    rows = [("run", "policy", "eval loss", "eval acc", "train loss (last epoch mean)", "median step", "peak RSS+",
             "TF alloc peak")]
    for r in results:
        rows.append((r["label"], r["policy"], _fmt(r["eval_loss"], ".4f"), _fmt(r["eval_accuracy"], ".4f"),
                     _fmt(r["train_loss"], ".4f"), _fmt(r["median_step_s"] and 1e3 * r["median_step_s"], ".1f", " ms"),
                     _fmt(r["rss_above_baseline_mib"], ".0f", " MiB"), _fmt(r["allocator_peak_mib"], ".0f", " MiB")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    first = results[0]
    lines.append(f"data: {first['data']}; model: {first['params']:,} parameters")
    lines.append("training time (set-up excluded): " + ", ".join(f"{r['label']} {r['train_s']:.0f} s" for r in results))
    for r in results:
        if "loss_scale" in r:
            lines.append(f"{r['label']}: loss scale {r['loss_scale']:g}, skipped (overflow) steps "
                         f"{r['overflow_count']} of {r['total_steps']}")
    base = next((r for r in results if r["policy"] == "float32"), None)
    for r in results:
        if r is base or base is None:
            continue
        if r["median_step_s"] and base["median_step_s"]:
            lines.append(f"speed-up {r['label']} vs float32: {base['median_step_s'] / r['median_step_s']:.2f}x "
                         f"(median step over {r['timed_steps']} and {base['timed_steps']} steps after warm-up)")
        lines.append(f"accuracy {r['label']} - float32: {100 * (r['eval_accuracy'] - base['eval_accuracy']):+.2f} "
                     f"points; loss {100 * (r['eval_loss'] / base['eval_loss'] - 1):+.2f}%")
    for r in results:
        if r["policy"] != "float32":
            lines.append(f"{r['label']}: {r['check_model']}")
    for r in results:
        lines.append(f"{r['label']}: TensorBoard logs and checkpoint in {r['log_dir']}")
    return "\n".join(lines)

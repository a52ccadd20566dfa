"""Helpers for the distributed tests: run a scenario script in subprocesses, parse its RESULT line.

Import it as `from tests.distribute import harness` (pyproject puts the repository root on the
path). Scenarios live in tests/distribute/scenarios/, one script per case, each printing one
`RESULT {json}` line (see scenarios/common.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from keras_amp.distribute import local_cluster

SCENARIOS = Path(__file__).parent / "scenarios"
REPO = Path(__file__).resolve().parents[2]
# Generous for 2 shared cores, but bounded: a deadlock fails the test instead of hanging it.
COLLECTIVE_TIMEOUT = 90
CLUSTER_TIMEOUT = 300
ENV = {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def argv(name: str, *args) -> list[str]:
    """The command that runs scenario `name` with this interpreter."""
    return local_cluster.python_argv(str(SCENARIOS / f"{name}.py"), *map(str, args))


def tagged(text: str, tag: str) -> list[dict]:
    """The JSON payloads of the lines of `text` that start with `tag`."""
    return [json.loads(line[len(tag) + 1 :]) for line in text.splitlines() if line.startswith(tag + " ")]


def result_of(worker: local_cluster.WorkerResult) -> dict:
    found = tagged(worker.stdout, "RESULT")
    assert len(found) == 1, f"no RESULT line\n{worker.tail()}"
    return found[0]


def cluster(name: str, *args, timeout: float = CLUSTER_TIMEOUT) -> tuple[list[local_cluster.WorkerResult], list[dict]]:
    """Runs scenario `name` on 2 local workers; returns the raw results and the parsed RESULTs."""
    workers = local_cluster.launch(argv(name, *args), 2, timeout=timeout, env=ENV)
    for w in workers:
        assert not w.timed_out, f"scenario {name} {args} hung\n{w.tail()}"
    return workers, [result_of(w) for w in workers]


def single(name: str, *args, timeout: float = 240) -> dict:
    """Runs scenario `name` as one process (no TF_CONFIG) and returns its RESULT."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(ENV, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(argv(name, *args), capture_output=True, text=True, timeout=timeout, env=env)
    worker = local_cluster.WorkerResult(0, proc.returncode, proc.stdout, proc.stderr, False)
    return result_of(worker)

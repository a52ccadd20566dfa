"""A local-cluster tool: run multi-worker TensorFlow code on one machine, without a scheduler.

Two ways to try `tf.distribute` code where there is no cluster and no GPU:

- `configure_logical_cpus(n)`: split the CPU into `n` logical devices, so `mirrored()` has
  `n` replicas in one process;
- `LocalCluster` / `launch()`: start N Python processes on 127.0.0.1, each with its own
  TF_CONFIG, forming one `MultiWorkerMirroredStrategy` cluster.

This is a development and testing tool (keras_amp's distributed tests and
`examples/multi_worker.py` use it), not a way to run production jobs: on a real cluster the
scheduler starts the workers and sets TF_CONFIG. Every worker's stdout/stderr goes to a file (a
full pipe would block a worker mid-collective and look like a deadlock), every wait is bounded,
and leaving the `with` block kills whatever is still running.

Example:
    >>> from keras_amp.distribute import local_cluster
    >>> results = local_cluster.launch([sys.executable, "train.py"], 2, timeout=600)
    >>> assert all(r.ok for r in results), [r.tail() for r in results]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Sequence

from absl import logging

from keras_amp import validation

HOST = "127.0.0.1"
# More local processes than this is a mistake, not a cluster; the bound also keeps `free_ports`
# below the usual open-file limit (it holds every socket open at once to make the ports distinct).
MAX_LOCAL_WORKERS = 256


def configure_logical_cpus(count: int) -> list:
    """Splits the first CPU into `count` logical devices, e.g. to try MirroredStrategy without GPUs.

    Must run before TensorFlow initialises its devices (before any op or strategy is created).

    Args:
        count: Int. Number of logical CPU devices, 1 to 256.

    Returns:
        The logical CPU devices (`tf.config.LogicalDevice`).
    """
    import tensorflow as tf  # only here: launching workers must not pay for importing TensorFlow

    count = validation.check_int("count", count, min_value=1, max_value=MAX_LOCAL_WORKERS)
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError as e:
        raise RuntimeError(
            "configure_logical_cpus() must be called before TensorFlow initialises its devices "
            f"(before creating any tensor or strategy). Received: count={count}; TensorFlow said: {e}"
        ) from e
    return tf.config.list_logical_devices("CPU")


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """How one worker process ended.

    Args:
        index: Int. Task index of the worker in the cluster.
        returncode: Int. Exit status; negative for a signal (-9 for SIGKILL).
        stdout: String. Everything the worker wrote to stdout.
        stderr: String. Everything the worker wrote to stderr.
        timed_out: Bool. True when the launcher killed the worker because a wait ran out.
    """

    index: int
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def tail(self, chars: int = 3000) -> str:
        """The end of stdout and stderr, for assertion messages."""
        return f"--- worker {self.index} rc={self.returncode} timed_out={self.timed_out}\n" \
            f"[stdout]\n{self.stdout[-chars:]}\n[stderr]\n{self.stderr[-chars:]}"


def free_ports(count: int) -> list[int]:
    """`count` (1 to 256) distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    count = validation.check_int("count", count, min_value=1, max_value=MAX_LOCAL_WORKERS)
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in socks:
            s.bind((HOST, 0))  # held open together, so the ports are distinct
        return [s.getsockname()[1] for s in socks]


def _check_ports(ports) -> list[int]:
    validation.check_type("ports", ports, (list, tuple), "a list of port numbers")
    if not ports:
        raise ValueError("`ports` must name at least one port. Received: ports=[]")
    return [validation.check_int("ports", p, min_value=1, max_value=65535) for p in ports]


def tf_config(ports: Sequence[int], index: int, *, host: str = HOST) -> dict:
    """The TF_CONFIG dict of worker `index` in a cluster of workers on `host:ports`."""
    ports = _check_ports(ports)
    index = validation.check_int("index", index, min_value=0, max_value=len(ports) - 1)
    validation.check_type("host", host, str, "a host name or address string")
    return {"cluster": {"worker": [f"{host}:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}


def _check_argv(argv) -> list[str]:
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence):
        raise TypeError(
            "`argv` must be a list of strings (the command and its arguments). "
            f"Received: argv={argv!r} of type {type(argv).__name__}"
        )
    if not argv:
        raise ValueError("`argv` must hold at least the program to run. Received: argv=[]")
    for item in argv:
        validation.check_type("argv", item, str, "a list of strings")
    return list(argv)


def _check_env(name: str, env) -> dict[str, str]:
    if env is None:
        return {}
    validation.check_type(name, env, Mapping, "a mapping of str to str or None")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"`{name}` must map strings to strings. Received: {name}[{key!r}]={value!r} "
                f"of type {type(value).__name__}"
            )
    return dict(env)


def _check_worker_env(worker_env, num_workers: int) -> dict[int, dict[str, str]]:
    if worker_env is None:
        return {}
    validation.check_type("worker_env", worker_env, Mapping, "a mapping of worker index to environment, or None")
    return {
        validation.check_int("worker_env", k, min_value=0, max_value=num_workers - 1): _check_env(f"worker_env[{k}]", v)
        for k, v in worker_env.items()
    }


class LocalCluster:
    """Runs `argv` as `num_workers` processes forming one `MultiWorkerMirroredStrategy` cluster.

    Args:
        argv: Sequence of strings. The command of every worker, e.g.
            `[sys.executable, "scenario.py", "--steps", "4"]`.
        num_workers: Int. Number of worker processes (default 2).
        env: Mapping or None. Extra environment for every worker; TF_CONFIG is set per worker.
        worker_env: Mapping from worker index to extra environment for that worker only.
        log_dir: String or None. Where worker logs are written; a temporary folder by default.

    Example:
        >>> with LocalCluster([sys.executable, "train.py"], num_workers=2) as cluster:
        ...     results = cluster.wait(timeout=300)
        >>> assert all(r.ok for r in results), [r.tail() for r in results]
    """

    def __init__(
        self,
        argv: Sequence[str],
        num_workers: int = 2,
        *,
        env: Mapping[str, str] | None = None,
        worker_env: Mapping[int, Mapping[str, str]] | None = None,
        log_dir: str | None = None,
    ):
        self.argv = _check_argv(argv)
        self.num_workers = validation.check_int("num_workers", num_workers, min_value=1, max_value=MAX_LOCAL_WORKERS)
        self._env = _check_env("env", env)
        self._worker_env = _check_worker_env(worker_env, self.num_workers)
        if log_dir is not None:
            validation.check_type("log_dir", log_dir, (str, os.PathLike), "a folder path or None")
        self.ports = free_ports(self.num_workers)
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="keras_amp_cluster_")
        self.log_dir = log_dir or self._tmp.name
        self._procs: dict[int, subprocess.Popen] = {}
        self._starts: dict[int, int] = {}
        self._timed_out: set[int] = set()

    def _paths(self, index: int) -> tuple[str, str]:
        n = self._starts.get(index, 0)
        base = os.path.join(self.log_dir, f"worker{index}.run{n}")
        return base + ".out", base + ".err"

    def start_worker(self, index: int, *, env: Mapping[str, str] | None = None) -> None:
        """Starts (or restarts, after `kill`) worker `index`; `env` adds to its environment."""
        index = validation.check_int("index", index, min_value=0, max_value=self.num_workers - 1)
        env = _check_env("env", env)
        if index in self._procs and self._procs[index].poll() is None:
            raise ValueError(f"Worker {index} is still running; kill it before restarting it.")
        self._starts[index] = self._starts.get(index, -1) + 1
        self._timed_out.discard(index)
        full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
        full_env.update(self._env)
        full_env.update(self._worker_env.get(index, {}))
        full_env.update(env)
        full_env["TF_CONFIG"] = json.dumps(tf_config(self.ports, index))
        out_path, err_path = self._paths(index)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            # A new session per worker: killing one never signals the pytest process.
            self._procs[index] = subprocess.Popen(
                self.argv, stdout=out, stderr=err, env=full_env, start_new_session=True
            )
        logging.info("keras_amp.distribute.local_cluster: worker %d pid %d (%s)", index, self._procs[index].pid, out_path)

    def _proc(self, index: int) -> subprocess.Popen:
        index = validation.check_int("index", index, min_value=0, max_value=self.num_workers - 1)
        if index not in self._procs:
            raise ValueError(f"Worker {index} was never started; call start() first. Received: index={index}")
        return self._procs[index]

    def start(self) -> "LocalCluster":
        """Starts every worker."""
        for i in range(self.num_workers):
            self.start_worker(i)
        return self

    def pid(self, index: int) -> int:
        """Process id of worker `index`."""
        return self._proc(index).pid

    def output(self, index: int) -> str:
        """What worker `index` has written to stdout so far (current run)."""
        self._proc(index)
        with open(self._paths(index)[0], "rb") as f:
            return f.read().decode("utf-8", "replace")

    def wait_for_output(self, index: int, text: str, *, timeout: float) -> bool:
        """Polls until worker `index` prints `text`; False if it exits or `timeout` passes first."""
        timeout = validation.check_float("timeout", timeout, min_value=0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output(index):
                return True
            if self._proc(index).poll() is not None:
                return text in self.output(index)
            time.sleep(0.05)
        return False

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` (SIGKILL by default) to worker `index` and reaps it."""
        proc = self._proc(index)
        if proc.poll() is None:
            os.kill(proc.pid, sig)
            proc.wait(timeout=30)

    def wait(self, timeout: float) -> list[WorkerResult]:
        """Waits for every worker; kills those still running after `timeout` seconds."""
        timeout = validation.check_float("timeout", timeout, min_value=0)
        deadline = time.monotonic() + timeout
        for index, proc in sorted(self._procs.items()):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._timed_out.add(index)
                self.kill(index)
        return [self.result(i) for i in sorted(self._procs)]

    def result(self, index: int) -> WorkerResult:
        """How worker `index` ended (after `wait` or `kill`)."""
        proc = self._proc(index)
        if proc.poll() is None:
            raise ValueError(f"Worker {index} is still running; call wait() first.")
        out_path, err_path = self._paths(index)
        with open(out_path, "rb") as out, open(err_path, "rb") as err:
            return WorkerResult(
                index=index,
                returncode=proc.returncode,
                stdout=out.read().decode("utf-8", "replace"),
                stderr=err.read().decode("utf-8", "replace"),
                timed_out=index in self._timed_out,
            )

    def close(self) -> None:
        """Kills every worker still running and removes the temporary log folder."""
        for index in list(self._procs):
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                self.kill(index)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def launch(
    argv: Sequence[str],
    num_workers: int = 2,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    worker_env: Mapping[int, Mapping[str, str]] | None = None,
) -> list[WorkerResult]:
    """Runs `argv` as a local cluster of `num_workers` processes and returns how each ended.

    Args:
        argv: Sequence of strings. The command every worker runs.
        num_workers: Int. Number of worker processes (default 2).
        timeout: Float. Seconds for the whole cluster; workers still running then are killed and
            reported with `timed_out=True`.
        env: Mapping or None. Extra environment for every worker.
        worker_env: Mapping from worker index to extra environment for that worker.

    Returns:
        A list of `WorkerResult`, by worker index.
    """
    timeout = validation.check_float("timeout", timeout, min_value=0, min_inclusive=False)
    with LocalCluster(argv, num_workers, env=env, worker_env=worker_env) as cluster:
        return cluster.wait(timeout)


def python_argv(script: str, *args: str) -> list[str]:
    """`[sys.executable, script, *args]`: run a scenario with this interpreter."""
    validation.check_type("script", script, (str, os.PathLike), "a path")
    for i, arg in enumerate(args):
        validation.check_type(f"args[{i}]", arg, str, "a string")
    return [sys.executable, script, *args]

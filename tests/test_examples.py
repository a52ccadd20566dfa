"""Every example in a smoke mode (a few steps, tiny sizes): offline data, and tfds through mock_data.

Each run is a subprocess (absl flags, fresh global state). The tfds runs go through
`tfds.testing.mock_data` with `MockPolicy.USE_CODE` and an empty data_dir: generated examples,
no download, no network. The offline tests replace the socket connection: no test uses the network.
"""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY = ["--epochs=2", "--steps_per_epoch=3", "--batch_size=8", "--seq_len=16", "--width=16", "--depth=1",
        "--eval_steps=2", "--verbose=2"]
UNIFORM_BYTE_LOSS = math.log(256)  # cross-entropy of a model that has learned nothing about bytes

# Runs an example as __main__: inside tfds.testing.mock_data (mock=1; downloads are no-ops there, so
# the network check is told "online"), offline (mock=offline: every connection fails), or as it is.
_RUNNER = """
import os, runpy, socket, sys
script, mock, data_dir, *args = sys.argv[1:]
sys.argv = [script, *args]
sys.path.insert(0, os.path.dirname(script))
if mock == "offline":
    def offline(address, *args, **kwargs):
        open(os.path.join(data_dir + ".probed"), "w").write(repr(address))
        raise socket.gaierror(-3, "Temporary failure in name resolution")
    socket.create_connection = offline
if mock == "1":
    import tensorflow_datasets as tfds
    from common import data
    data._unreachable = lambda *a: None
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE, data_dir=data_dir):
        runpy.run_path(script, run_name="__main__")
else:
    runpy.run_path(script, run_name="__main__")
"""
# TensorFlow's start-up banner: absl's notice and INFO lines written before absl is initialised.
BANNER = re.compile(r"^(I\d{4} .*\] |WARNING: All log messages before absl)", re.M)


def launch(name, tmp_path, *args, mock="0", timeout=300, env=None):
    """Runs examples/<name>.py through the runner, TF_CPP_MIN_LOG_LEVEL unset (the examples set it)."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items()
           if k not in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_AMP_QUIET_TF")}
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, str(EXAMPLES / f"{name}.py"), mock, str(tmp_path / "tfds"), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )


def run_example(name, tmp_path, *args, mock=False, timeout=300):
    """Runs examples/<name>.py with `args`; returns (stdout, the results JSON); stderr has no banner."""
    results = tmp_path / "new folder" / "results.json"  # a folder that does not exist yet: the example makes it
    out = launch(name, tmp_path, f"--model_dir={tmp_path / 'runs'}", f"--results_file={results}", *args,
                 mock="1" if mock else "0", timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not BANNER.search(out.stderr), out.stderr[:3000]
    return out.stdout, json.loads(results.read_text())


def assert_logged(result):
    """The run wrote TensorBoard scalars and a checkpoint under its log_dir."""
    log_dir = Path(result["log_dir"])
    assert any(p.name.startswith("events.out.tfevents") for p in (log_dir / "logs").rglob("*")), log_dir
    assert (log_dir / "checkpoint.weights.h5").exists() or (log_dir / "checkpoint").is_dir(), log_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "transformer", "rnn", "custom_loop"])
def test_example_offline_default_data(name, tmp_path):
    stdout, (result,) = run_example(name, tmp_path, *TINY, "--learning_rate=1e-2", "--show_plan")
    assert "Python's pydoc_data.topics (offline)" in result["data"]
    # One header per epoch (ours, naming the run; not Keras's "Epoch 1/2" besides), the plan once.
    assert len(re.findall(r"epoch 1/2", stdout, re.I)) == 1 and f"[{result['label']}] epoch 2/2" in stdout, stdout
    recipe = {"cnn": "cnn", "rnn": "rnn"}.get(name, "transformer")
    assert stdout.count(f"recipe '{recipe}', compute policy") == (result["policy"] != "float32"), stdout
    assert f"[auto] policy {result['policy']}: " in stdout
    assert result["policy"] in ("mixed_bfloat16", "mixed_float16", "float32")
    assert result["timed_steps"] == 3  # the second epoch, after the first (warm-up)
    assert math.isfinite(result["eval_loss"]) and 0.0 <= result["eval_accuracy"] <= 1.0
    # Six steps at lr 1e-2 on real text already beat the uniform-byte guess by a margin; the LSTMs'
    # is smaller (seeds 0-4: 0.32-0.47 nats below it).
    assert result["eval_loss"] < UNIFORM_BYTE_LOSS - (0.25 if name == "rnn" else 0.5), result
    assert result["rss_above_baseline_mib"] > 0
    assert "check_model(" in result["check_model"] and "median step" in stdout
    assert_logged(result)


@pytest.mark.slow
@pytest.mark.parametrize("name,dataset,task_text", [
    ("cnn", "mnist", "images (28, 28, 1)"),
    ("transformer", "tiny_shakespeare", "held-out windows of 16 bytes"),
    ("rnn", "imdb_reviews", "first 16 bytes of each review"),
])
def test_example_tfds_mock(name, dataset, task_text, tmp_path):
    _, (result,) = run_example(name, tmp_path, *TINY, f"--dataset={dataset}", "--max_examples=16", mock=True)
    assert result["data"].startswith(f"tensorflow-datasets {dataset}") and task_text in result["data"], result
    assert math.isfinite(result["eval_loss"]) and math.isfinite(result["train_loss"])


@pytest.mark.slow
def test_compare_float32_trains_the_twin_on_the_same_data_and_seed(tmp_path):
    stdout, (amp, base) = run_example("transformer", tmp_path, *TINY, "--policy=mixed_float16", "--compare_float32")
    assert (amp["policy"], base["policy"]) == ("mixed_float16", "float32")
    # float16 needs loss scaling: the scale and the counters are reported (no step skipped here).
    assert amp["loss_scale"] >= 1 and amp["overflow_count"] == 0 and amp["total_steps"] == 6
    assert "loss_scale" not in base
    # Same initial weights and batches: after six steps the two differ only by float16 rounding.
    # (A different seed or data order moves the loss by far more than 1%.)
    assert abs(amp["train_loss"] / base["train_loss"] - 1) < 0.01, (amp["train_loss"], base["train_loss"])
    assert abs(amp["eval_loss"] / base["eval_loss"] - 1) < 0.01, (amp["eval_loss"], base["eval_loss"])
    assert "speed-up mixed_float16 vs float32" in stdout
    assert Path(amp["log_dir"]).name == "mixed_float16" and Path(base["log_dir"]).name == "float32"
    assert_logged(amp)
    assert_logged(base)


@pytest.mark.slow
def test_custom_loop_float16_counters(tmp_path):
    stdout, (result,) = run_example("custom_loop", tmp_path, *TINY, "--policy=mixed_float16", "--verbose=1")
    assert "loss scale" in stdout and "of which applied" in stdout
    # The bar says which loss is the last batch's and which the epoch's mean; so does the summary.
    assert "batch loss: " in stdout and " - loss: " in stdout and "train loss (last epoch mean)" in stdout
    # The bar's last "loss" is the last epoch's mean, as the summary's (Keras's Progbar alone shows the last step's).
    assert float(re.findall(r" - loss: ([0-9.]+)", stdout)[-1]) == pytest.approx(result["train_loss"], abs=1e-4)
    assert result["total_steps"] == 6 and result["overflow_count"] == 0
    assert (Path(result["log_dir"]) / "checkpoint").is_dir()


@pytest.mark.slow
def test_lean_tier_flag_trains_16bit_weights_with_less_state(tmp_path):
    """--optimizer=lean in fit: LeanAdam's 8 bytes a trainable parameter against Adam's 12, the same
    training."""
    runs = {}
    for optimizer in ("adam", "lean"):
        (tmp_path / optimizer).mkdir()
        _, (result,) = run_example("transformer", tmp_path / optimizer, *TINY, "--policy=mixed_bfloat16",
                                   f"--optimizer={optimizer}")
        runs[optimizer] = result
    assert (runs["adam"]["optimizer"], runs["lean"]["optimizer"]) == ("Adam", "LeanAdam")
    per_param = {name: r["state_bytes"] / r["trainable_params"] for name, r in runs.items()}
    assert per_param["adam"] == pytest.approx(12.0, abs=0.5) and per_param["lean"] < 9.0, per_param
    assert abs(runs["lean"]["eval_loss"] / runs["adam"]["eval_loss"] - 1) < 0.01  # six steps: the same training
    assert np.isfinite(runs["lean"]["train_loss"])


@pytest.mark.slow
def test_lean_tier_flag_in_the_custom_loop(tmp_path):
    """The custom loop calls keras_amp.memory.prepare itself: its trainable weights go 16-bit with
    LeanAdam's state (Adam's 12 bytes a parameter: the test above)."""
    _, (result,) = run_example("custom_loop", tmp_path, *TINY, "--policy=mixed_bfloat16", "--optimizer=lean")
    assert result["optimizer"] == "LeanAdam"
    assert result["state_bytes"] / result["trainable_params"] < 9.0, result
    assert np.isfinite(result["train_loss"]) and np.isfinite(result["eval_loss"])


@pytest.mark.slow
def test_demo_smoke(tmp_path):
    stdout, (amp, base) = run_example("demo", tmp_path, *TINY)
    assert base["policy"] == "float32" and amp["label"] == "auto"
    for line in ("speed-up", "eval loss", "peak RSS+", "TensorBoard logs", "training time", "demo wall time"):
        assert line in stdout, line
    assert "target" not in stdout and "met" not in stdout.split()  # no internal acceptance verdicts
    if amp["policy"] != "float32":
        assert "check_model(" in stdout


@pytest.fixture
def common(monkeypatch):
    """examples/common, imported in this process (and forgotten afterwards)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for name in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_AMP_QUIET_TF"):  # restored after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # the import sets it; restored
    import common as package  # noqa: PLC0415
    from common import data, flags  # noqa: PLC0415, F401

    yield package
    for name in [n for n in sys.modules if n == "common" or n.startswith("common.")]:
        del sys.modules[name]


@pytest.mark.parametrize("name", ["cnn", "transformer", "rnn", "custom_loop", "multi_worker", "demo", "quickstart"])
def test_help_lists_the_examples_flags(name):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    seconds = time.perf_counter() - start
    assert out.returncode == 1 and not out.stderr, out.stderr[-2000:]  # absl's --help exits with 1
    expected = ["--policy", "--epochs", "--steps_per_epoch"] if name == "quickstart" else [
        "--policy", "--dataset", "--epochs", "--batch_size", "--steps_per_epoch", "--model_dir", "--show_plan",
        "--verbose", "--results_file", "--eval_steps"] + (["--compare_float32"] if name != "demo" else [])
    assert ("compare_float32" in out.stdout) == (name not in ("demo", "quickstart"))  # the demo always compares
    for flag in expected:
        assert f"  {flag}: " in out.stdout or f"  --[no]{flag[2:]}: " in out.stdout, (flag, out.stdout)
    assert "--helpfull" in out.stdout and "--alsologtostderr" not in out.stdout  # ours, not absl's 100 lines
    # multi_worker.py resumes through BackupAndRestore by itself: no --resume flag it would ignore.
    assert ("--[no]resume:" in out.stdout) == (name not in ("multi_worker", "quickstart")), out.stdout
    assert out.stdout.count("\n") < 110, out.stdout
    assert seconds < 30, seconds  # TensorFlow is not imported for --help


def test_offline_tfds_fails_fast_with_one_message_and_no_partial_files(tmp_path):
    start = time.perf_counter()
    out = launch("cnn", tmp_path, "--dataset=mnist", f"--data_dir={tmp_path / 'tfds'}", "--epochs=1",
                 f"--model_dir={tmp_path / 'runs'}", mock="offline", timeout=120)
    seconds = time.perf_counter() - start
    assert (tmp_path / "tfds.probed").read_text() == "('storage.googleapis.com', 443)"  # guard: the probe ran
    assert out.returncode == 1, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in ("--dataset=mnist", "network is unreachable", "--dataset=pydoc",
                   "tfds.builder('mnist', data_dir='DIR').download_and_prepare()", "--data_dir=DIR"):
        assert needle in lines[0], (needle, lines[0])
    assert not list(tmp_path.rglob("*.tmp*")) and not (tmp_path / "tfds").exists(), list(tmp_path.rglob("*"))
    assert seconds < 60, seconds  # interpreter and TensorFlow start-up included; the check itself is below


def _no_download(*args, **kwargs):
    raise AssertionError("download_and_prepare must not run when the network is unreachable")


def test_prepare_offline_raises_within_the_probe_timeout(common, tmp_path, monkeypatch):
    import tensorflow_datasets as tfds  # noqa: PLC0415

    from common import data  # noqa: PLC0415

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", _no_download)
    calls = []

    def failing(address, timeout=None, **kwargs):
        calls.append((address, timeout))
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", failing)
    start = time.perf_counter()
    with pytest.raises(data.DataUnavailable, match=r"--dataset=cifar10 is not in .* network is unreachable "
                       r"\(storage.googleapis.com:443: gaierror: \[Errno -2\] Name or service not known\)"):
        data.prepare("cifar10", data_dir=str(tmp_path))
    assert time.perf_counter() - start < 5 and calls == [(("storage.googleapis.com", 443), data.PROBE_TIMEOUT_S)]
    # A resolver that never answers: the check gives up after PROBE_TIMEOUT_S, not the resolver's retries.
    # (It answers after 30 s, with a socket: the probe thread outlives the test and must end cleanly.)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: time.sleep(30) or socket.socket())
    monkeypatch.setattr(data, "PROBE_TIMEOUT_S", 0.5)
    start = time.perf_counter()
    with pytest.raises(data.DataUnavailable, match=r"no answer within 0.5 s\). The offline default is --dataset=pydoc"):
        data.prepare("tiny_shakespeare", data_dir=str(tmp_path))
    assert time.perf_counter() - start < 3
    assert not any(tmp_path.iterdir())  # nothing written
    data.prepare("pydoc")  # offline data needs no check


def test_failed_download_removes_its_partial_files(common, tmp_path, monkeypatch):
    import tensorflow_datasets as tfds  # noqa: PLC0415

    from common import data  # noqa: PLC0415

    earlier = tmp_path / "downloads" / "other.tmp.0123"  # someone else's: left alone
    earlier.mkdir(parents=True)

    def broken_download(self, *args, **kwargs):
        (tmp_path / "downloads" / "mnist_train.gz.tmp.abcd").mkdir()
        (tmp_path / "downloads" / "mnist_train.gz.tmp.abcd" / "part").write_bytes(b"12")
        (tmp_path / "mnist" / "incomplete.XYZ_3.0.1").mkdir(parents=True)
        raise ConnectionError("connection reset by peer")

    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: socket.socket())  # "online"
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", broken_download)
    with pytest.raises(data.DataUnavailable, match=r"download into .* failed \(ConnectionError: connection reset "
                       r"by peer\); its partial files are removed"):
        data.prepare("mnist", data_dir=str(tmp_path))
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["downloads", "downloads/other.tmp.0123", "mnist"], left


def test_probe_goes_through_the_https_proxy(common, monkeypatch):
    from common import data  # noqa: PLC0415

    monkeypatch.setenv("https_proxy", "http://proxy.internal:3128")
    assert data._probe_address() == ("proxy.internal", 3128)
    monkeypatch.delenv("https_proxy")
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    assert data._probe_address() == (data.PROBE_HOST, data.PROBE_PORT)


_IMPORT = ("import common, sys; common.import_tensorflow_quietly(); print('tensorflow' in sys.modules); "
           "import tensorflow as tf; tf.config.list_physical_devices()")


def test_tensorflow_banner_is_off_unless_the_user_sets_the_log_level():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_AMP_QUIET_TF")}
    quiet = subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True, timeout=120, env=env,
                           cwd=EXAMPLES)
    loud = subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True, timeout=120,
                          env=dict(env, TF_CPP_MIN_LOG_LEVEL="0"), cwd=EXAMPLES)
    assert quiet.stdout.strip() == "True" and not BANNER.search(quiet.stderr), quiet.stderr
    assert loud.stdout.strip() == "False"  # the user's level: TensorFlow imported as usual, not by us
    assert loud.returncode == 0 and BANNER.search(loud.stderr), loud.stderr  # guard: this TensorFlow has a banner


def test_keras_amp_warnings_are_one_line_and_others_pythons(common):
    import keras_amp  # noqa: PLC0415

    text = warnings.formatwarning(keras_amp.AmpWarning("slow here"), keras_amp.AmpWarning, "trainer.py", 180)
    assert text == "warning: slow here\n", text
    other = warnings.formatwarning(UserWarning("theirs"), UserWarning, "user.py", 3, line="x = 1")
    assert other.startswith("user.py:3: UserWarning: theirs") and "x = 1" in other, other


def test_default_run_folder_is_new_per_process(common):
    from common import flags  # noqa: PLC0415

    default = Path(flags.run_dir("cnn", None))
    assert default.parent == Path(flags.MODEL_DIR_BASE) / "cnn" and default.name.endswith(f"-{os.getpid()}")
    assert re.fullmatch(r"\d{8}-\d{6}-\d+", default.name), default.name
    assert flags.run_dir("cnn", "/data/runs") == os.path.join("/data/runs", "cnn")


def test_model_dir_that_is_a_file_fails_in_one_line_before_any_work(common, tmp_path):
    from common import flags  # noqa: PLC0415

    file = tmp_path / "afile"
    file.write_text("")
    out = launch("cnn", tmp_path, f"--model_dir={file}", "--epochs=1", timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0] == (f"error: --model_dir must be a folder (made if missing) for the runs' checkpoints and "
                        f"TensorBoard logs, but {file} is a file. Received: --model_dir={file}"), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing downloaded or written
    # Every example finds its folder through run_dir: a file further up the path fails the same way.
    with pytest.raises(SystemExit, match=f"but {re.escape(str(file))} is a file. Received: --model_dir={file}/sub$"):
        flags.run_dir("rnn", f"{file}/sub")
    assert flags.run_dir("rnn", str(tmp_path / "new" / "sub")) == str(tmp_path / "new" / "sub" / "rnn")


def _tiny_settings(model_dir, **overrides):
    from common.trainer import Settings  # noqa: PLC0415

    return Settings(**{**dict(family="cnn", recipe="cnn", dataset="pydoc", epochs=1, batch_size=8, steps_per_epoch=2,
                              seq_len=16, width=16, depth=1, learning_rate=1e-3, tier="auto", seed=0,
                              model_dir=str(model_dir), eval_steps=1, verbose=0), **overrides})


def test_fresh_run_in_a_used_folder_says_the_old_tensorboard_events_stay(common, tmp_path, capsys):
    from common import resume  # noqa: PLC0415
    from common.trainer import Trainer  # noqa: PLC0415

    # What an earlier float32 run left: its checkpoint state and its TensorBoard events.
    run = tmp_path / "float32"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / resume.STATE).write_text(json.dumps({"epochs_done": 2}))
    events = run / "logs" / "train" / "events.out.tfevents.1.host.1.v2"
    events.parent.mkdir(parents=True)
    events.write_bytes(b"old run")
    Trainer(_tiny_settings(tmp_path), "float32", label="float32")  # builds the run; trains nothing
    stdout = capsys.readouterr().out
    assert (f"[float32] {run / 'checkpoint'} holds a checkpoint after epoch 2: this run starts over and replaces it "
            f"after its first epoch (--resume continues it); the old run's TensorBoard events stay in {run / 'logs'}, "
            "and TensorBoard shows both runs there unless you remove that folder") in stdout, stdout
    assert events.read_bytes() == b"old run"  # the user's files are left alone


def _scalar_steps(folder) -> dict[str, list[int]]:
    """tag -> the steps it was written at, over the event files directly in `folder`."""
    import tensorflow as tf  # noqa: PLC0415

    steps: dict[str, list[int]] = {}
    for path in sorted(Path(folder).glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(int(event.step))
    return steps


@pytest.mark.filterwarnings("ignore:mixed_float16 requested on CPU")  # a float16 loss scale wherever it runs
def test_loss_scale_monitor_writes_a_tensorboard_run_of_its_own(common, tmp_path):
    from common.trainer import Trainer  # noqa: PLC0415

    trainer = Trainer(_tiny_settings(tmp_path), "mixed_float16", label="mixed_float16")
    trainer.run_epoch(0)
    logs = tmp_path / "mixed_float16" / "logs"
    train, amp = _scalar_steps(logs / "train"), _scalar_steps(logs / "amp")
    # Keras's TensorBoard writes fit's logs, the loss scale among them, once an epoch ...
    assert train["epoch_loss"] == [0] and train["epoch_loss_scale"] == [0], train
    # ... and the monitor its counters beside them, in a run of its own.
    assert amp["epoch_overflow_count"] == [0] and "epoch_loss" not in amp, amp


_ORPHAN = """
import multiprocessing, sys, time
sys.path.insert(0, sys.argv[1])
from common import compare

def child(parent):
    compare.die_with_parent(parent)
    time.sleep(120)

if __name__ == "__main__":
    import os
    process = multiprocessing.get_context("spawn").Process(target=child, args=(os.getpid(),))
    process.start()
    print(process.pid, flush=True)
    time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_twin_dies_with_its_killed_run(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    parent = subprocess.Popen([sys.executable, str(script), str(EXAMPLES)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)  # as a user's kill -9 of the example
    parent.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "the spawned twin outlived its killed run"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has died (its reaper is init)
    except FileNotFoundError:
        return False

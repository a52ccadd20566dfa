"""The examples' shared absl flags and their `main`."""

from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app, flags

from common import data as data_lib

# `define()` declares its flags on behalf of the example that calls it. Without this line absl
# counts them as this module's, and an example's `--help` (its main module's flags) lists none.
flags.disclaim_key_flags()

FLAGS = flags.FLAGS
POLICIES = ("auto", "mixed_float16", "mixed_bfloat16", "float32")
TIERS = ("auto", "none", "small", "medium", "large")
OPTIMIZERS = ("adam", "lean", "lean_stochastic", "lean_none")
MODEL_DIR_BASE = os.path.join(tempfile.gettempdir(), "keras_amp_examples")
NAMES: tuple[str, ...] = ()  # the flags `define()` declared


def _nearest_existing(path: str) -> str:
    """`path` made absolute, or its nearest ancestor that exists (a folder, for a run to write below it)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def parse(argv: list[str]) -> list[str]:
    """absl's flag parsing (`app.run(main, flags_parser=parse)`), and no positional arguments: every
    setting of an example is a --flag, so a stray word is a mistake, not a default run."""
    rest = app.parse_flags_with_usage(argv)  # a bad flag: absl's one error line and exit 1
    if len(rest) > 1:
        raise SystemExit(f"error: unexpected argument{'s' * (len(rest) > 2)} {' '.join(rest[1:])!r}: every "
                         "setting is a --flag (--help lists them)")
    return rest


def _can_write_in(folder: str) -> bool:
    """Whether a file can be made in `folder`: tried (a temporary file, removed at once), as permissions,
    read-only mounts and pseudo file systems (/proc) all decide it, also for root."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def output_file(name: str) -> None:
    """Flag `name`, a path to write a file at the end of a run, is checked when the flags are parsed:
    not a folder, its nearest existing folder writable (the missing ones are made), so a run's results
    are not lost after its training to a path that cannot be written."""

    def check(path: str | None) -> bool:
        if not path:
            return True
        full = os.path.abspath(path)
        existing = _nearest_existing(os.path.dirname(full))
        why = (f"{full} is a folder" if os.path.isdir(full) else f"{existing} is a file" if not os.path.isdir(existing)
               else None if _can_write_in(existing) else f"no file can be written in {existing}")
        if why:
            raise flags.ValidationError(f"--{name} must be a file path that can be written (missing folders are "
                                        f"made), but {why}. Received: --{name}={path}")
        return True

    flags.register_validator(name, check)


def define(*, dataset: str = "pydoc", datasets=data_lib.DATASETS, epochs: int, batch_size: int,
           steps_per_epoch: int, seq_len: int = 128, width: int, depth: int, learning_rate: float = 1e-3,
           resumable: bool = True, compare: bool = True) -> None:
    """Defines the flags every example takes, with that example's defaults; `--resume` where `resumable`
    (multi_worker.py resumes through Keras's BackupAndRestore by itself), `--compare_float32` where
    `compare` (the demo always compares)."""
    global NAMES
    before = set(FLAGS)
    flags.DEFINE_enum("policy", "auto", POLICIES, "Precision policy; auto picks by hardware.")
    flags.DEFINE_enum("dataset", dataset, list(datasets),
                      "Data set: pydoc is offline (Python's documentation text); the others come "
                      "through tensorflow-datasets (downloaded into --data_dir on first use).")
    flags.DEFINE_integer("epochs", epochs, "Training epochs.", lower_bound=1)
    flags.DEFINE_integer("batch_size", batch_size, "Global batch size.", lower_bound=1)
    flags.DEFINE_integer("steps_per_epoch", steps_per_epoch, "Steps per epoch.", lower_bound=1)
    flags.DEFINE_integer("seq_len", seq_len, "Tokens per example (text data sets).", lower_bound=2)
    flags.DEFINE_integer("width", width, "Model width (channels / embedding size).", lower_bound=1)
    flags.DEFINE_integer("depth", depth, "Residual blocks / Transformer blocks / LSTM layers.", lower_bound=1)
    flags.DEFINE_float("learning_rate", learning_rate, "Adam learning rate.", lower_bound=0.0)
    flags.DEFINE_enum("optimizer", "adam", OPTIMIZERS,
                      "Under a 16-bit policy: adam (Keras's, float32 master weights) or keras_amp's lean tier, "
                      "16-bit weights with the exact 16+16 split (lean), stochastic rounding (lean_stochastic) "
                      "or no compensation (lean_none: pure 16-bit, for comparison). float32 runs use adam.")
    flags.DEFINE_enum("tier", "auto", TIERS, "Loss-scale tier under mixed_float16 (none: Keras defaults).")
    if compare:
        flags.DEFINE_bool("compare_float32", False,
                          "Also train the float32 twin on the same data and seed, and print both.")
    flags.DEFINE_string("model_dir", None,
                        "Checkpoints and TensorBoard logs go to <model_dir>/<example>/<run>/ (default: a new "
                        f"folder per run, {os.path.join(MODEL_DIR_BASE, '<example>', '<time>-<pid>')}).")
    if resumable:
        flags.DEFINE_bool("resume", False,
                          "Continue the run in --model_dir after its last finished epoch: weights, optimizer state "
                          "(loss scale and counters), logs and data order. Needs --model_dir and the flags the run "
                          "started with; --epochs may grow.")
    flags.DEFINE_integer("seed", 0, "Random seed (weights and data order).", lower_bound=0,
                         upper_bound=2**32 - 1)  # NumPy's seed range (keras.utils.set_random_seed)
    flags.DEFINE_integer("eval_steps", None, "Held-out batches to evaluate (default: all).", lower_bound=1)
    flags.DEFINE_integer("max_examples", None, "Training examples of a tfds classification set (default: all).",
                         lower_bound=1)
    flags.DEFINE_string("data_dir", None, "tensorflow-datasets data directory.")
    flags.DEFINE_bool("show_plan", False, "Print keras_amp.plan_recipe: each layer's policy and why.")
    flags.DEFINE_string("results_file", None, "Also write the runs' figures to this JSON file.")
    output_file("results_file")
    flags.DEFINE_integer("verbose", 1, "0: no progress, 1: progress bar, 2: one line per epoch. (keras_amp's "
                         "own log lines: absl's --verbosity=0.)", lower_bound=0, upper_bound=2)
    NAMES = tuple(sorted(set(FLAGS) - before))


def run_dir(name: str, model_dir: str | None) -> str:
    """Where example `name` writes: <model_dir>/<name>, or (model_dir None) a new folder for this run.

    By default two runs at once, or one after the other, then never overwrite each other's logs
    and checkpoints. Exits with one message where a file stands in the way of <model_dir>/<name>.
    """
    if model_dir:
        path = os.path.join(model_dir, name)
        # The nearest part of the path that exists must be a folder: the rest is made below it.
        existing = _nearest_existing(path)
        if not os.path.isdir(existing):
            raise SystemExit(f"error: --model_dir must be a folder (made if missing) for the runs' checkpoints and "
                             f"TensorBoard logs, but {existing} is a file. Received: --model_dir={model_dir}")
        return path
    return os.path.join(MODEL_DIR_BASE, name, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")


def prepare_data() -> None:
    """Downloads --dataset if needed; offline, exits within seconds with one message saying what to do."""
    try:
        data_lib.prepare(FLAGS.dataset, FLAGS.data_dir)
    except data_lib.DataUnavailable as e:
        raise SystemExit(f"error: {e}") from None


def settings(family: str, recipe: str, name: str, **overrides):
    """`Settings` from the parsed flags, the data set on disk; runs go to `run_dir(name)`/<label>."""
    from common.trainer import Settings

    if FLAGS.resume and not FLAGS.model_dir:
        raise SystemExit("error: --resume needs --model_dir, the folder of the run to continue (without it each run "
                         f"writes to a new folder under {os.path.join(MODEL_DIR_BASE, name)}).")
    model_dir = run_dir(name, FLAGS.model_dir)  # before the download: a bad --model_dir fails at once
    prepare_data()
    values = dict(
        family=family, recipe=recipe, dataset=FLAGS.dataset, epochs=FLAGS.epochs, batch_size=FLAGS.batch_size,
        steps_per_epoch=FLAGS.steps_per_epoch, seq_len=FLAGS.seq_len, width=FLAGS.width, depth=FLAGS.depth,
        learning_rate=FLAGS.learning_rate, optimizer=FLAGS.optimizer, tier=None if FLAGS.tier == "none" else FLAGS.tier,
        seed=FLAGS.seed, model_dir=model_dir, eval_steps=FLAGS.eval_steps,
        max_examples=FLAGS.max_examples, data_dir=FLAGS.data_dir, verbose=FLAGS.verbose,
        show_plan=FLAGS.show_plan, resume=FLAGS.resume)
    values.update(overrides)
    return Settings(**values)


def run(run_settings, run_configs: list[tuple[str, str]]):
    """`common.compare.run`, a checkpoint that --resume cannot continue reported in one line."""
    from common import compare
    from common.resume import ResumeError

    try:
        return compare.run(run_settings, run_configs)
    except ResumeError as e:
        raise SystemExit(f"error: {e}") from None


def configs() -> list[tuple[str, str]]:
    """(label, policy) runs: the requested policy, then float32 when --compare_float32."""
    runs = [(FLAGS.policy, FLAGS.policy)]
    if FLAGS.compare_float32 and FLAGS.policy != "float32":
        runs.append(("float32", "float32"))
    return runs


def main(family: str, recipe: str, name: str, **overrides) -> int:
    """Trains as the flags say and prints the summary."""
    from common import compare

    results = run(settings(family, recipe, name, **overrides), configs())
    print(compare.summary(results), flush=True)
    write_results(results)
    return 0


def write_results(results) -> None:
    """Writes `results` to --results_file, if given (its folder made if missing, as --plot_file's)."""
    if FLAGS.results_file:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.results_file)), exist_ok=True)
        with open(FLAGS.results_file, "w") as f:
            json.dump(results, f, indent=1)

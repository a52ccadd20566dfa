"""Shared code of the examples: data sets, model families, training with timing, float32 comparison.

Examples only use keras_amp's public API; this folder is not part of the installed package.

Importing it also keeps the examples' output to what they print themselves:
- TensorFlow's start-up banner (oneDNN, CUDA, CPU-instruction lines) is filtered out, unless
  TF_CPP_MIN_LOG_LEVEL is set: then TensorFlow logs as that says;
- keras_amp's own INFO log lines (op rules installed, the recipe's plan) are off unless absl's
  `--verbosity=0` is given: the examples print the policy, and `--show_plan` the plan.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

from absl import app, logging
from absl import flags as absl_flags  # not `flags`: that name is the submodule common.flags

# Set by us (not the user): spawned child runs quiet their own TensorFlow import too.
_OURS = "KERAS_AMP_EXAMPLES_QUIET_TF"
# TensorFlow 2.21 writes its import-time lines through absl's C++ log before it is initialised,
# which TF_CPP_MIN_LOG_LEVEL does not filter: INFO lines and absl's notice about them.
_BANNER = re.compile(r"I\d{4} [\d:. ]+\d+ \S+:\d+\] |WARNING: All log messages before absl::InitializeLog\(\)")
_NO_DRIVER = "Could not find cuda drivers"
_NO_DRIVER_CUINIT = re.compile(r"E\d{4} [\d:. ]+\d+ cuda_platform\.cc:\d+\] failed call to cuInit")

if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
    os.environ.update({"TF_CPP_MIN_LOG_LEVEL": "2", _OURS: "1"})  # before anything imports TensorFlow


def banner_filtered(text: str) -> str:
    """`text` (stderr of TensorFlow's import) without the start-up banner; warnings and errors stay.

    "failed call to cuInit" is dropped only where TensorFlow also said that the machine has no CUDA
    driver: then the error is the expected one of a CPU-only machine, not a broken GPU set-up.
    """
    no_driver = _NO_DRIVER in text
    kept = [line for line in text.splitlines(keepends=True)
            if not _BANNER.match(line) and not (no_driver and _NO_DRIVER_CUINIT.match(line))]
    return "".join(kept)


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow and lists its devices with the banner filtered out (see `banner_filtered`).

    A no-op when TensorFlow is already imported or the user set TF_CPP_MIN_LOG_LEVEL.
    """
    if "tensorflow" in sys.modules or os.environ.get(_OURS) != "1":
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)  # the banner is written by C++ to file descriptor 2
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()  # device discovery logs the CUDA lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            sys.stderr.write(banner_filtered(capture.read().decode("utf-8", "replace")))
            sys.stderr.flush()


def _library_logs_at_warning() -> None:
    # app.run turns absl logging up to INFO when --verbosity is not given.
    if not absl_flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


# After absl has parsed the flags (so `--help` stays instant), before the example's main runs.
app.call_after_init(import_tensorflow_quietly)
app.call_after_init(_library_logs_at_warning)

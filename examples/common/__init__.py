"""Shared code of the examples: data sets, model families, training with timing, float32 comparison.

Examples only use keras_amp's public API; this folder is not part of the installed package.

Importing it also keeps the examples' output to what they print themselves:
- TensorFlow's start-up banner (oneDNN, CUDA, CPU-instruction lines) is filtered out; a
  TF_CPP_MIN_LOG_LEVEL the user set is applied to it, and 0 shows it (`keras_amp_console`);
- keras_amp's own INFO log lines (op rules installed, the recipe's plan) are off unless absl's
  `--verbosity=0` is given: the examples print the policy, and `--show_plan` the plan;
- keras_amp's warnings are one line each, `warning: <message>`, without Python's file:line and
  source line, which name the examples' code, not the user's.
"""

from __future__ import annotations

from absl import app, logging
from absl import flags as absl_flags  # not `flags`: that name is the submodule common.flags
# Stdlib-only, installed beside keras_amp (the `keras-amp` command's entry point): it filters the
# banner for the CLI too. Re-exported here for the examples' spawned processes.
from keras_amp_console import (banner_filtered, import_tensorflow_quietly, one_line_amp_warnings,  # noqa: F401
                               quiet_tensorflow_by_default)

quiet_tensorflow_by_default()  # before anything imports TensorFlow


def _library_logs_at_warning() -> None:
    # app.run turns absl logging up to INFO when --verbosity is not given.
    if not absl_flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


one_line_amp_warnings()

# After absl has parsed the flags (so `--help` stays instant), before the example's main runs.
app.call_after_init(import_tensorflow_quietly)
app.call_after_init(_library_logs_at_warning)

"""The `keras-amp` command's entry point; it stands outside the `keras_amp` package on purpose.

Importing `keras_amp` imports TensorFlow and Keras (several seconds), which `keras-amp
troubleshoot` and `--help` (static text) do not need. So this module loads `keras_amp/cli.py`
from the package's folder without running the package's `__init__`; `cli.py` imports only the
standard library at the top, and `doctor` and `check` import keras_amp when they run.

It also keeps TensorFlow's start-up banner out of `doctor` and `check` (and of the examples,
which import `import_tensorflow_quietly` from here): see `banner_filtered`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
import warnings

_NAME = "_keras_amp_console_cli"

# Set by us (not the user): child processes quiet their own TensorFlow import too.
QUIET_ENV = "KERAS_AMP_QUIET_TF"
# TensorFlow 2.21 writes its import-time lines through absl's C++ log before it is initialised,
# which TF_CPP_MIN_LOG_LEVEL does not filter: INFO lines and absl's notice about them.
_ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog()"
_SEVERITY = re.compile(r"[IWEF]\d{4} [\d:. ]+\d+ \S+:\d+\] ")
_NO_DRIVER = "Could not find cuda drivers"
_NO_DRIVER_CUINIT = re.compile(r"E\d{4} [\d:. ]+\d+ cuda_platform\.cc:\d+\] failed call to cuInit")


def quiet_tensorflow_by_default() -> None:
    """Sets TF_CPP_MIN_LOG_LEVEL=2 (warnings and errors) unless the user set it; call it before
    anything imports TensorFlow. A level the user set is obeyed (`import_tensorflow_quietly`)."""
    if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        os.environ.update({"TF_CPP_MIN_LOG_LEVEL": "2", QUIET_ENV: "1"})


def _user_level() -> int | None:
    """The TF_CPP_MIN_LOG_LEVEL the user set (0-3), or None: unset, set by us, or not a number."""
    if os.environ.get(QUIET_ENV) == "1":
        return None
    try:
        return int(os.environ["TF_CPP_MIN_LOG_LEVEL"])
    except (KeyError, ValueError):
        return None


def banner_filtered(text: str, level: int | None = None) -> str:
    """`text` (stderr of TensorFlow's import) without the start-up banner; warnings and errors stay.

    "failed call to cuInit" is dropped only where TensorFlow also said that the machine has no CUDA
    driver: then the error is the expected one of a CPU-only machine, not a broken GPU set-up.
    With `level` (a TF_CPP_MIN_LOG_LEVEL the user set) the lines that level filters go instead of
    the INFO lines (INFO from 1, warnings from 2, errors from 3); absl's notice and that cuInit line
    go either way.
    """
    no_driver = _NO_DRIVER in text
    below = "I" if level is None else "IWEF"[:max(0, min(level, 4))]
    kept = [line for line in text.splitlines(keepends=True)
            if not (line.startswith(_ABSL_NOTICE) or (_SEVERITY.match(line) and line[0] in below)
                    or (no_driver and _NO_DRIVER_CUINIT.match(line)))]
    return "".join(kept)


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow and lists its devices with the banner filtered out (see `banner_filtered`).

    TensorFlow 2.21 writes its import-time lines before absl's log is initialised, where
    TF_CPP_MIN_LOG_LEVEL does not reach them: a level the user set is applied to them here (0 leaves
    TensorFlow's import alone). A no-op when TensorFlow is already imported.
    """
    quiet_tensorflow_by_default()
    level = _user_level()
    if "tensorflow" in sys.modules or (os.environ.get(QUIET_ENV) != "1" and not level):
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
            sys.stderr.write(banner_filtered(capture.read().decode("utf-8", "replace"), level))
            sys.stderr.flush()


def one_line_amp_warnings() -> None:
    """Prints keras_amp's `AmpWarning`s as one line each, `warning: <message>`, without Python's file:line
    and source line, which in a command or an example name keras_amp's code, not the user's; other
    warnings keep Python's format."""
    python_format = warnings.formatwarning

    def format_warning(message, category, filename, lineno, line=None) -> str:
        if category.__name__ == "AmpWarning" and category.__module__.startswith("keras_amp"):
            return f"warning: {message}\n"
        return python_format(message, category, filename, lineno, line)

    warnings.formatwarning = format_warning


def load_standalone(relative_path: str, name: str):
    """The module at `keras_amp/<relative_path>`, executed alone under `name` (the package's
    `__init__` is not run). For modules that import only the standard library at the top."""
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("keras_amp")  # locates the package without importing it
    if package is None or not package.submodule_search_locations:
        raise ImportError("keras-amp: the keras_amp package is not installed (pip install keras-amp)")
    path = os.path.join(list(package.submodule_search_locations)[0], *relative_path.split("/"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    one_line_amp_warnings()  # `check --policy` and `doctor` run keras_amp.enable, which may warn
    return load_standalone("cli.py", _NAME).main(argv, before_tensorflow=import_tensorflow_quietly)


if __name__ == "__main__":
    sys.exit(main())

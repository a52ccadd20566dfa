"""The `keras-amp` command's entry point; it stands outside the `keras_amp` package on purpose.

Importing `keras_amp` imports TensorFlow and Keras (several seconds), which `keras-amp
troubleshoot` and `--help` (static text) do not need. So this module loads `keras_amp/cli.py`
from the package's folder without running the package's `__init__`; `cli.py` imports only the
standard library at the top, and `doctor` and `check` import keras_amp when they run.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_NAME = "_keras_amp_console_cli"


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
    return load_standalone("cli.py", _NAME).main(argv)


if __name__ == "__main__":
    sys.exit(main())

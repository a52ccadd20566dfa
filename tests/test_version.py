"""keras_amp.version: one release number, readable without importing the package."""

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

import keras_amp
from keras_amp import version

VERSION_FILE = Path(version.__file__)


def test_the_package_and_its_installed_metadata_carry_this_version():
    assert keras_amp.__version__ is version.__version__
    # pyproject's `version = { attr = "keras_amp.version.__version__" }` wrote the metadata.
    assert importlib.metadata.version("keras_amp") == version.__version__


def test_the_version_is_canonical_pep_440():
    assert str(Version(version.__version__)) == version.__version__


def test_the_version_is_one_literal_that_setuptools_reads_without_importing():
    # setuptools reads an `attr:` version statically when the module assigns a plain literal.
    tree = ast.parse(VERSION_FILE.read_text())
    assigned = [node for node in tree.body if isinstance(node, ast.Assign)]
    assert len(assigned) == 1 and [t.id for t in assigned[0].targets] == ["__version__"]
    assert ast.literal_eval(assigned[0].value) == version.__version__


def test_running_the_file_imports_neither_tensorflow_nor_the_package():
    code = ("import runpy, sys; v = runpy.run_path(sys.argv[1])['__version__']; "
            "print(v, 'tensorflow' in sys.modules, 'keras_amp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(VERSION_FILE)], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == [version.__version__, "False", "False"]

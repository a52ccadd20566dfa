"""`keras_amp_console`: the `keras-amp` entry point, and the TensorFlow start-up banner kept out of
`doctor`, `check` and the examples."""

import os
import re
import subprocess
import sys

import keras_amp_console

BANNER = re.compile(r"^(I\d{4} .*\] |WARNING: All log messages before absl)", re.M)


# TensorFlow 2.21's import on a CPU-only x86 machine, as it is written to stderr.
_IMPORT_STDERR = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796249541.997880   14661 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results.
I0000 00:00:1796249541.998232   14661 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
W0000 00:00:1796249542.000000   14661 some_op.cc:10] a real warning
/site-packages/x.py:3: DeprecationWarning: a Python warning
E0000 00:00:1796249691.348043   16184 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: UNKNOWN ERROR (303)
"""


def test_banner_filter_drops_info_lines_and_keeps_warnings():
    kept = keras_amp_console.banner_filtered(_IMPORT_STDERR).splitlines()
    assert kept == ["W0000 00:00:1796249542.000000   14661 some_op.cc:10] a real warning",
                    "/site-packages/x.py:3: DeprecationWarning: a Python warning"]
    # With a CUDA driver present, a failing cuInit is a real error: it stays.
    with_driver = _IMPORT_STDERR.replace("Could not find cuda drivers on your machine", "Loaded CUDA")
    assert "failed call to cuInit" in keras_amp_console.banner_filtered(with_driver)



def _doctor(env):
    return subprocess.run([sys.executable, "-m", "keras_amp_console", "doctor"], capture_output=True, text=True,
                          timeout=300, env=env)


def test_doctor_prints_no_banner_unless_the_user_sets_the_log_level():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", keras_amp_console.QUIET_ENV)}
    quiet = _doctor(env)
    assert quiet.returncode == 0 and quiet.stdout.startswith("Versions"), quiet.stderr[-2000:]
    assert not BANNER.search(quiet.stderr), quiet.stderr
    loud = _doctor(dict(env, TF_CPP_MIN_LOG_LEVEL="0"))
    assert loud.returncode == 0 and BANNER.search(loud.stderr), loud.stderr  # guard: this TensorFlow has a banner
    assert loud.stdout == quiet.stdout  # the same report either way

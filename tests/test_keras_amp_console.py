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


def test_banner_filter_applies_a_level_the_user_set():
    python_warning = "/site-packages/x.py:3: DeprecationWarning: a Python warning"
    by_level = {level: keras_amp_console.banner_filtered(_IMPORT_STDERR, level).splitlines() for level in (1, 2, 3)}
    assert [line[:1] for line in by_level[1]] == ["W", "/"]  # INFO, absl's notice, cuInit without a driver go
    assert by_level[2] == by_level[3] == [python_warning]  # a Python warning is not TensorFlow's log: it stays
    with_driver = _IMPORT_STDERR.replace("Could not find cuda drivers on your machine", "Loaded CUDA")
    assert [line[:1] for line in keras_amp_console.banner_filtered(with_driver, 2).splitlines()] == ["/", "E"]
    assert "failed call to cuInit" not in keras_amp_console.banner_filtered(with_driver, 3)



def _doctor(env):
    return subprocess.run([sys.executable, "-m", "keras_amp_console", "doctor"], capture_output=True, text=True,
                          timeout=300, env=env)


def test_doctor_prints_no_banner_unless_the_user_sets_the_log_level_to_0():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", keras_amp_console.QUIET_ENV)}
    quiet = _doctor(env)
    assert quiet.returncode == 0 and quiet.stdout.startswith("Versions"), quiet.stderr[-2000:]
    assert not BANNER.search(quiet.stderr), quiet.stderr
    loud = _doctor(dict(env, TF_CPP_MIN_LOG_LEVEL="0"))
    assert loud.returncode == 0 and BANNER.search(loud.stderr), loud.stderr  # guard: this TensorFlow has a banner
    assert loud.stdout == quiet.stdout  # the same report either way
    # TF_CPP_MIN_LOG_LEVEL=2, the usual way to quiet TensorFlow, quiets its import-time lines too.
    user_quiet = _doctor(dict(env, TF_CPP_MIN_LOG_LEVEL="2"))
    assert user_quiet.returncode == 0 and not BANNER.search(user_quiet.stderr), user_quiet.stderr


def test_the_command_prints_keras_amp_warnings_in_one_line(monkeypatch):
    # `keras-amp check --policy` runs keras_amp.enable, whose advice would otherwise name cli.py's line.
    import warnings  # noqa: PLC0415

    import keras_amp  # noqa: PLC0415

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    monkeypatch.setattr(keras_amp_console, "load_standalone",
                        lambda path, name: type("Cli", (), {"main": staticmethod(lambda argv, **kw: 0)}))
    assert keras_amp_console.main(["doctor"]) == 0
    text = warnings.formatwarning(keras_amp.AmpWarning("slow here"), keras_amp.AmpWarning, "cli.py", 76)
    assert text == "warning: slow here\n", text
    other = warnings.formatwarning(UserWarning("theirs"), UserWarning, "user.py", 3, line="x = 1")
    assert other.startswith("user.py:3: UserWarning: theirs") and "x = 1" in other, other

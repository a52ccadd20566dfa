"""`keras-amp check`: findings for a saved model, the overflow locator with --batch, exit codes."""

import json
import os
import pathlib
import re
import subprocess
import warnings
import sys

import keras
import numpy as np
import pytest

import keras_amp
from keras_amp import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _compile(model):
    model.compile(optimizer=keras_amp.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=2.0**10),
                  loss="mse")
    return model


def _softmax_model(softmax_dtype=None):
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, name="d0")(inp)
    h = keras.layers.Dense(8, activation="softmax", name="scores", dtype=softmax_dtype)(h)
    return _compile(keras.Model(inp, keras.layers.Dense(1, dtype="float32", name="head")(h)))


def _overflow_model(gain_dtype=None):
    # "k" multiplies positive inputs by ~1e5 through its kernel: beyond float16's 65504.
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, use_bias=False, name="k", dtype=gain_dtype,
                           kernel_initializer=keras.initializers.Constant(1.25e4))(inp)
    h = keras.layers.Dense(8, use_bias=False, name="down", dtype=gain_dtype,
                           kernel_initializer=keras.initializers.Constant(1.25e-5))(h)
    return _compile(keras.Model(inp, keras.layers.Dense(1, dtype="float32", name="head")(h)))


def _save(model, tmp_path, name):
    path = str(tmp_path / f"{name}.keras")
    model.save(path)
    return path


def _batch(tmp_path):
    rng = np.random.default_rng(0)
    path = str(tmp_path / "batch.npz")
    np.savez(path, x=rng.uniform(0.5, 1.0, (16, 8)).astype("float32"), y=np.ones((16, 1), "float32"))
    return path


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_planted_16_bit_softmax_is_a_finding_and_the_fixed_model_is_clean(tmp_path, capsys):
    keras.config.set_dtype_policy("mixed_float16")
    bad = _save(_softmax_model(), tmp_path, "bad")
    good = _save(_softmax_model(softmax_dtype="float32"), tmp_path, "good")
    code, out, _ = _run(capsys, "check", bad)
    assert code == cli.FINDINGS
    assert "[low_precision_softmax] scores:" in out
    code, out, _ = _run(capsys, "check", good)
    assert code == cli.CLEAN, out
    assert "no findings" in out


def test_batch_runs_the_locator_and_names_the_overflowing_layer(tmp_path, capsys):
    keras.config.set_dtype_policy("mixed_float16")
    bad = _save(_overflow_model(), tmp_path, "bad")
    good = _save(_overflow_model(gain_dtype="float32"), tmp_path, "good")
    batch = _batch(tmp_path)
    code, out, _ = _run(capsys, "check", bad)
    assert code == cli.CLEAN  # statically there is nothing to see: the overflow is in the values
    code, out, _ = _run(capsys, "check", bad, "--batch", batch)
    assert code == cli.FINDINGS
    assert "forward: first non-finite value produced in layer 'k'" in out
    assert "Compute 'k' in float32" in out  # the decision tree's action, from the same table
    code, out, _ = _run(capsys, "check", bad, "--batch", batch, "--json")

    def no_constant(name):  # NaN / Infinity: Python's json writes them, JSON has none
        raise AssertionError(f"not JSON: {name}")

    result = json.loads(out, parse_constant=no_constant)
    assert code == cli.FINDINGS and result["overflow"]["loss"] in ("nan", "inf")  # the loss overflowed
    code, out, _ = _run(capsys, "check", good, "--batch", batch, "--json")
    result = json.loads(out)
    assert code == cli.CLEAN and result["clean"] and result["overflow"]["forward"] is None
    # Guard: the fixed model really carries the ~1e5 activations, in float32.
    k = next(layer for layer in result["overflow"]["layers"] if layer["path"] == "k")
    assert k["output_dtype"] == "float32" and k["max_abs"] > 65504


def test_a_finite_loss_whose_backward_pass_overflows_is_said_as_such(tmp_path, capsys):
    keras.config.set_dtype_policy("mixed_float16")
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(keras.layers.Dense(8, name="a")(inp)))
    path = _save(_compile(model), tmp_path, "model")
    batch = str(tmp_path / "huge_y.npz")
    np.savez(batch, x=np.ones((16, 8), "float32"), y=np.full((16, 1), 1e7, "float32"))
    code, out, _ = _run(capsys, "check", path, "--batch", batch)
    assert code == cli.FINDINGS
    assert "backward: first non-finite value produced in layer 'out'" in out, out
    assert "is finite, the backward pass overflows: the step is skipped" in out, out


def test_bad_input_exits_2(tmp_path, capsys):
    keras.config.set_dtype_policy("mixed_float16")
    good = _save(_softmax_model(softmax_dtype="float32"), tmp_path, "good")
    not_model = tmp_path / "notes.keras"
    not_model.write_text("not a model")
    no_x = str(tmp_path / "no_x.npz")
    np.savez(no_x, inputs=np.zeros((2, 8)))
    cases = [
        ("check", str(tmp_path / "missing.keras")),
        ("check", str(not_model)),
        ("check", good, "--batch", no_x),
        ("check", good, "--batch", str(not_model)),
        ("check", good, "--policy", "mixed_float8"),
        ("check", good, "--batch", _batch(tmp_path), "--underflow", "2"),
    ]
    for argv in cases:
        code, _, err = _run(capsys, *argv)
        assert code == cli.BAD_INPUT and err.startswith("keras-amp check: "), argv
    wrong_shape = str(tmp_path / "wrong.npz")
    np.savez(wrong_shape, x=np.zeros((2, 3), "float32"))
    code, _, err = _run(capsys, "check", good, "--batch", wrong_shape)
    assert code == cli.BAD_INPUT, err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check"])  # argparse: the model path is required
    assert exit_info.value.code == cli.BAD_INPUT


def test_messages_for_a_model_as_batch_a_lambda_and_an_untrained_optimizer(tmp_path, capsys):
    keras.config.set_dtype_policy("mixed_float16")
    good = _save(_softmax_model(softmax_dtype="float32"), tmp_path, "good")  # compiled, never trained
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, _, err = _run(capsys, "check", good)
    assert code == cli.CLEAN, err
    assert not [w for w in seen if "Skipping variable loading" in str(w.message)]  # the optimizer is not checked
    text = tmp_path / "notes.txt"
    text.write_text("not arrays")
    code, _, err = _run(capsys, "check", good, "--batch", str(text))  # NumPy would try it as a pickle
    _one_line_error(err)
    assert "not a NumPy .npz file of arrays 'x'" in err and "pickle" not in err, err
    single = str(tmp_path / "x.npy")
    np.save(single, np.zeros((2, 8), "float32"))  # np.load gives an array, not an archive: it had blamed the model
    code, _, err = _run(capsys, "check", good, "--batch", single)
    _one_line_error(err)
    assert code == cli.BAD_INPUT and "--batch: not a NumPy .npz file of arrays 'x'" in err, err
    assert "a single array, not named arrays)" in err and "cannot load" not in err, err
    inp = keras.Input((8,))
    lambda_model = keras.Model(inp, keras.layers.Lambda(lambda t: t * 2.0)(inp))
    code, _, err = _run(capsys, "check", _save(lambda_model, tmp_path, "lambda"))
    _one_line_error(err)
    assert code == cli.BAD_INPUT and "safe_mode=False" in err and "keras_amp.check_model(" in err, err


def test_troubleshoot_prints_the_tree(capsys):
    code, out, _ = _run(capsys, "troubleshoot", "non_finite_loss")
    assert code == 0 and "Is the loss scale at its floor, or are steps overflowing?" in out
    code, out, _ = _run(capsys, "troubleshoot", "--markdown")
    assert code == 0 and out.startswith("## Troubleshooting")
    full = out
    code, out, _ = _run(capsys, "troubleshoot", "--markdown", "step_time_jump")
    assert code == 0 and out.startswith("### Step time jumps") and out.count("### ") == 1, out
    assert out.strip() in full  # the README's section for that symptom, alone
    code, _, err = _run(capsys, "troubleshoot", "bogus")
    assert code == cli.BAD_INPUT and "non_finite_loss" in err


def test_console_command_exit_code(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    bad = _save(_overflow_model(), tmp_path, "bad")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    # The installed command's entry point (pyproject: keras-amp = keras_amp_console:main).
    done = subprocess.run([sys.executable, "-m", "keras_amp_console", "check", bad, "--batch", _batch(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == cli.FINDINGS, done.stderr[-2000:]
    assert "layer 'k'" in done.stdout


def test_troubleshoot_and_help_do_not_import_tensorflow():
    """Static text: the command prints the decision tree without importing TensorFlow or Keras."""
    from keras_amp.diagnostics import symptoms

    script = ("import sys, keras_amp_console\n"
              "code = keras_amp_console.main(['troubleshoot', 'non_finite_loss'])\n"
              "heavy = sorted(m for m in ('tensorflow', 'keras', 'keras_amp') if m in sys.modules)\n"
              "print('CODE', code, 'HEAVY', heavy)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.rstrip().endswith("CODE 0 HEAVY []"), done.stdout[-2000:]
    assert symptoms.render_text("non_finite_loss") in done.stdout
    helped = subprocess.run([sys.executable, "-m", "keras_amp_console", "troubleshoot", "--help"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert helped.returncode == 0 and "updates_vanish" in helped.stdout, helped.stderr[-2000:]
    assert not helped.stderr, helped.stderr[-2000:]  # no TensorFlow banner


def test_version_and_a_closed_pipe():
    done = subprocess.run([sys.executable, "-m", "keras_amp_console", "--version"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == f"keras-amp {keras_amp.__version__}", done
    # `keras-amp ... | head`: the reader closes the pipe before the command writes; one exit, no traceback.
    proc = subprocess.Popen([sys.executable, "-m", "keras_amp_console", "troubleshoot", "--markdown"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def _one_line_error(err):
    assert err.startswith("keras-amp check: ") and err.count("\n") == 1, err  # one line
    assert "Traceback" not in err and 'File "' not in err, err  # no Python or TensorFlow frames


def test_running_the_model_fails_exits_2_in_one_line(tmp_path, capsys):
    # Out-of-range token ids: TensorFlow's gather fails inside the model. Before: a traceback, exit 1.
    keras.config.set_dtype_policy("mixed_float16")
    inp = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(10, 8, name="embed")(inp)
    model = _compile(keras.Model(inp, keras.layers.Dense(1, dtype="float32", name="head")(h)))
    path = _save(model, tmp_path, "tokens")
    ids = str(tmp_path / "ids.npz")
    np.savez(ids, x=np.full((2, 4), 99, "int32"), y=np.zeros((2, 4, 1), "float32"))
    code, _, err = _run(capsys, "check", path, "--batch", ids)
    assert code == cli.BAD_INPUT
    _one_line_error(err)
    assert "the batch does not fit the model" in err
    # A wrong-shape batch: TensorFlow's message, without its stack frames.
    wrong = str(tmp_path / "wrong.npz")
    np.savez(wrong, x=np.zeros((2, 3, 5), "float32"))
    code, _, err = _run(capsys, "check", path, "--batch", wrong)
    assert code == cli.BAD_INPUT
    _one_line_error(err)
    # Keras's line that says what the model expected, not its "Exception encountered when calling ...".
    assert "(2, 3, 5)" in err and "incompatible" in err and "Exception encountered" not in err, err


def test_a_file_that_is_not_a_model_is_said_as_such(tmp_path, capsys):
    not_model = tmp_path / "weights.keras"
    not_model.write_bytes(b"\x00" * 64)  # exists, is not a zip or HDF5 file. Before: "File not found"
    code, _, err = _run(capsys, "check", str(not_model))
    assert code == cli.BAD_INPUT and "not a Keras model" in err and "not found" not in err.lower(), err
    _one_line_error(err)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_non_finite_batch_is_a_finding_that_says_repair_the_data(tmp_path, capsys, policy):
    keras.config.set_dtype_policy(policy)
    path = _save(_softmax_model(softmax_dtype="float32"), tmp_path, "model")
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, (16, 8)).astype("float32")
    x[3, 5] = np.nan
    batch = str(tmp_path / "nan.npz")
    np.savez(batch, x=x, y=np.ones((16, 1), "float32"))
    code, out, _ = _run(capsys, "check", path, "--batch", batch)
    assert code == cli.FINDINGS, out
    assert "Repair or filter the data" in out and "--batch" in out, out
    assert "Lower the initial loss scale" not in out  # the scale is not what went wrong
    assert "<" not in out.split("Repair or filter the data")[1].split("\n")[0]  # no unfilled placeholder
    # Guard: the same model and a clean batch are clean.
    x[3, 5] = 0.7
    np.savez(batch, x=x, y=np.ones((16, 1), "float32"))
    code, out, _ = _run(capsys, "check", path, "--batch", batch)
    assert code == cli.CLEAN, out


def test_troubleshoot_help_lists_every_symptom(capsys):
    from keras_amp.diagnostics import symptoms

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["troubleshoot", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert len(symptoms.SYMPTOMS) >= 5  # guard: the table is there
    for symptom in symptoms.SYMPTOMS:
        assert re.search(rf"^  {symptom.name} +{re.escape(symptom.title)}$", out, re.M), (symptom.name, out)


@pytest.mark.parametrize("argv,said", [
    (["check", "--bogus", "model.keras"], "keras-amp check: error: unrecognized arguments: --bogus"),
    (["troubleshoot", "non_finite_loss", "extra"], "keras-amp troubleshoot: error: unrecognized arguments: extra"),
    (["doctor", "--jsn"], "keras-amp doctor: error: unrecognized arguments: --jsn"),
    (["check", "model.keras", "--underflow", "half"], "keras-amp check: error: argument --underflow: invalid float"),
    (["chek"], "keras-amp: error: argument command: invalid choice: 'chek'"),
    # No command: said as such, and an unknown flag named too (argparse alone said only "required: command").
    (["--bogus"], "keras-amp: error: a command is required (doctor, check, troubleshoot); "
                  "unrecognized arguments: --bogus"),
    ([], "keras-amp: error: a command is required (doctor, check, troubleshoot)"),
])
def test_a_wrong_argument_is_named_by_its_command(capsys, argv, said):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == cli.BAD_INPUT and said in err, err
    command = argv[0] if argv and argv[0] in ("check", "troubleshoot", "doctor") else None
    assert err.startswith(f"usage: keras-amp {command}" if command else "usage: keras-amp [-h]"), err


def test_a_folder_is_not_a_model_file(tmp_path, capsys):
    code, _, err = _run(capsys, "check", str(tmp_path))
    assert code == cli.BAD_INPUT and err == f"keras-amp check: a folder, not a file: {tmp_path}\n", err
    code, _, err = _run(capsys, "check", str(tmp_path / "missing.keras"), "--batch", str(tmp_path))
    assert code == cli.BAD_INPUT and err == f"keras-amp check: --batch: a folder, not a file: {tmp_path}\n", err

"""A `.keras` file written under the "rnn" recipe loads as plain float32 where keras_amp was never imported.

The file is loaded in a subprocess that imports only Keras (and checks that keras_amp stayed out
of `sys.modules`); the parent process checks that keras_amp, when imported, restores its own
`Matmul16DTypePolicy` from the same file.
"""

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import keras
import numpy as np
import pytest

import keras_amp

MIXED = ("mixed_float16", "mixed_bfloat16")

# Runs in a process that never imports keras_amp: loads each file, predicts, reports policies.
_STOCK_LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import keras
    results = {}
    for path in sys.argv[2:]:
        try:
            model = keras.saving.load_model(path)
        except Exception as e:
            results[path] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        lstm = model.get_layer("lstm")
        y = model(np.load(sys.argv[1]))
        results[path] = {"policies": [lstm.dtype_policy.name, lstm.cell.dtype_policy.name],
                         "output_dtype": keras.backend.standardize_dtype(y.dtype),
                         "y": np.asarray(y, "float64").tolist()}
    assert "keras_amp" not in sys.modules, "keras_amp was imported"
    print(json.dumps(results))
""")


def _recipe_model(p):
    keras_amp.enable(p)
    inp = keras.Input((5, 3))
    model = keras.Model(inp, keras.layers.LSTM(4, name="lstm")(inp))
    keras_amp.apply_recipe(model, "rnn")
    assert isinstance(model.get_layer("lstm").dtype_policy, keras_amp.Matmul16DTypePolicy)
    return model


def _old_format(path, old_path, source_name):
    """A copy of `path` with the policy in the format keras_amp wrote before (its class, its config)."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(old_path, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "config.json":
                text = data.decode()
                new = json.dumps({"module": "keras_amp.matmul16_policy", "class_name": "DTypePolicy",
                                  "config": {"name": "float32"},
                                  "registered_name": f"keras_amp>matmul16_from_{source_name}"})
                # Before, the policy also lived in keras_amp.op_rules.matmul.
                old = json.dumps({"module": "keras_amp.op_rules.matmul", "class_name": "Matmul16DTypePolicy",
                                  "config": {"source_name": source_name},
                                  "registered_name": "keras_amp>Matmul16DTypePolicy"})
                assert new in text  # guard: the file holds the policy as this module now writes it
                data = text.replace(new, old).encode()
            dst.writestr(item, data)


@pytest.mark.parametrize("p", MIXED)
def test_rnn_recipe_file_loads_as_float32_without_keras_amp(tmp_path, p):
    model = _recipe_model(p)
    x = np.random.default_rng(0).uniform(-1.0, 1.0, (2, 5, 3)).astype("float32")
    path, old_path, x_path = (str(tmp_path / name) for name in ("m.keras", "old.keras", "x.npy"))
    model.save(path)
    _old_format(path, old_path, p)
    np.save(x_path, x)
    # The float32 reference: the same weights without the op rules (a plain float32 LSTM).
    keras_amp.disable()
    reference = np.asarray(model(x), "float64")

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _STOCK_LOADER, x_path, path, old_path],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    new = results[path]
    assert new["policies"] == ["float32", "float32"] and new["output_dtype"] == "float32", new
    np.testing.assert_allclose(new["y"], reference, rtol=0, atol=1e-6)
    # Stock Keras could not read the format keras_amp wrote before (the reported failure).
    assert "'str' object has no attribute 'variable_dtype'" in results[old_path]["error"], results[old_path]

    # With keras_amp imported, both formats restore keras_amp's policy.
    for saved in (path, old_path):
        loaded = keras.saving.load_model(saved)
        policy = loaded.get_layer("lstm").dtype_policy
        assert isinstance(policy, keras_amp.Matmul16DTypePolicy) and policy.source_name == p, (saved, policy)
        assert policy.compute_dtype == policy.variable_dtype == "float32"

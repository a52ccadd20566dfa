"""export_for_inference: 16-bit serving copy, islands kept, .keras and SavedModel reloaded in a fresh process."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from auto_precision_models import Amplify, SubclassedSensitive, regression_data, sensitive_model
from keras_amp.auto_precision import model_policies, export_for_inference, weight_bytes

X, _ = regression_data(n=32)
HERE = os.path.dirname(os.path.abspath(__file__))


def _float32_reference(model):
    """The model's outputs with every layer float32 (same weights), in float64."""
    with model_policies.temporary_policies(model):
        model_policies.set_policies(model, {p: "float32" for p in model_policies.policy_names(model)})
        return np.asarray(model(X, training=False), np.float64)


def _trained_island_model(policy, sensitive=None):
    kwargs = {} if sensitive is None else {"sensitive": sensitive}
    model = sensitive_model(policy, **kwargs)
    model_policies.set_policies(model, {"sensitive": "float32"})  # the island a search or recipe chose
    return model


def test_bfloat16_export_keeps_island_halves_memory_and_matches_float32():
    model = _trained_island_model("mixed_bfloat16")
    before = {p: n for p, n in model_policies.policy_names(model).items()}
    result = export_for_inference(model, "bfloat16")
    copy = result.model
    assert model_policies.policy_names(model) == before  # the source is untouched
    assert copy.get_layer("d1").dtype_policy.name == "bfloat16"
    assert copy.get_layer("d1").kernel.dtype == "bfloat16"
    assert copy.get_layer("sensitive").dtype_policy.name == "float32"
    assert result.float32_layers == ("sensitive",)
    # Every weight went to 16 bits (the island has none): exactly half the bytes.
    assert result.weight_bytes_before == weight_bytes(model) == 4 * sum(int(np.prod(w.shape)) for w in model.weights)
    assert result.memory_ratio == 0.5 and result.weight_bytes_float32 == 0
    ref = _float32_reference(model)
    out = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(copy(X), "float32")), np.float64)
    # bfloat16 weights and activations: ~3 roundings of u = 2**-8 each, relative to the output scale.
    assert np.max(np.abs(out - ref)) <= 3 * 2.0**-8 * np.max(np.abs(ref)) * 4, np.max(np.abs(out - ref))


def test_float16_export_keeps_overflow_island_finite_where_plain_float16_is_not():
    model = _trained_island_model("mixed_float16", sensitive=Amplify)
    ours = export_for_inference(model, "float16").model
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(ours(X))))
    plain = export_for_inference(model, "float16", keep_float32=[]).model  # every layer float16
    assert plain.get_layer("sensitive").dtype_policy.name == "float16"
    assert not np.all(np.isfinite(keras.ops.convert_to_numpy(plain(X))))  # the edge: 1e5 * x overflows


def test_a_float32_layer_with_weights_keeps_its_bytes_ratio_is_half_plus_half_its_share():
    model = sensitive_model("mixed_bfloat16")
    model_policies.set_policies(model, {"out": "float32"})  # a float32 head, as the "cnn" recipe keeps it
    result = export_for_inference(model, "bfloat16")
    d1, out = 8 * 16 + 16, 16 * 1 + 1  # parameters: Dense(16) on 8 inputs, Dense(1) on 16
    assert result.float32_layers == ("out",)
    assert result.weight_bytes_before == 4 * (d1 + out) and result.weight_bytes_float32 == 4 * out
    assert result.weight_bytes_after == 2 * d1 + 4 * out
    share = out / (d1 + out)
    assert result.memory_ratio == pytest.approx(0.5 + 0.5 * share) and result.memory_ratio > 0.5


@pytest.mark.slow
def test_keras_and_savedmodel_reload_in_a_fresh_process(tmp_path):
    model = _trained_island_model("mixed_bfloat16")
    copy = export_for_inference(model, "bfloat16").model
    expected = keras.ops.convert_to_numpy(keras.ops.cast(copy(X), "float32"))
    ref = _float32_reference(model)
    copy.save(tmp_path / "served.keras")
    copy.export(str(tmp_path / "saved_model"), verbose=False)
    np.save(tmp_path / "x.npy", X)
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {HERE!r})
        import numpy as np, keras, tensorflow as tf
        import auto_precision_models  # registers the custom layers
        x = np.load({str(tmp_path / "x.npy")!r})
        m = keras.models.load_model({str(tmp_path / "served.keras")!r})
        a = keras.ops.convert_to_numpy(keras.ops.cast(m(x), "float32"))
        s = tf.saved_model.load({str(tmp_path / "saved_model")!r})
        b = tf.cast(s.serve(tf.constant(x)), tf.float32).numpy()
        print(json.dumps({{"keras": a.tolist(), "saved": b.tolist(),
                           "policies": {{l.name: l.dtype_policy.name for l in m.layers}}}}))
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["policies"]["d1"] == "bfloat16" and got["policies"]["sensitive"] == "float32"
    np.testing.assert_array_equal(np.asarray(got["keras"], np.float32), expected)
    np.testing.assert_array_equal(np.asarray(got["saved"], np.float32), expected)
    assert np.max(np.abs(np.asarray(got["saved"]) - ref)) <= 12 * 2.0**-8 * np.max(np.abs(ref))


def test_subclassed_model_needs_a_sample_and_then_exports():
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = SubclassedSensitive()
    model(X[:2])
    model_policies.set_policies(model, {"sensitive": "float32"})
    with pytest.raises(ValueError, match="sample="):
        export_for_inference(model, "bfloat16")
    result = export_for_inference(model, "bfloat16", sample=X[:2])
    assert result.model.sensitive.dtype_policy.name == "float32"
    assert result.model.d1.kernel.dtype == "bfloat16"
    for a, b in zip(model.weights, result.model.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.cast(a.value, "bfloat16"), "float32")),
            keras.ops.convert_to_numpy(keras.ops.cast(b.value, "float32")),
        )

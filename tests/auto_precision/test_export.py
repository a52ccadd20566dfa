"""export_for_inference: 16-bit serving copy, islands kept, .keras and SavedModel reloaded in a fresh process."""

import ast
import json
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_amp
from auto_precision_models import Amplify, SubclassedSensitive, regression_data, sensitive_model
from keras_amp.auto_precision import model_policies, export_for_inference, weight_bytes
from keras_amp.memory import storage_dtype

X, Y = regression_data(n=32)
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


@keras.saving.register_keras_serializable(package="keras_amp_tests")
class AutoNamedSubclassed(keras.Model):
    """Three auto-named Dense layers: a rebuilt copy names them anew ("dense_3" for "dense")."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(16, activation="relu")
        self.b = keras.layers.Dense(16)
        self.c = keras.layers.Dense(1)

    def call(self, x):
        return self.c(self.b(self.a(x)))


@keras.saving.register_keras_serializable(package="keras_amp_tests")
class BuildsItsDense(keras.layers.Layer):
    """Creates its Dense in build(): an unbuilt copy has no layer at its place."""

    def build(self, input_shape):
        self.inner = keras.layers.Dense(4)
        self.inner.build(input_shape)

    def call(self, x):
        return self.inner(x)


@keras.saving.register_keras_serializable(package="keras_amp_tests")
class LateSubclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = BuildsItsDense()

    def call(self, x):
        return self.block(x)


def test_subclassed_islands_are_found_by_place_when_the_copy_renames_its_layers():
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = AutoNamedSubclassed()
    model(X[:2])
    model_policies.set_policies(model, {model.c.name: "float32"})  # an island on an auto-named layer
    result = export_for_inference(model, "bfloat16", sample=X[:2])
    copy = result.model
    assert copy.c.name != model.c.name  # the edge: names do not match across the rebuild
    assert copy.c.dtype_policy.name == "float32" and copy.c.kernel.dtype == "float32"
    assert copy.a.dtype_policy.name == copy.b.dtype_policy.name == "bfloat16"
    assert result.float32_layers == (copy.c.name,)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(copy.c.kernel), keras.ops.convert_to_numpy(model.c.kernel))
    out = copy(X)
    assert out.dtype == "float32"  # the float32 head's output, as in the source
    ref = _float32_reference(model)
    # Two bfloat16 layers (weights and activations rounded, u = 2**-8) before a float32 head.
    err = np.max(np.abs(np.asarray(keras.ops.convert_to_numpy(out), np.float64) - ref))
    assert err <= 12 * 2.0**-8 * np.max(np.abs(ref)), err


def test_a_subclassed_island_the_copy_cannot_match_is_an_error_naming_it():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = LateSubclassed()
    model(X[:2])
    path = f"{model.block.name}/{model.block.inner.name}"
    model_policies.set_policies(model, {path: "float32"})
    with pytest.raises(ValueError, match=re.escape(repr(path))):
        export_for_inference(model, "bfloat16", sample=X[:2])


@pytest.mark.parametrize("stored_16bit", ["lean_adam", "frozen"])
def test_memory_ratio_is_measured_against_float32_masters_before_and_after_fit(stored_16bit):
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="d1"),
                              keras.layers.Dense(1, dtype="float32", name="out")])
    d1, out = 8 * 16 + 16, 16 * 1 + 1
    before = export_for_inference(model, "bfloat16")
    if stored_16bit == "frozen":
        model.get_layer("d1").trainable = False
    optimizer = keras_amp.optimizers.LeanAdam(1e-3) if stored_16bit == "lean_adam" else keras.optimizers.Adam(1e-3)
    model.compile(optimizer, "mse")
    model.fit(X, Y, epochs=1, batch_size=16, verbose=0)
    # The edge: d1's weights are stored in bfloat16 now, the model's own bytes shrank.
    assert storage_dtype(model.get_layer("d1").kernel) == "bfloat16"
    assert weight_bytes(model) == 2 * d1 + 4 * out
    after = export_for_inference(model, "bfloat16")
    for result in (before, after):
        assert result.weight_bytes_before == 4 * (d1 + out)
        assert result.weight_bytes_after == 2 * d1 + 4 * out and result.weight_bytes_float32 == 4 * out
        assert result.memory_ratio == pytest.approx(0.5 + 0.5 * out / (d1 + out), rel=0, abs=1e-12)


def test_a_lean_layer_kept_float32_gets_its_float32_master_not_its_16bit_half():
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="d1"),
                              keras.layers.Dense(1, name="out")])
    model.compile(keras_amp.optimizers.LeanAdam(1e-3), "mse")
    model.fit(X, Y, epochs=1, batch_size=16, verbose=0)
    kernel = model.get_layer("d1").kernel
    master = model.optimizer.master_weights()[id(kernel)].numpy()
    assert storage_dtype(kernel) == "bfloat16" and np.any(master != kernel.numpy().astype("float32"))  # guard
    result = export_for_inference(model, "bfloat16", keep_float32=["d1"])
    np.testing.assert_array_equal(result.model.get_layer("d1").kernel.numpy().view(np.uint32), master.view(np.uint32))


def _two_encoders():
    def encoder(name):
        inp = keras.Input((8,))
        return keras.Model(inp, keras.layers.Dense(4, name="proj")(inp), name=name)

    inp = keras.Input((8,))
    return keras.Model(inp, keras.layers.Add()([encoder("enc1")(inp), encoder("enc2")(inp)]))


def test_keep_float32_path_keeps_that_layer_only_and_a_name_keeps_its_namesakes():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _two_encoders()
    copy = export_for_inference(model, "bfloat16", keep_float32=["enc1/proj"]).model
    assert copy.get_layer("enc1").get_layer("proj").kernel.dtype == "float32"
    assert copy.get_layer("enc2").get_layer("proj").kernel.dtype == "bfloat16"
    assert model_policies.policy_names(copy)["enc2/proj"] == "bfloat16"
    both = export_for_inference(model, "bfloat16", keep_float32=["proj"])  # a bare name matches both
    assert both.float32_layers == ("enc1/proj", "enc2/proj")


def test_keep_float32_error_names_each_example_once():
    model = sensitive_model("mixed_bfloat16")  # top-level layers: each path is also a name
    with pytest.raises(ValueError, match="must match a layer path") as info:
        export_for_inference(model, "bfloat16", keep_float32=["zz"])
    examples = ast.literal_eval(re.search(r"e\.g\. (\[.*\])", str(info.value)).group(1))
    assert examples == ["d1", "sensitive", "out"], examples

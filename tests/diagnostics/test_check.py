"""check_model: every finding kind appears for a model with the problem and not for the fixed model."""

import dataclasses
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import layers as amp_layers
from keras_amp import op_rules, recipes
from keras_amp.diagnostics import check
from keras_amp.hardware import DeviceInfo, GpuInfo
from tests.helpers import MyNorm, count_walks

A100 = DeviceInfo(gpus=(GpuInfo("A100", (8, 0)),))  # bfloat16 and float16 tensor cores

pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning")


def one_layer(layer, shape=(16,), dtype="float32"):
    inp = keras.Input(shape, dtype=dtype)
    return keras.Model(inp, layer(inp))


def findings(model, kind):
    # On an A100: the dimension advice is for tensor cores, which CPUs lack.
    return [(f.layer, f.kind) for f in check.check_model(model, device=A100).of_kind(kind)]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_softmax_in_16_bits(policy):
    keras_amp.enable(policy)
    # Under enable() the op rules compute keras.ops.softmax in float32: nothing to report.
    assert op_rules.rule_installed("softmax")
    assert findings(one_layer(keras.layers.Softmax(name="sm")), "low_precision_softmax") == []
    op_rules.uninstall()  # stock Keras under the same policy
    assert findings(one_layer(keras.layers.Softmax(name="sm")), "low_precision_softmax") == [
        ("sm", "low_precision_softmax")
    ]
    assert findings(one_layer(keras.layers.Dense(16, activation="softmax", name="d")), "low_precision_softmax")
    # Fixed: keras_amp's Softmax under the same policy, or the stock layer in float32.
    assert findings(one_layer(amp_layers.Softmax(name="sm")), "low_precision_softmax") == []
    assert findings(one_layer(keras.layers.Softmax(dtype="float32")), "low_precision_softmax") == []


def test_attention_and_recurrence_in_16_bits():
    keras_amp.enable("mixed_float16")
    inp = keras.Input((4, 16))
    x = keras.layers.MultiHeadAttention(2, 8, dropout=0.1, name="mha")(inp, inp)
    out = keras.layers.LSTM(16, name="lstm")(keras.layers.GRU(16, return_sequences=True, name="gru")(x))
    report = check.check_model(keras.Model(inp, out))
    # The attention op rule covers stock MHA; no op rule reaches the recurrence.
    assert report.of_kind("low_precision_softmax") == []
    assert [f.layer for f in report.of_kind("low_precision_recurrence")] == ["gru", "lstm"]
    op_rules.uninstall()
    report = check.check_model(keras.Model(inp, out))
    assert [f.layer for f in report.of_kind("low_precision_softmax")] == ["mha"]  # not its inner softmax too
    assert [f.layer for f in report.of_kind("low_precision_recurrence")] == ["gru", "lstm"]
    # Fixed without the op rules: keras_amp's float32-inside layers.
    x = amp_layers.MultiHeadAttention(2, 8, dropout=0.1, name="mha")(inp, inp)
    out = amp_layers.LSTM(16, name="lstm")(amp_layers.GRU(16, return_sequences=True, name="gru")(x))
    report = check.check_model(keras.Model(inp, out))
    assert not report.of_kind("low_precision_softmax") and not report.of_kind("low_precision_recurrence")
    # Fixed in place by the "rnn" recipe: float32 recurrences with 16-bit matmuls.
    x = keras.layers.MultiHeadAttention(2, 8, dropout=0.1, name="mha")(inp, inp)
    out = keras.layers.LSTM(16, name="lstm")(keras.layers.GRU(16, return_sequences=True, name="gru")(x))
    model = keras_amp.apply_recipe(keras.Model(inp, out), "rnn")
    assert not check.check_model(model).of_kind("low_precision_recurrence")
    # In a model's own code the RNN keeps its 16-bit output and only its cell is float32: no finding.
    gru = model.get_layer("gru")
    gru.dtype_policy = "mixed_float16"
    gru.cell.dtype_policy = keras_amp.Matmul16DTypePolicy("mixed_float16")
    assert not check.check_model(model).of_kind("low_precision_recurrence")
    gru.cell.dtype_policy = "mixed_float16"  # guard: a 16-bit cell is found again
    assert [f.layer for f in check.check_model(model).of_kind("low_precision_recurrence")] == ["gru"]
    # A flash-attention MHA keeps the fused kernel (QK^T in float16) even under the op rules.
    op_rules.install("float16")
    flash = keras.layers.MultiHeadAttention(2, 8, flash_attention=True, name="flash")
    model = keras.Model(inp, flash(inp, inp))
    assert [f.layer for f in check.check_model(model).of_kind("low_precision_softmax")] == ["flash"]


class UserNorm(keras.layers.Layer):
    def call(self, x):
        return x / keras.ops.sqrt(keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True))


def test_normalization_is_found_by_what_its_ops_compute():
    keras_amp.enable("mixed_float16")
    op_rules.uninstall()  # stock Keras ops under the same policy
    assert findings(one_layer(UserNorm(name="n")), "low_precision_normalization") == [
        ("n", "low_precision_normalization")
    ]
    assert findings(one_layer(keras.layers.UnitNormalization(name="u")), "low_precision_normalization") == [
        ("u", "low_precision_normalization")
    ]
    assert findings(one_layer(UserNorm(dtype="float32")), "low_precision_normalization") == []
    assert findings(one_layer(amp_layers.Float32(UserNorm())), "low_precision_normalization") == []
    # A name is no evidence: MyNorm normalises nothing.
    assert check.check_model(one_layer(MyNorm(name="my_norm"))).of_kind("low_precision_normalization") == []
    op_rules.install("float16")
    # Stock LayerNormalization/GroupNormalization compute in float32 from float32 inputs: not flagged.
    for layer in (keras.layers.LayerNormalization(), keras.layers.GroupNormalization(groups=2)):
        assert findings(one_layer(layer), "low_precision_normalization") == []


def test_batch_and_rms_normalization_autocast_their_inputs():
    keras_amp.enable("mixed_float16")
    # Stock BatchNormalization/RMSNormalization autocast float32 inputs to float16 first: flagged.
    for layer in (keras.layers.BatchNormalization(name="bn"), keras.layers.RMSNormalization(name="rms")):
        assert findings(one_layer(layer), "low_precision_normalization") == [
            (layer.name, "low_precision_normalization")
        ]
    assert findings(one_layer(amp_layers.BatchNormalization()), "low_precision_normalization") == []
    assert findings(one_layer(amp_layers.RMSNormalization()), "low_precision_normalization") == []
    # Fed by 16-bit layers only (through `x + y` too), the autocast rounds nothing: not flagged.
    # Fed by a float32 layer or a model input it is.
    inp = keras.Input((6,))
    a, b = keras.layers.Dense(6, name="a")(inp), keras.layers.Dense(6, name="b")(inp)
    f32 = keras.layers.Dense(6, name="f32", dtype="float32")(inp)
    out = [keras.layers.BatchNormalization(name="bn16")(a + b), keras.layers.BatchNormalization(name="bn_f32")(f32),
           keras.layers.BatchNormalization(name="bn_input")(inp)]
    report = check.check_model(keras.Model(inp, out))
    assert [f.layer for f in report.of_kind("low_precision_normalization")] == ["bn_f32", "bn_input"]


def _tiny_backbone(name):
    """A one-layer keras-hub backbone with random weights, built offline."""
    from keras_hub import models

    common = dict(vocabulary_size=32, num_layers=1, hidden_dim=16, intermediate_dim=32, num_query_heads=2,
                  num_key_value_heads=1)
    if name == "phi3":  # Phi3LayerNorm
        return models.Phi3Backbone(max_sequence_length=16, **common)
    if name == "qwen3":  # Qwen3LayerNorm, on the hidden states and on the query/key heads
        return models.Qwen3Backbone(head_dim=8, **common)
    return models.GptOssBackbone(head_dim=8, num_experts=2, top_k=2, **common)  # GptOssLayerNormalization


@pytest.mark.parametrize("name", ["phi3", "qwen3", "gpt_oss"])
def test_keras_hub_rms_norms_that_upcast_are_not_flagged(name):
    keras_amp.enable("mixed_bfloat16")
    model = keras_amp.apply_recipe(_tiny_backbone(name), "transformer")
    batch = {"token_ids": np.ones((2, 8), "int32"), "padding_mask": np.ones((2, 8), "int32")}
    norms = [r for r in keras_amp.diagnostics.audit_model(model, batch).records if r.op_type == "Rsqrt"]
    # Guard: the RMS norms inside the decoder and after it ran, each with its statistics in float32.
    assert len({r.layer_path for r in norms}) >= 3 and "sequence_output_layernorm" in {r.layer_path for r in norms}
    assert {r.dtype for r in norms} == {"float32"}
    for x in (None, batch):
        report = check.check_model(model, x)
        assert report.of_kind("low_precision_normalization") == [], str(report)


def test_exp_activation_in_float16_but_not_bfloat16():
    keras_amp.enable("mixed_float16")
    assert findings(one_layer(keras.layers.Activation("exponential", name="e")), "low_precision_exp") == [
        ("e", "low_precision_exp")
    ]
    assert findings(one_layer(keras.layers.Activation("exponential", dtype="float32")), "low_precision_exp") == []
    keras_amp.enable("mixed_bfloat16")  # float32's exponent range: exp(88) does not overflow
    assert findings(one_layer(keras.layers.Activation("exponential")), "low_precision_exp") == []


def test_losses_in_16_bits():
    keras_amp.enable("mixed_float16")
    model = one_layer(keras.layers.Dense(16, activity_regularizer="l2", name="reg"))
    assert findings(model, "low_precision_loss") == [("reg", "low_precision_loss")]
    model.compile("adam", loss=keras.losses.MeanSquaredError(dtype="float16"))
    assert ("functional", "low_precision_loss") in findings(model, "low_precision_loss")
    fixed = one_layer(keras.layers.Dense(16, activity_regularizer="l2", dtype="float32"))
    fixed.compile("adam", loss=keras.losses.MeanSquaredError())
    assert findings(fixed, "low_precision_loss") == []


def test_output_not_float32_and_fixed_in_place():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((16,))
    model = keras.Model(inp, keras.layers.Dense(8, name="head")(keras.layers.Dense(16)(inp)))
    assert findings(model, "output_not_float32") == [("head", "output_not_float32")]
    # A policy set in place after the graph was built is what the next run computes in.
    model.get_layer("head").dtype_policy = "float32"
    assert model.outputs[0].dtype == "bfloat16"  # guard: the recorded symbolic dtype is stale
    assert findings(model, "output_not_float32") == []
    assert findings(one_layer(amp_layers.OutputHead(8)), "output_not_float32") == []


def test_low_precision_variables():
    keras.config.set_dtype_policy("float16")  # float16 variables, no keras_amp involved
    assert findings(one_layer(keras.layers.Dense(16, name="d")), "low_precision_variables") == [
        ("d", "low_precision_variables")
    ]
    keras_amp.enable("mixed_float16")
    assert findings(one_layer(keras.layers.Dense(16)), "low_precision_variables") == []


def test_float16_training_without_loss_scaling():
    # Built under float32 with float16 layers: Keras does not auto-wrap (the model's policy is float32).
    inp = keras.Input((16,))
    model = keras.Model(inp, keras.layers.Dense(16, dtype="mixed_float16", name="d")(inp))
    model.compile("sgd", "mse")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)  # guard: Keras did not wrap
    assert findings(model, "no_loss_scaling") == [("functional", "no_loss_scaling")]
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    assert findings(model, "no_loss_scaling") == []
    # Built under mixed_float16: compile() wraps by itself, nothing to report.
    keras_amp.enable("mixed_float16")
    model = one_layer(keras.layers.Dense(16))
    model.compile("sgd", "mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert findings(model, "no_loss_scaling") == []
    # bfloat16 needs no loss scaling.
    keras_amp.enable("mixed_bfloat16")
    model = one_layer(keras.layers.Dense(16))
    model.compile("sgd", "mse")
    assert findings(model, "no_loss_scaling") == []


def test_dimensions_not_multiple_of_8():
    keras_amp.enable("mixed_bfloat16")
    model = one_layer(keras.layers.Dense(12, name="d"), shape=(16,))
    # A CPU (or a GPU without bfloat16 tensor cores) has no tensor cores to miss: nothing said.
    cpu = DeviceInfo(cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=True)
    for device in (cpu, DeviceInfo(gpus=(GpuInfo("T4", (7, 5)),))):
        assert check.check_model(model, device=device).of_kind("dimension_not_multiple_of_8") == []
    (finding,) = check.check_model(model, device=A100).of_kind("dimension_not_multiple_of_8")
    assert finding.layer == "d" and "units=12" in finding.message and "units 12 -> 16" in finding.fix
    conv = one_layer(keras.layers.Conv2D(10, 3, name="c"), shape=(8, 8, 16))
    assert findings(conv, "dimension_not_multiple_of_8") == [("c", "dimension_not_multiple_of_8")]
    emb = one_layer(keras.layers.Embedding(100, 30, name="e"), shape=(4,), dtype="int32")
    assert findings(emb, "dimension_not_multiple_of_8") == [("e", "dimension_not_multiple_of_8")]
    assert findings(one_layer(keras.layers.Dense(16), shape=(16,)), "dimension_not_multiple_of_8") == []
    # In float32 there are no 16-bit tensor cores to miss.
    assert findings(one_layer(keras.layers.Dense(12, dtype="float32")), "dimension_not_multiple_of_8") == []


def test_xla_on_a_cpu_with_fast_bfloat16():
    keras_amp.enable("mixed_bfloat16")
    zen4 = DeviceInfo(cpu_model="AMD EPYC", cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=True)
    model = one_layer(keras.layers.Dense(16, name="d"), shape=(16,))
    model.compile("adam", "mse", jit_compile=True)
    (finding,) = check.check_model(model, device=zen4).of_kind("xla_on_cpu")
    assert finding.layer == model.name and "'d'" in finding.message and "jit_compile=False" in finding.fix
    assert "AMD EPYC" in finding.message
    # Where XLA is no loss, or bfloat16 no gain: a GPU or TPU, oneDNN off (bfloat16 emulated either way).
    for device in (A100, DeviceInfo(tpu_count=8), dataclasses.replace(zen4, onednn_enabled=False)):
        assert check.check_model(model, device=device).of_kind("xla_on_cpu") == []
    model.compile("adam", "mse", jit_compile=False)
    assert check.check_model(model, device=zen4).of_kind("xla_on_cpu") == []
    if not tf.config.list_physical_devices("GPU"):
        model.compile("adam", "mse")  # "auto": Keras leaves XLA off on a machine of CPUs alone
        assert model.jit_compile is False
        assert check.check_model(model, device=zen4).of_kind("xla_on_cpu") == []
    # float32 layers lose no bfloat16 kernel to XLA; nor does a model that was never compiled.
    f32 = one_layer(keras.layers.Dense(16, dtype="float32"), shape=(16,))
    f32.compile("adam", "mse", jit_compile=True)
    assert check.check_model(f32, device=zen4).of_kind("xla_on_cpu") == []
    assert check.check_model(one_layer(keras.layers.Dense(16)), device=zen4).of_kind("xla_on_cpu") == []


@pytest.mark.parametrize("cls", [keras.layers.SeparableConv1D, keras.layers.SeparableConv2D])
def test_separable_conv_dimensions_use_the_pointwise_kernel(cls):
    keras_amp.enable("mixed_float16")
    shape = (8, 12) if cls is keras.layers.SeparableConv1D else (8, 8, 12)
    layer = cls(16, 3, depth_multiplier=1, name="sep")
    model = one_layer(layer, shape=shape)
    assert not hasattr(layer, "kernel")  # guard: depthwise_kernel / pointwise_kernel only
    (finding,) = check.check_model(model, device=A100).of_kind("dimension_not_multiple_of_8")
    assert finding.layer == "sep" and "input channels=12" in finding.message and "filters" not in finding.message
    wide = one_layer(cls(16, 3, depth_multiplier=2), shape=shape)  # pointwise input 12 * 2 = 24
    assert findings(wide, "dimension_not_multiple_of_8") == []


def test_conv_transpose_input_channels_from_the_kernel_last_axis():
    keras_amp.enable("mixed_bfloat16")
    layer = keras.layers.Conv2DTranspose(16, 3, name="up")
    model = one_layer(layer, shape=(8, 8, 12))
    assert tuple(layer.kernel.shape) == (3, 3, 16, 12)  # guard: (..., filters, in_channels)
    (finding,) = check.check_model(model, device=A100).of_kind("dimension_not_multiple_of_8")
    assert finding.layer == "up" and "input channels=12" in finding.message and "filters" not in finding.message
    assert findings(one_layer(keras.layers.Conv1DTranspose(16, 3), shape=(8, 24)), "dimension_not_multiple_of_8") == []


def test_float16_variables_inside_attention_recurrent_and_island_layers():
    keras_amp.enable("mixed_float16")
    inp = keras.Input((4, 16))
    x = keras.layers.MultiHeadAttention(2, 8, dtype="float16", name="mha")(inp, inp)
    x = keras.layers.LSTM(16, dtype="float16", return_sequences=True, name="lstm")(x)
    x = amp_layers.GRU(16, dtype="float16", name="gru")(x)
    model = keras.Model(inp, keras.layers.Dense(8)(x))  # mixed_float16: not a stale model
    assert model.get_layer("lstm").cell.kernel.dtype == "float16"  # guard: owned by the (unvisited) cell
    assert findings(model, "low_precision_variables") == [
        ("mha", "low_precision_variables"), ("lstm", "low_precision_variables"), ("gru", "low_precision_variables")
    ]


def test_wrapped_softmax_is_reported_once():
    keras_amp.enable("mixed_bfloat16")
    op_rules.uninstall()
    td = keras.layers.TimeDistributed(keras.layers.Dense(8, activation="softmax", name="dense"), name="td")
    model = one_layer(td, shape=(4, 16))
    assert findings(model, "low_precision_softmax") == [("td", "low_precision_softmax")]


def test_float32_islands_are_not_taken_for_a_model_built_before_enable():
    keras_amp.enable("mixed_float16")
    inp = keras.Input((16,))
    head_only = keras.Model(inp, amp_layers.OutputHead(8)(inp))
    wrapped = keras.Model(inp, amp_layers.Float32(keras.layers.Dense(8))(inp))
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_amp.AmpWarning)
        for model in (head_only, wrapped):
            assert not check.check_model(model).of_kind("built_before_enable")


def test_report_is_data_and_readable():
    keras_amp.enable("mixed_float16")
    op_rules.uninstall()
    inp = keras.Input((16,))
    x = keras.layers.Dense(16, activation="softmax", name="probs")(inp)
    report = check.check_model(keras.Model(inp, x, name="clf"))
    assert not report.ok and report.kinds() == {"low_precision_softmax", "output_not_float32"}
    first = report.findings[0]
    assert dataclasses.asdict(first).keys() == {"kind", "layer", "message", "fix"}
    text = str(report)
    assert text.startswith("check_model('clf'): 2 finding(s)")
    assert "[low_precision_softmax] probs:" in text and "fix:" in text
    assert all(f.kind in check.KINDS for f in report.findings)
    with pytest.raises(ValueError, match="Received: kind='softmax'"):
        report.of_kind("softmax")


def test_recipe_models_check_clean_except_known_dimensions():
    keras_amp.enable("mixed_float16")
    inp = keras.Input((8, 16))
    x = keras.layers.MultiHeadAttention(2, 8, dropout=0.1, name="mha")(inp, inp)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([inp, x]))
    x = keras.layers.Dense(16, activation="softmax", name="probs")(keras.layers.Flatten()(x))
    model = keras.Model(inp, x)
    model.compile("adam", "mse")
    assert check.check_model(model).kinds() == {"output_not_float32"}  # the op rules cover the softmaxes
    op_rules.uninstall()
    assert check.check_model(model).kinds() == {"low_precision_softmax", "output_not_float32"}
    kernel = model.get_layer("probs").kernel.numpy()
    fixed = recipes.apply_recipe(model, "transformer")
    op_rules.install("float16")
    assert check.check_model(fixed).ok, str(check.check_model(fixed))
    np.testing.assert_array_equal(fixed.get_layer("probs").kernel.numpy(), kernel)


def test_model_built_before_enable_is_found_and_apply_recipe_converts_it():
    stale = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, name="d1"), keras.layers.Dense(8, name="d2")])
    keras_amp.enable("mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a report only: check_model warns about nothing
        report = check.check_model(stale)
    assert [(f.kind, f.layer) for f in report.of_kind("built_before_enable")] == [("built_before_enable", stale.name)]
    assert "apply_recipe" in report.of_kind("built_before_enable")[0].fix
    # apply_recipe gives every layer its planned policy, so it converts a stale model silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_amp.AmpWarning)
        converted = recipes.apply_recipe(stale, "cnn")  # both layers float32 by the recipe
        assert {converted.get_layer(n).dtype_policy.name for n in ("d1", "d2")} == {"float32"}
        assert not check.check_model(converted).of_kind("built_before_enable")




def test_check_model_walks_the_model_once(monkeypatch):
    keras.config.set_dtype_policy("float32")  # built before enable(): the staleness check walks too
    inp = keras.Input((8,))
    summed = keras.layers.Dense(8, name="a")(inp) + keras.layers.Dense(8, name="b")(inp)
    model = keras.Model(inp, keras.layers.Dense(3, activation="softmax", name="probs")(summed))
    keras_amp.enable("mixed_float16")
    walked = count_walks(monkeypatch)
    report = check.check_model(model, np.ones((2, 8), "float32"), device=A100)
    assert walked == [model]
    assert report.kinds() == {"built_before_enable"}  # guard: the staleness check read the layers
    walked.clear()
    check.check_model(model, device=A100)  # the probe batch's audit too
    assert walked == [model]


@pytest.mark.parametrize("built", [True, False])
def test_an_x_the_model_cannot_take_is_an_error_naming_x(built):
    # As in fit, a wrong batch fails in the model's own call (or build); the error says it was `x`, with Keras's
    # message.
    model = keras.Sequential(([keras.Input((30,))] if built else []) + [keras.layers.Dense(4)], name="m30")
    with pytest.raises(ValueError, match=r"The model 'm30' could not run on `x` \(shapes \(\)\): ValueError: .*"):
        keras_amp.check_model(model, np.float32(3.0))


def test_weights_keras_amp_stores_in_16_bits_are_not_findings():
    # Frozen weights under enable(frozen_weights="compute") and LeanAdam's weights: 16-bit by design, with no
    # updates to round away (frozen) or with their float32 masters (LeanAdam). Before: a finding per layer.
    from keras_amp.memory import storage  # noqa: PLC0415
    from keras_amp.optimizers import LeanAdam  # noqa: PLC0415

    keras_amp.enable("mixed_bfloat16")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    for optimizer in (keras.optimizers.Adam(1e-3), LeanAdam(1e-3)):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="frozen"),
                                  keras.layers.Dense(1, name="head")])
        model.get_layer("frozen").trainable = False
        model.compile(optimizer, "mse")
        model.fit(x, y, epochs=1, verbose=0)
        stored = {"/".join(v.path.split("/")[-2:]): storage.storage_dtype(v) for v in model.weights}
        assert stored["frozen/kernel"] == "bfloat16", stored  # guard: keras_amp stored it in 16 bits
        if isinstance(optimizer, LeanAdam):
            assert stored["head/kernel"] == "bfloat16", stored
        assert not [f for f in keras_amp.check_model(model, x).findings if f.kind == "low_precision_variables"]
    keras.config.set_dtype_policy("bfloat16")  # a pure 16-bit layer is still one
    pure = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="pure")])
    assert [f.layer for f in keras_amp.check_model(pure).findings if f.kind == "low_precision_variables"] == ["pure"]

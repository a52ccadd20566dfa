"""check_model's output findings: 16-bit logits read by a float32 log-softmax loss are a note, not a finding;
16-bit probabilities and regression outputs are still flagged."""

import importlib.util
import pathlib
import types

import keras
import pytest

import keras_amp
from keras_amp import layers as amp_layers
from keras_amp.diagnostics import check, outputs

pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning")

_MODELS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "common" / "models.py"


def _example_models():
    """examples/common/models.py, loaded from its file (the examples are not a package on sys.path)."""
    spec = importlib.util.spec_from_file_location("example_models", _MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _example(family, task="lm"):
    data = types.SimpleNamespace(input_shape=(16,), num_classes=32 if task == "lm" else 2, task=task, name="pydoc")
    model = _example_models().build(family, data, width=16, depth=1, heads=2)
    return keras_amp.apply_recipe(model, family)


# The examples' loss (examples/common/trainer.py) and custom loop's (examples/custom_loop.py).
def _fit_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("family,task", [("transformer", "lm"), ("rnn", "lm"), ("transformer", "classify"),
                                         ("cnn", "lm")])
def test_example_models_pass_check_model(policy, family, task):
    keras_amp.enable(policy)
    model = _example(family, task)
    model.compile(optimizer=keras_amp.wrap(keras.optimizers.Adam()), loss=_fit_loss())
    report = check.check_model(model)
    assert report.ok, str(report)
    head = outputs.current_dtype(model.outputs[0])
    if family == "cnn":
        assert head == "float32"  # the cnn recipe's last layer
    else:
        assert head == policy.removeprefix("mixed_")  # guard: a 16-bit output was really judged
        assert any("output 0 ('logits')" in n and "SparseSoftmaxCrossEntropyWithLogits" in n for n in report.notes)


def test_custom_loop_model_passes_with_its_loss_and_is_flagged_without_one():
    keras_amp.enable("mixed_bfloat16")
    model = _example("transformer")  # examples/custom_loop.py: the Transformer, never compiled
    unknown = check.check_model(model).of_kind("output_not_float32")
    assert [f.layer for f in unknown] == ["logits"] and "no loss is known" in unknown[0].message
    loop_loss = keras_amp.losses.float32_loss(_fit_loss())
    assert check.check_model(model, loss=loop_loss).ok
    assert check.check_model(model, loss=[loop_loss]).ok  # a structure per output, as compile takes


def _head(make_layer, policy="mixed_bfloat16"):
    """A Dense layer and the head `make_layer()` builds, under `policy`."""
    keras_amp.enable(policy)
    inp = keras.Input((16,))
    return keras.Model(inp, make_layer()(keras.layers.Dense(16)(inp)))


@pytest.mark.parametrize("loss,computes", [
    (keras.losses.SparseCategoricalCrossentropy(), "Minimum in float32"),  # probabilities: clipped, then log
    ("mse", "Sub in float32"),                                             # a regression output
    (keras.losses.BinaryCrossentropy(from_logits=True), "GreaterEqual"),   # composite: not recognised
])
def test_unsafe_16bit_outputs_are_still_flagged(loss, computes):
    model = _head(lambda: keras.layers.Dense(8, activation="softmax", name="probs", dtype="mixed_bfloat16"))
    assert outputs.current_dtype(model.outputs[0]) == "bfloat16"  # guard: the 16-bit output under test
    model.compile(optimizer="adam", loss=loss)
    found = check.check_model(model).of_kind("output_not_float32")
    assert [f.layer for f in found] == ["probs"], found
    assert computes in found[0].message and "bfloat16-rounded" in found[0].message


def test_logits_layer_output_is_float32_and_not_flagged():
    # Logits computes in bfloat16 and returns float32: the check asks the layer, not its policy.
    model = _head(lambda: amp_layers.Logits(8, name="head"))
    assert model.get_layer("head").compute_dtype == "bfloat16"
    assert check.check_model(model).of_kind("output_not_float32") == []
    stock = _head(lambda: keras.layers.Dense(8, name="head"))
    assert [f.layer for f in check.check_model(stock).of_kind("output_not_float32")] == ["head"]


def test_nested_model_output_follows_the_inner_layer_set_in_place():
    keras_amp.enable("mixed_bfloat16")
    inner_in = keras.Input((16,))
    inner = keras.Model(inner_in, keras.layers.Dense(8, name="head")(inner_in), name="inner")
    inp = keras.Input((16,))
    model = keras.Model(inp, inner(inp))
    # The traced call names the layer inside the nested model whose output the model returns.
    assert [f.layer for f in check.check_model(model).of_kind("output_not_float32")] == ["inner/head"]
    inner.get_layer("head").dtype_policy = "float32"
    assert check.check_model(model).of_kind("output_not_float32") == []


class _Block(keras.layers.Layer):
    """Calls three layers; the model's graph sees only the block (keras-hub's encoders)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up, self.down = keras.layers.Dense(32, name="up"), keras.layers.Dense(16, name="down")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(x + self.down(self.up(x)))


def test_a_blocks_output_names_its_last_layer_and_following_the_fix_clears_it():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((16,))
    model = keras.Model(inp, _Block(name="encoder")(inp))
    (found,) = check.check_model(model).of_kind("output_not_float32")
    # Before: 'encoder' and rules={'encoder': 'float32'}, which makes every layer inside it float32.
    assert found.layer == "encoder/norm" and "rules={'encoder/norm': 'float32'}" in found.fix, found
    keras_amp.apply_recipe(model, "transformer", rules={"encoder/norm": "float32"})
    assert check.check_model(model).of_kind("output_not_float32") == []
    assert [layer.dtype_policy.name for layer in (model.get_layer("encoder").up, model.get_layer("encoder").down)] == [
        "mixed_bfloat16"] * 2  # the block's other layers stay 16-bit


def test_loss_of_a_wrong_type_is_refused():
    model = _head(lambda: keras.layers.Dense(8))
    with pytest.raises(TypeError, match=r"`loss` must be None.*Received: loss=3"):
        check.check_model(model, loss=3)
    with pytest.raises(ValueError, match=r"Unknown `loss` name. Received: loss=\['bogus'\]"):
        check.check_model(model, loss=["bogus"])
    by_name = check.check_model(model, loss={model.output_names[0]: _fit_loss()})
    assert by_name.ok and by_name.notes[0].startswith("output 0")


class _SpecSays16Bit(keras.layers.Dense):
    """Returns float32 logits while its output spec says the compute dtype, as keras-hub's ReversibleEmbedding
    (reverse_dtype="float32") does for every keras-hub language model's head."""

    def call(self, x):
        return keras.ops.cast(super().call(x), "float32")

    def compute_output_spec(self, x):
        return keras.KerasTensor(tuple(x.shape[:-1]) + (self.units,), dtype=self.compute_dtype)


def test_an_output_is_read_as_the_traced_call_gives_it_not_as_its_spec_says():
    model = _head(lambda: _SpecSays16Bit(8, name="head"))
    assert outputs.current_dtype(model.outputs[0]) == "bfloat16"  # guard: the spec says 16 bits
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for report in (check.check_model(model), check.check_model(model, keras.ops.ones((2, 16)))):
        # Before: a note that each logit "is bfloat16 by choice" and is rounded to bfloat16: it is not.
        assert report.ok and not [n for n in report.notes if "'head'" in n], report.notes
    assert outputs.output_findings(model, ran=("bfloat16",))[1]  # what the traced call gives decides


def test_features_are_not_told_to_become_logits():
    # A backbone's output (keras-hub GPT-2: its final LayerNormalization; a pooled CNN) is features, not a
    # head's logits: the fix says to check the model built on it, and names no Logits / OutputHead head.
    keras_hub = pytest.importorskip("keras_hub")
    keras_amp.enable("mixed_float16")
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=8)
    inp = keras.Input((8, 8, 3))
    pooled = keras.Model(inp, keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(4, 3)(inp)))
    for model, layer in ((backbone, "layer_norm"), (pooled, "global_average_pooling2d")):
        [found] = check.check_model(model).of_kind("output_not_float32")
        assert found.layer == layer and "is no projection" in found.fix and "model built on it" in found.fix
        assert "Logits" not in found.fix and "OutputHead" not in found.fix
        assert f"rules={{{layer!r}: 'float32'}}" in found.fix
    head = _head(lambda: keras.layers.Dense(8, name="head"))  # a projection: the Logits advice stands
    [found] = check.check_model(head).of_kind("output_not_float32")
    assert "keras_amp.layers.Logits" in found.fix and "no projection" not in found.fix

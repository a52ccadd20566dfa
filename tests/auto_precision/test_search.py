"""search_precision: finds the sensitive layer (and only it), matches brute force, restores the model."""

import itertools
import math

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from auto_precision_models import Amplify, Offset, SubclassedSensitive, regression_data, sensitive_model
from keras_amp.auto_precision import model_policies, search_precision
from keras_amp.auto_precision import measure
from tests.helpers import count_walks

X, Y = regression_data()
BATCHES = [(X[:64], Y[:64]), (X[64:128], Y[64:128])]


def _passes(model, float32_paths, tolerance):
    """Brute-force oracle: does keeping exactly `float32_paths` float32 meet the tolerance?"""
    with model_policies.temporary_policies(model):
        model_policies.set_policies(model, {p: "float32" for p in model_policies.policy_names(model)})
        ref = measure.run(model, BATCHES, measure.loss_of(model, "mse"))
    with model_policies.temporary_policies(model):
        model_policies.set_policies(model, {p: "float32" for p in float32_paths})
        errors = measure.errors(measure.run(model, BATCHES, measure.loss_of(model, "mse")), ref)
    return errors.finite and errors.loss <= tolerance


def test_finds_only_the_sensitive_layer_and_matches_brute_force():
    model = sensitive_model("mixed_bfloat16")
    before = model_policies.policy_names(model)
    result = search_precision(model, BATCHES, tolerance=0.01)
    assert result.float32_layers == ("sensitive",)
    assert result.rules == {"sensitive": "float32"}
    # Edge reached: the model as it is fails the tolerance, the chosen one meets it.
    assert result.errors_as_is.loss > 0.05 and result.errors_final.loss <= 0.01
    # Brute force over every subset of the 3 candidates: the smallest passing size is 1, and
    # {sensitive} is the only passing subset of that size.
    paths = [d.path for d in result.layers]
    assert sorted(paths) == ["d1", "out", "sensitive"]
    passing = [set(s) for k in range(4) for s in itertools.combinations(paths, k) if _passes(model, s, 0.01)]
    smallest = min(len(s) for s in passing)
    assert smallest == 1 and [s for s in passing if len(s) == smallest] == [{"sensitive"}]
    # The model comes back with the policies it had; passes are as documented (2 + N + log + prune).
    assert model_policies.policy_names(model) == before
    assert result.passes_per_batch == 2 + 3 + math.ceil(math.log2(3 + 1))
    top = max(result.layers, key=lambda d: d.sensitivity.loss)
    assert top.path == "sensitive" and top.decision == "float32" and "tolerance" in top.reason
    assert "sensitive" in str(result)


def test_searched_model_trains_to_float32_loss_where_plain_mixed_does_not():
    model = sensitive_model("mixed_bfloat16")
    result = search_precision(model, BATCHES, tolerance=0.01)
    init = model.get_weights()
    final = {}
    for name in ("float32", "mixed", "searched"):
        m = sensitive_model("float32" if name == "float32" else "mixed_bfloat16")
        m.set_weights(init)
        if name == "searched":
            result.apply(m)
            assert m.get_layer("sensitive").dtype_policy.name == "float32"
        m.fit(X, Y, batch_size=32, epochs=30, verbose=0)
        keras.config.set_dtype_policy("float32")
        final[name] = m.evaluate(X, Y, verbose=0)
    assert abs(final["searched"] - final["float32"]) / final["float32"] < 0.01, final
    assert (final["mixed"] - final["float32"]) / final["float32"] > 0.5, final  # plain mixed does not get there


def test_float16_overflow_layer_is_found():
    model = sensitive_model("mixed_float16", sensitive=Amplify)
    result = search_precision(model, BATCHES[:1], tolerance=0.01, batches=1)
    assert not result.errors_as_is.finite  # the edge: float16 overflows to inf/NaN as it is
    assert result.float32_layers == ("sensitive",)
    assert result.errors_final.finite


def test_subclassed_model_and_candidates_filter():
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = SubclassedSensitive()
    model(X[:2])
    result = search_precision(model, BATCHES, loss="mse")
    assert [p.split("/")[-1] for p in result.float32_layers] == ["sensitive"]
    only_dense = search_precision(model, BATCHES, loss="mse", candidates=[r".*d1", r".*out"])
    assert {d.path.split("/")[-1] for d in only_dense.layers} == {"d1", "out"}
    # The sensitive layer cannot be moved, so the tolerance is not met within the candidates, and the reasons say so.
    assert only_dense.errors_final.loss > 0.01
    assert all(d.reason == "kept float32; the tolerance is not met even with every candidate in float32"
               for d in only_dense.layers), [d.reason for d in only_dense.layers]


def test_budget_caps_the_float32_layers():
    model = sensitive_model("mixed_bfloat16")
    result = search_precision(model, BATCHES, budget=0)
    assert result.float32_layers == () and result.rules == {}
    assert result.errors_final.loss > 0.01
    # Before: "16-bit is within tolerance together with the float32 layers", which it was not.
    assert {d.reason for d in result.layers} == {"16-bit: past budget=0; the tolerance is not met"}
    one = search_precision(sensitive_model("mixed_bfloat16"), BATCHES, budget=1, tolerance=1e-12, verbose=0)
    assert [d.reason for d in one.layers if d.decision == "float32"] == [
        "kept float32 (one of the budget=1 most sensitive); the tolerance is not met"]


def test_already_within_tolerance_keeps_nothing():
    model = sensitive_model("mixed_bfloat16", sensitive=lambda name: keras.layers.Identity(name=name))
    result = search_precision(model, BATCHES, tolerance=0.05, verbose=0)
    assert result.float32_layers == ()
    assert result.errors_as_is.loss <= 0.05
    # The Identity computes nothing: no candidate. Reference, as-is, one pass per Dense.
    assert result.left_out == ("sensitive",) and sorted(d.path for d in result.layers) == ["d1", "out"]
    assert result.passes_per_batch == 2 + 2


def test_a_model_without_a_loss_needs_one():
    model = sensitive_model("mixed_bfloat16")
    uncompiled = keras.Model(model.inputs, model.outputs)
    with pytest.raises(ValueError, match="needs a loss"):
        search_precision(uncompiled, BATCHES)


def _model_with_costless_layers():
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, name="d1")(inp)
    h = keras.layers.Activation("relu", name="relu")(h)
    h = keras.layers.Dropout(0.5, name="dropout")(h)
    h = keras.layers.Activation("hard_swish", name="hard_swish")(h)
    h = Offset(name="sensitive")(h)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile("adam", "mse")
    return model


def test_layers_without_weights_or_arithmetic_are_no_candidates_and_cost_is_flops():
    result = search_precision(_model_with_costless_layers(), BATCHES, verbose=0)
    assert result.left_out == ("relu", "dropout")  # relu selects, Dropout at inference does nothing
    shares = {d.path: d.cost_share for d in result.layers}
    assert sorted(shares) == ["d1", "hard_swish", "out", "sensitive"]  # computes, without weights: kept
    assert result.float32_layers == ("sensitive",)
    # Shares of the candidates' floating-point operations on the first 64-row batch, against closed
    # forms: multiply-adds + bias adds for the Dense layers, two adds per element for the offset.
    d1, out, offset = 64 * 16 * 8 + 64 * 16, 64 * 1 * 16 + 64, 2 * 64 * 16
    assert shares["out"] / shares["d1"] == pytest.approx(out / d1)
    assert shares["sensitive"] / shares["d1"] == pytest.approx(offset / d1)
    assert shares["hard_swish"] > 0 and sum(shares.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("verbose", [0, 1, 2, "auto"])
def test_progress_is_shown_as_fit_shows_it(verbose, capsys):
    model = sensitive_model("mixed_bfloat16")
    result = search_precision(model, BATCHES, verbose=verbose)
    out = capsys.readouterr().out
    if verbose == 0:
        assert out == ""
        return
    assert out.startswith("search_precision: 3 candidate layer(s) (0 without weights")
    if verbose == 2:
        lines = [line for line in out.splitlines() if line.startswith("search_precision: pass ")]
        assert len(lines) == result.passes_per_batch  # one line per forward/backward pass
        assert "sensitive alone in 16 bits: loss error" in out and lines[-1].startswith(
            f"search_precision: pass {result.passes_per_batch}/{result.passes_per_batch},")
    else:
        assert f"{result.passes_per_batch}/{result.passes_per_batch}" in out and "pass" in out  # a Progbar


@pytest.mark.parametrize("verbose, error", [("loud", TypeError), (True, TypeError), (3, ValueError)])
def test_bad_verbose_is_refused(verbose, error):
    with pytest.raises(error, match=r"`verbose` must be \"auto\", 0, 1 or 2"):
        search_precision(sensitive_model("mixed_bfloat16"), BATCHES, verbose=verbose)


def test_one_walk_of_the_model_serves_every_candidate(monkeypatch):
    model = sensitive_model("mixed_bfloat16")
    walked = count_walks(monkeypatch)
    result = search_precision(model, BATCHES, policy="mixed_bfloat16", tolerance=0.01, verbose=0)
    assert walked == [model]
    assert len(result.layers) == 3 and result.passes_per_batch > 5  # guard: several candidates and trials
    walked.clear()
    result.apply(model)
    assert walked == [model] and model.get_layer("sensitive").dtype_policy.name == "float32"


def test_an_lstm_is_one_candidate_with_its_cell_and_its_float32_survives_a_keras_file(tmp_path):
    # The cell had been the candidate: the LSTM still cast its input to bfloat16 (so "every candidate
    # float32" missed a 1e-9 tolerance), and a .keras file rebuilt the cell with the LSTM's policy.
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((16,), dtype="int32")
    h = keras.layers.LSTM(32, name="lstm")(keras.layers.Embedding(50, 32, name="embedding")(inp))
    model = keras.Model(inp, keras.layers.Dense(5, name="out")(h))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model_policies.set_policies(model, {"embedding": "float32", "out": "float32"})  # the LSTM alone in 16 bits
    rng = np.random.default_rng(0)
    data = (rng.integers(0, 50, (32, 16)), rng.integers(0, 5, (32,)))
    result = search_precision(model, data, tolerance=1e-9, verbose=0)
    assert [(d.path, d.layer_class) for d in result.layers] == [("lstm", "LSTM")] and result.left_out == ()
    assert result.float32_layers == ("lstm",) and result.rules == {"lstm": "float32"}
    assert result.errors_as_is.loss > 1e-7 and result.errors_final.loss == 0.0  # float32 throughout
    assert result.layers[0].reason == "kept float32: needed to meet the tolerance"
    result.apply(model)
    model.save(tmp_path / "m.keras")
    keras.config.set_dtype_policy("mixed_bfloat16")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    policies = model_policies.policy_names(loaded)
    assert policies == model_policies.policy_names(model) and policies["lstm/lstm_cell"] == "float32"


def _hub_backbone(name):
    """A tiny keras-hub backbone (random weights, offline) with one output, one batch for it, and the
    candidates: its transformer block and a layer inside it."""
    rng = np.random.default_rng(0)
    ids, mask = rng.integers(0, 64, (1, 4)).astype("int32"), np.ones((1, 4), "int32")
    text = dict(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
                max_sequence_length=16)
    if name == "gpt2":
        model, x = keras_hub.models.GPT2Backbone(**text), {"token_ids": ids, "padding_mask": mask}
        block, inside = "transformer_layer_0", "feedforward_output_dense"
    elif name == "bert":
        bert = keras_hub.models.BertBackbone(**text)
        model = keras.Model(bert.inputs, bert.output["sequence_output"])  # the search takes one output
        x = {"token_ids": ids, "padding_mask": mask, "segment_ids": np.zeros_like(ids)}
        block, inside = "transformer_layer_0", "self_attention_layer_norm"
    else:
        model = keras_hub.models.ViTBackbone(image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
                                             hidden_dim=16, mlp_dim=32)
        x = rng.random((1, 8, 8, 3)).astype("float32")
        block, inside = "vit_encoder/transformer_block_1", "mlp/dense_2"
    return model, (x, rng.normal(size=model(x).shape).astype("float32")), block, f"{block}/{inside}"


# Each backbone under one policy, both policies among them (the crash came in both).
@pytest.mark.parametrize(("backbone", "policy"), [("gpt2", "mixed_float16"), ("bert", "mixed_bfloat16"),
                                                  ("vit", "mixed_float16")])
def test_keras_hub_backbones_are_searched_with_their_blocks_as_candidates(backbone, policy):
    # A transformer block adds its input to its sublayers' results with a raw `x + residual`. The block
    # had been measured "alone in 16 bits" with float32 sublayers: AddV2 refused a half and a float tensor.
    keras_amp.enable(policy)
    keras.utils.set_random_seed(0)
    model, data, block, inside = _hub_backbone(backbone)
    before = model_policies.policy_names(model)
    # Tolerance 0: past the prefix search to the budget's end, every candidate float32.
    result = search_precision(model, data, loss="mse", tolerance=0.0, candidates=[block, inside], verbose=0)
    assert model_policies.policy_names(model) == before
    decisions = {d.path: d for d in result.layers}
    assert list(decisions) == [inside, block]  # the layer inside first: float32, the block takes it along
    assert decisions[block].sensitivity.finite and "does not run" not in decisions[block].reason
    if backbone == "bert":  # its layer norm's result meets a 16-bit one in `x + residual`
        assert "alone in 16 bits (the layers around it float32) it does not run" in decisions[inside].reason
    assert result.float32_layers == (block,) and decisions[inside].decision == "float32"
    # Applied, the model runs, and its errors are those the search measured for it.
    loss = measure.loss_of(model, "mse")
    with model_policies.temporary_policies(model):
        model_policies.set_policies(model, {p: "float32" for p in before})
        ref = measure.run(model, [data], loss)
    result.apply(model)
    assert measure.errors(measure.run(model, [data], loss), ref) == result.errors_final


@keras.saving.register_keras_serializable(package="keras_amp_tests")
class _Residual(keras.layers.Layer):
    """x + inner(x) with a raw TensorFlow add, which takes one dtype: it runs only where the layer and its
    Dense compute in one dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, name="inner")

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return tf.add(self.inner(x), x)


def test_a_configuration_that_does_not_run_is_not_viable_and_the_result_is_what_was_measured():
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = _Residual(name="block")(keras.layers.Dense(16, name="d1")(inp))
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(Offset(name="sensitive")(h)))
    model.compile("adam", "mse")
    result = search_precision(model, BATCHES, tolerance=1e-9, verbose=0)
    decisions = {d.path: d for d in result.layers}
    # The Dense alone in 16 bits inside a float32 block does not run (a bfloat16 and a float32 tensor meet
    # in the add): not viable, said so, and the search goes on. The block with its Dense in 16 bits runs.
    inner = decisions["block/inner"]
    assert not inner.sensitivity.finite and "alone in 16 bits (the layers around it float32) it does not run" in \
        inner.reason and "AddV2" in inner.reason, inner.reason
    assert decisions["block"].sensitivity.finite
    # Float32, the block takes its Dense along: the inner layer is float32 with it, not a layer of its own.
    assert "block" in result.float32_layers and "block/inner" not in result.float32_layers
    assert inner.decision == "float32" and inner.reason.startswith("float32 with block, a layer above it")
    # Applied, the result is the configuration the search measured last.
    with model_policies.temporary_policies(model):
        model_policies.set_policies(model, {p: "float32" for p in model_policies.policy_names(model)})
        ref = measure.run(model, BATCHES, measure.loss_of(model, None))
    result.apply(model)
    assert model.get_layer("block").inner.dtype_policy.name == "float32"
    assert measure.errors(measure.run(model, BATCHES, measure.loss_of(model, None)), ref) == result.errors_final


def test_sample_weights_weigh_the_loss_as_fit_does_with_a_loss_name():
    # Before: "mean_squared_error() takes 2 positional arguments but 3 were given".
    x, y = BATCHES[0]
    w = (np.arange(len(x)) % 2).astype("float32")  # every other row
    weighted = search_precision(sensitive_model("mixed_bfloat16"), (x, y, w), verbose=0)
    rows = search_precision(sensitive_model("mixed_bfloat16"), (x[w > 0], y[w > 0]), verbose=0)
    unweighted = search_precision(sensitive_model("mixed_bfloat16"), (x, y), verbose=0)
    # Loss and gradient errors are relative: a weighted mean over the batch equals the mean over its rows.
    assert weighted.errors_as_is.loss == pytest.approx(rows.errors_as_is.loss, rel=1e-3)
    assert weighted.errors_as_is.gradient == pytest.approx(rows.errors_as_is.gradient, rel=1e-3)
    assert abs(unweighted.errors_as_is.loss - rows.errors_as_is.loss) > 1e-3 * rows.errors_as_is.loss  # guard
    ds = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(64)
    from_ds = search_precision(sensitive_model("mixed_bfloat16"), ds, verbose=0)
    assert from_ds.errors_as_is == weighted.errors_as_is and from_ds.float32_layers == ("sensitive",)


def test_a_target_of_none_or_a_batch_the_model_cannot_take_is_an_error_naming_data():
    model = sensitive_model("mixed_bfloat16")
    x, y = BATCHES[0]
    with pytest.raises(ValueError, match=r"`data` must yield \(x, y\[, sample_weight\]\) batches with targets y"):
        search_precision(model, (x, None), verbose=0)  # before: "Attempt to convert a value (None)"
    with pytest.raises(ValueError) as info:
        search_precision(model, (np.ones((64, 5), "float32"), y), verbose=0)
    # Before: "in user code: File .../audit.py ..." about `x`.
    assert str(info.value).startswith("`data` must yield (x, y[, sample_weight]) batches that model 'sensitive_model'")
    assert "found shape=(64, 5)" in str(info.value) and "in user code" not in str(info.value)


def test_a_model_without_16_bit_layers_is_an_error_naming_its_policy_unless_a_policy_is_given():
    model = sensitive_model("float32")  # built without keras_amp.enable()
    before = model_policies.policy_names(model)
    # Before: "0 float32 layer(s) of 0 candidates", silently.
    with pytest.raises(ValueError, match=r"every layer of model 'sensitive_model' computes in float32 \(its dtype "
                                         r"policy: 'float32'\), so there is nothing to search"):
        search_precision(model, BATCHES, verbose=0)
    result = search_precision(model, BATCHES, policy="mixed_bfloat16", verbose=0)
    assert result.float32_layers == ("sensitive",) and len(result.layers) == 3
    assert model_policies.policy_names(model) == before
    mixed = sensitive_model("mixed_bfloat16")
    model_policies.set_policies(mixed, {"d1": "float32"})
    with pytest.raises(ValueError, match=r"`candidates` must match layers computing in 16 bits"):
        search_precision(mixed, BATCHES, candidates=["d1"], verbose=0)


def test_result_columns_are_as_wide_as_the_longest_path():
    from keras_amp.auto_precision.search import Errors, LayerDecision, SearchResult  # noqa: PLC0415

    errors = Errors(loss=1e-3, output=1e-3, gradient=1e-3)
    paths = ("d", "multi_head_attention_with_a_long_name/attention_output")
    result = SearchResult(
        rules={}, float32_layers=(), tolerance=1e-2, passes_per_batch=4, batches=1,
        seconds=0.1, errors_as_is=errors, errors_final=errors,
        layers=tuple(LayerDecision(p, "EinsumDense", errors, 0.5, "mixed_bfloat16", "within tolerance") for p in paths))
    rows = [row for row in str(result).splitlines() if "EinsumDense" in row]
    assert len(rows) == 2 and len({row.index("EinsumDense") for row in rows}) == 1, rows

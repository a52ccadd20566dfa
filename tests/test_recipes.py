"""apply_recipe / plan_recipe: per-layer policies, layer swaps, weights, rules, errors, training."""

import re
import warnings
from unittest import mock

import keras
import numpy as np
import pytest

import keras_amp
from keras_amp import recipes
from keras_amp import layers as amp_layers

MIXED = ["mixed_float16", "mixed_bfloat16"]
# This CPU has no fast float16; enable() says so. The numerics, not the speed, are under test here.
pytestmark = pytest.mark.filterwarnings("ignore:mixed_float16 requested:keras_amp.AmpWarning")


def resnet_cnn():
    inp = keras.Input((12, 12, 3), name="image")
    x = keras.layers.Rescaling(1 / 4.0, name="rescale")(inp)
    x = keras.layers.Conv2D(16, 3, padding="same", name="stem")(x)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    y = keras.layers.Conv2D(16, 3, padding="same", name="conv_a")(x)
    y = keras.layers.BatchNormalization(name="bn_a")(y)
    y = keras.layers.ReLU(name="relu_a")(y)
    y = keras.layers.Conv2D(16, 3, padding="same", name="conv_b")(y)
    y = keras.layers.BatchNormalization(name="bn_b")(y)
    x = keras.layers.Add(name="residual")([x, y])
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = keras.layers.Dense(4, name="logits")(x)
    out = keras.layers.Activation("softmax", name="probs")(x)
    return keras.Model(inp, out, name="resnet")


def transformer_encoder(dropout=0.1):
    inp = keras.Input((8,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(32, 16, name="embed")(inp)
    a = keras.layers.MultiHeadAttention(2, 8, dropout=dropout, name="mha")(x, x)
    x = keras.layers.LayerNormalization(name="ln_1")(keras.layers.Add(name="add_1")([x, a]))
    f = keras.layers.Dense(32, activation="relu", name="ffn_1")(x)
    f = keras.layers.Dense(16, name="ffn_2")(f)
    x = keras.layers.LayerNormalization(name="ln_2")(keras.layers.Add(name="add_2")([x, f]))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    out = keras.layers.Dense(1, name="head")(x)
    return keras.Model(inp, out, name="encoder")


def lstm_model():
    return keras.Sequential(
        [
            keras.Input((6, 4), name="series"),
            keras.layers.LSTM(16, return_sequences=True, name="lstm"),
            keras.layers.GRU(16, return_sequences=True, name="gru"),
            keras.layers.Dense(1, name="per_step"),
        ],
        name="rnn",
    )


def expected(recipe, compute):
    f32 = "float32"
    return {
        "cnn": {
            "rescale": f32, "stem": f32, "stem_bn": f32, "stem_relu": compute, "conv_a": compute,
            "bn_a": f32, "relu_a": compute, "conv_b": compute, "bn_b": f32, "residual": compute,
            "pool": compute, "logits": f32, "probs": f32,
        },
        "transformer": {
            "embed": compute, "mha": compute, "add_1": compute, "ln_1": f32, "ffn_1": compute,
            "ffn_2": compute, "add_2": compute, "ln_2": f32, "pool": compute, "head": f32,
        },
        "rnn": {"lstm": compute, "gru": compute, "per_step": f32},
    }[recipe]


BUILDERS = {"cnn": resnet_cnn, "transformer": transformer_encoder, "rnn": lstm_model}


def layer_policies(model):
    return {l.name: l.dtype_policy.name for l in model.layers if not isinstance(l, keras.layers.InputLayer)}


@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("recipe", ["cnn", "transformer", "rnn"])
def test_policies_are_exactly_the_recipes(recipe, policy):
    keras_amp.enable(policy)
    model = BUILDERS[recipe]()
    plan = recipes.plan_recipe(model, recipe)
    assert plan.policies() == expected(recipe, policy)
    new = keras_amp_apply(model, recipe)
    assert layer_policies(new) == expected(recipe, policy)
    # Sublayers follow their parent: the swapped attention's projections compute in the compute dtype.
    if recipe == "transformer":
        assert type(new.get_layer("mha")) is amp_layers.MultiHeadAttention
        assert new.get_layer("mha")._query_dense.dtype_policy.name == policy
    if recipe == "rnn":
        assert type(new.get_layer("lstm")) is amp_layers.LSTM
        assert type(new.get_layer("gru")) is amp_layers.GRU
    assert new.outputs[0].dtype == "float32"
    assert layer_policies(model) == {k: policy for k in expected(recipe, policy)}  # input untouched


def keras_amp_apply(model, recipe, rules=None):
    return recipes.apply_recipe(model, recipe, rules=rules)


@pytest.mark.parametrize("recipe", ["cnn", "transformer", "rnn"])
def test_weights_are_preserved_exactly(recipe):
    keras_amp.enable("mixed_bfloat16")
    model = BUILDERS[recipe]()
    for w in model.weights:  # non-default values, so equality is not a coincidence of initialisers
        w.assign(np.random.default_rng(len(w.path)).normal(size=w.shape).astype(w.dtype))
    new = recipes.apply_recipe(model, recipe)
    assert [w.path for w in new.weights] == [w.path for w in model.weights]
    for old, fresh in zip(model.weights, new.weights):
        assert fresh.dtype == old.dtype == "float32"
        np.testing.assert_array_equal(fresh.numpy(), old.numpy())  # exact: assign of float32 to float32


def _data(recipe, n=64):
    rng = np.random.default_rng(0)
    if recipe == "cnn":
        x = rng.uniform(0, 4, (n, 12, 12, 3)).astype("float32")
        return x, (x[..., 0].mean(axis=(1, 2)) * 4).astype("int32") % 4
    if recipe == "transformer":
        x = rng.integers(0, 32, (n, 8)).astype("int32")
        return x, (x.mean(axis=1, keepdims=True) / 16.0).astype("float32")
    x = rng.normal(size=(n, 6, 4)).astype("float32")
    return x, np.cumsum(x[..., :1], axis=1).astype("float32")


@pytest.mark.slow
@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("recipe", ["cnn", "transformer", "rnn"])
def test_recipe_model_trains_with_finite_decreasing_loss(recipe, policy):
    keras.utils.set_random_seed(1)
    keras_amp.enable(policy)
    model = recipes.apply_recipe(BUILDERS[recipe](), recipe)
    loss = "sparse_categorical_crossentropy" if recipe == "cnn" else "mse"
    model.compile(keras.optimizers.Adam(3e-3), loss=loss)
    # Guard: under mixed_float16 Keras wraps the optimizer, so the run really uses loss scaling.
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (policy == "mixed_float16")
    x, y = _data(recipe)
    history = model.fit(x, y, batch_size=16, epochs=6, verbose=0).history["loss"]
    assert np.all(np.isfinite(history)), history
    assert history[-1] < 0.9 * history[0], history


def test_sequential_and_nested_models_and_input_names():
    keras_amp.enable("mixed_bfloat16")
    inner_in = keras.Input((8,))
    inner = keras.Model(inner_in, keras.layers.Dense(8, name="inner_dense")(inner_in), name="block")
    inp = keras.Input((8,), name="features")
    out = keras.layers.Dense(3, name="out")(inner(keras.layers.Dense(8, name="first")(inp)))
    model = keras.Model(inp, out)
    plan = recipes.plan_recipe(model, "cnn")
    assert plan.policies() == {"first": "float32", "block/inner_dense": "mixed_bfloat16", "out": "float32"}
    new = recipes.apply_recipe(model, "cnn")
    assert new.get_layer("block").get_layer("inner_dense").dtype_policy.name == "mixed_bfloat16"
    assert new.inputs[0].name == "features"
    x = np.ones((2, 8), "float32")
    np.testing.assert_allclose(new.predict(x, verbose=0), model.predict(x, verbose=0), rtol=0.05, atol=0.05)


def test_policy_map_is_a_keras_dtype_policy_map():
    keras_amp.enable("mixed_bfloat16")
    plan = recipes.plan_recipe(transformer_encoder(), "transformer")
    pmap = plan.policy_map()
    assert isinstance(pmap, keras.dtype_policies.DTypePolicyMap)
    assert pmap["ln_1"].name == "float32" and pmap["ffn_1"].name == "mixed_bfloat16"
    assert pmap.default_policy.name == "mixed_bfloat16"
    assert "mha" in str(plan) and "keras_amp.layers.MultiHeadAttention" in str(plan)


class MyRMSNorm(keras.layers.Layer):
    def call(self, x):
        return x / keras.ops.sqrt(keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True) + 1e-6)


def deny_model():
    inp = keras.Input((8,))
    x = keras.layers.Dense(8, activation="softmax", name="dense_softmax")(inp)
    x = keras.layers.Dense(8, activation="exponential", name="dense_exp")(x)
    x = keras.layers.Activation("log_softmax", name="act_logsoftmax")(x)
    x = keras.layers.ActivityRegularization(l2=1e-3, name="act_reg")(x)
    x = MyRMSNorm(name="user_norm")(x)
    x = keras.layers.Softmax(name="softmax")(x)
    x = keras.layers.Dense(8, name="middle")(x)
    out = keras.layers.Dense(8, name="out")(x)
    return keras.Model(inp, out)


def test_deny_list_is_float32_in_every_recipe():
    keras_amp.enable("mixed_float16")
    for recipe in recipes.RECIPES:
        plan = recipes.plan_recipe(deny_model(), recipe)
        denied = {e.path: e.reason for e in plan.layers if e.reason.startswith("deny list")}
        assert denied == {
            "dense_softmax": "deny list: softmax", "dense_exp": "deny list: exp",
            "act_logsoftmax": "deny list: softmax", "act_reg": "deny list: loss",
            "user_norm": "deny list: normalization", "softmax": "deny list: softmax",
        }, recipe
        assert all(plan.policies()[p] == "float32" for p in denied)
        assert plan.policies()["middle"] == "mixed_float16"
    new = recipes.apply_recipe(deny_model(), "transformer")
    assert type(new.get_layer("softmax")) is amp_layers.Softmax
    assert new.get_layer("softmax").dtype_policy.name == "float32"


def test_rules_override_recipe_and_deny_list_later_rules_win():
    keras_amp.enable("mixed_float16")
    model = transformer_encoder()
    rules = {
        keras.layers.LayerNormalization: "mixed_float16",  # overrides the deny list
        r"ffn_.*": "float32",
        "ffn_2": keras.DTypePolicy("mixed_float16"),  # later rule wins
        "mha": "float32",  # a ruled layer keeps its class
    }
    new = recipes.apply_recipe(model, "transformer", rules=rules)
    got = layer_policies(new)
    assert (got["ln_1"], got["ln_2"], got["ffn_1"], got["ffn_2"], got["mha"]) == (
        "mixed_float16", "mixed_float16", "float32", "mixed_float16", "float32",
    )
    assert type(new.get_layer("mha")) is keras.layers.MultiHeadAttention
    assert type(new.get_layer("ln_1")) is keras.layers.LayerNormalization
    assert got["head"] == "float32"  # untouched by rules


def test_unknown_or_invalid_arguments_raise_clear_errors():
    model = lstm_model()
    with pytest.raises(ValueError, match=re.escape("Received: recipe='vit'. Allowed: cnn, rnn, transformer")):
        recipes.apply_recipe(model, "vit")
    with pytest.raises(TypeError, match="`recipe` must be a string"):
        recipes.apply_recipe(model, None)
    with pytest.raises(TypeError, match=r"`rules` must be None or a mapping.*Received: rules=\[\('lstm'"):
        recipes.apply_recipe(model, "rnn", rules=[("lstm", "float32")])
    with pytest.raises(ValueError, match=re.escape("Received: rules['lstm']='int8'. Allowed: bfloat16, float16")):
        recipes.apply_recipe(model, "rnn", rules={"lstm": "int8"})
    with pytest.raises(ValueError, match=r"not a valid regex.*Received: rules key '\(lstm'"):
        recipes.apply_recipe(model, "rnn", rules={"(lstm": "float32"})
    with pytest.raises(TypeError, match="Received: rules key 3 of type int"):
        recipes.apply_recipe(model, "rnn", rules={3: "float32"})
    with pytest.raises(TypeError, match="Received: rules key <class 'int'>"):
        recipes.apply_recipe(model, "rnn", rules={int: "float32"})


def test_subclassed_and_unbuilt_models_are_rejected():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net(np.ones((1, 4)))
    with pytest.raises(TypeError, match="needs a Sequential or functional model.*Received: model of type Net"):
        recipes.apply_recipe(net, "cnn")
    with pytest.raises(ValueError, match="must be built.*built=False"):
        recipes.apply_recipe(keras.Sequential([keras.layers.Dense(4)]), "cnn")


def test_model_built_before_enable_is_converted_without_a_warning():
    model = resnet_cnn()  # float32
    keras_amp.enable("mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_amp.AmpWarning)
        new = recipes.apply_recipe(model, "cnn")
    assert layer_policies(new) == expected("cnn", "mixed_bfloat16")


def test_compiled_model_is_recompiled_from_its_config():
    keras_amp.enable("mixed_float16")
    model = transformer_encoder()
    model.compile(keras.optimizers.SGD(0.05), loss="mse")
    new = recipes.apply_recipe(model, "transformer")
    assert new.compiled and new.optimizer is not model.optimizer
    assert isinstance(new.optimizer, keras.optimizers.LossScaleOptimizer)
    assert float(new.optimizer.inner_optimizer.learning_rate) == pytest.approx(0.05)


def test_unmatched_rule_is_logged_not_raised():
    keras_amp.enable("mixed_bfloat16")
    with warnings.catch_warnings(), mock.patch.object(recipes.logging, "warning") as log:
        warnings.simplefilter("error")
        new = recipes.apply_recipe(lstm_model(), "rnn", rules={"no_such_layer": "float32", "lstm": "float32"})
    assert layer_policies(new) == {**expected("rnn", "mixed_bfloat16"), "lstm": "float32"}
    (call,) = log.call_args_list  # the matching rule is not reported
    assert "rules matched no layer" in call.args[0] and call.args[-1] == ["no_such_layer"]


def output_head_model():
    inp = keras.Input((16,))
    x = amp_layers.OutputHead(16, activation="relu", name="inner_head")(inp)
    x = keras.layers.Dense(16, name="hidden")(x)
    return keras.Model(inp, amp_layers.OutputHead(8, name="head")(x))


@pytest.mark.parametrize("recipe", recipes.RECIPES)
def test_output_head_stays_float32_whatever_its_role_and_the_rules(recipe):
    keras_amp.enable("mixed_bfloat16")
    model = output_head_model()  # one OutputHead first (not in the last region), one last
    with mock.patch.object(recipes.logging, "warning") as log:
        plan = recipes.plan_recipe(model, recipe, rules={keras.layers.Dense: "mixed_bfloat16"})
    # OutputHead is a Dense: the rule matches it but is skipped there, and said so.
    assert plan.policies() == {"inner_head": "float32", "hidden": "mixed_bfloat16", "head": "float32"}
    assert {e.path: e.reason for e in plan.layers}["inner_head"] == "float32 island"
    skipped = sorted(c.args[2] for c in log.call_args_list if "skipped" in c.args[0])
    assert skipped == ["head", "inner_head"]
    # Before the fix the clone raised (OutputHead rejects a non-float32 dtype).
    new = recipes.apply_recipe(model, recipe, rules={keras.layers.Dense: "mixed_bfloat16", "head": "float16"})
    assert layer_policies(new) == plan.policies()
    assert isinstance(new.get_layer("head"), amp_layers.OutputHead)
    x = np.random.default_rng(0).standard_normal((2, 16)).astype("float32")
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(new(x))))


def test_recipe_model_is_tagged_and_not_flagged_as_built_before_enable():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((16,))
    model = keras.Model(inp, keras.layers.Dense(8, name="d2")(keras.layers.Dense(16, name="d1")(inp)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_amp.AmpWarning)
        new = recipes.apply_recipe(model, "cnn")
        # First and last layers float32 is the recipe, not a model built before enable().
        assert set(layer_policies(new).values()) == {"float32"}
        assert new._keras_amp_recipe == "cnn"
        assert keras_amp.policy.warn_if_built_before_enable(new, caller="test") is False


def bidirectional_model():
    return keras.Sequential(
        [
            keras.Input((6, 4)),
            keras.layers.Bidirectional(keras.layers.LSTM(8, return_sequences=True), name="bi"),
            keras.layers.TimeDistributed(keras.layers.Dense(2), name="per_step"),
        ]
    )


def test_rnn_recipe_reaches_inside_bidirectional_and_time_distributed():
    keras_amp.enable("mixed_bfloat16")
    model = bidirectional_model()
    new = recipes.apply_recipe(model, "rnn")
    bi, head = new.get_layer("bi"), new.get_layer("per_step")
    assert type(bi.forward_layer) is amp_layers.LSTM and type(bi.backward_layer) is amp_layers.LSTM
    assert bi.backward_layer.go_backwards
    assert {bi.forward_layer.dtype_policy.name, bi.backward_layer.dtype_policy.name} == {"mixed_bfloat16"}
    # Guard: without retargeting, the inner Dense would keep its own mixed policy and emit bfloat16.
    assert model.get_layer("per_step").layer.dtype_policy.name == "mixed_bfloat16"
    assert head.layer.dtype_policy.name == "float32" and new.outputs[0].dtype == "float32"
    for old, fresh in zip(model.weights, new.weights):
        np.testing.assert_array_equal(fresh.numpy(), old.numpy())


def test_recipe_model_round_trips_through_keras_file(tmp_path):
    keras_amp.enable("mixed_bfloat16")
    model = recipes.apply_recipe(transformer_encoder(), "transformer")
    path = tmp_path / "encoder.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert layer_policies(loaded) == expected("transformer", "mixed_bfloat16")
    assert type(loaded.get_layer("mha")) is amp_layers.MultiHeadAttention
    x = np.arange(16, dtype="int32").reshape(2, 8) % 32
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_float32_head_holds_where_the_stock_float16_head_overflows():
    keras_amp.enable("mixed_float16")
    inp = keras.Input((16,))
    hidden = keras.layers.Dense(16, name="hidden")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(hidden))
    model.get_layer("hidden").set_weights([np.eye(16, dtype="float32"), np.zeros(16, "float32")])
    model.get_layer("head").set_weights([np.full((16, 1), 1000.0, "float32"), np.zeros(1, "float32")])
    x = np.full((2, 16), 5.0, "float32")
    ref = x.astype(np.float64).sum(axis=1, keepdims=True) * 1000.0  # 80000 > float16 max 65504
    stock = np.asarray(model.predict(x, verbose=0), np.float64)
    assert np.all(np.isinf(stock))  # stock: the float16 head overflows
    fixed = np.asarray(recipes.apply_recipe(model, "transformer").predict(x, verbose=0), np.float64)
    np.testing.assert_allclose(fixed, ref, rtol=1e-6)  # hidden values 5.0 are exact in float16

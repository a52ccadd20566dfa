"""apply_recipe / plan_recipe: per-layer policies set in place on any model, weights, rules, errors, retrace."""

import logging
import re
import warnings

import keras
import numpy as np
import pytest

import keras_amp
from keras_amp import model_graph, recipe_roles, recipes
from tests.helpers import MyNorm, Scaler

MIXED = ["mixed_float16", "mixed_bfloat16"]
# This CPU has no fast float16; enable() says so. The numerics, not the speed, are under test here.
pytestmark = pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning")
RNN_ROLE = recipe_roles.RNN_ROLE


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
    x = x + y  # an operator node: apply_recipe used to fail here with a raw KeyError
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
        # Batch normalisation after the float32 stem stays float32 (its input is not rounded);
        # between 16-bit layers it keeps the compute dtype (float32 inside either way), bn_b
        # too, whose output goes through `x + y` to a 16-bit layer.
        "cnn": {
            "rescale": f32, "stem": f32, "stem_bn": f32, "stem_relu": compute, "conv_a": compute,
            "bn_a": compute, "relu_a": compute, "conv_b": compute, "bn_b": compute,
            "pool": compute, "logits": f32, "probs": f32,
        },
        # The head stays in the compute dtype: float32 logits and loss come from the loss; layer
        # normalisation between 16-bit layers too.
        "transformer": {
            "embed": compute, "mha": compute, "add_1": compute, "ln_1": compute, "ffn_1": compute,
            "ffn_2": compute, "add_2": compute, "ln_2": compute, "pool": compute, "head": compute,
        },
        # Recurrences float32 with 16-bit matmuls; the output layer as the transformer's head.
        "rnn": {"lstm": f"matmul16_from_{compute}", "gru": f"matmul16_from_{compute}", "per_step": compute},
    }[recipe]


BUILDERS = {"cnn": resnet_cnn, "transformer": transformer_encoder, "rnn": lstm_model}


def layer_policies(model):
    return {l.name: l.dtype_policy.name for l in model_graph.children(model)}


@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("recipe", ["cnn", "transformer", "rnn"])
def test_policies_are_exactly_the_recipes_and_set_in_place(recipe, policy):
    keras_amp.enable(policy)
    model = BUILDERS[recipe]()
    layers_before = list(model_graph.walk(model))
    plan = recipes.plan_recipe(model, recipe)
    top = {p: v for p, v in plan.policies().items() if "/" not in p}
    assert top == expected(recipe, policy)
    assert recipes.apply_recipe(model, recipe) is model  # the same model, changed in place
    assert layer_policies(model) == expected(recipe, policy)
    assert [(p, id(l)) for p, l in model_graph.walk(model)] == [(p, id(l)) for p, l in layers_before]
    # Sublayers follow their parent: attention projections and its own softmax sublayer (whose
    # output MultiHeadAttention's code uses as it is; the op rules compute it in float32) in the
    # compute dtype, RNN cells float32 inside their Matmul16DTypePolicy RNN.
    if recipe == "transformer":
        assert model.get_layer("mha")._query_dense.dtype_policy.name == policy
        assert plan.policies()["mha/softmax"] == policy
        assert {e.path: e.reason for e in plan.layers}["mha/softmax"] == (
            f"deny list: softmax; kept in {policy}, the policy of 'mha', whose own code may not take a float32 "
            "output; its softmax runs in float32 (op table: softmax)"
        )
    if recipe == "rnn":
        lstm = model.get_layer("lstm")
        assert isinstance(lstm.dtype_policy, keras_amp.Matmul16DTypePolicy)
        assert (lstm.compute_dtype, lstm.dtype_policy.matmul_dtype) == ("float32", policy[len("mixed_"):])
        assert lstm.cell.dtype_policy == lstm.dtype_policy  # as LSTM builds it (and reloads it)
        reasons = {e.path: e.reason for e in plan.layers}
        assert reasons["lstm"] == RNN_ROLE and reasons["lstm/lstm_cell"] == "as its parent 'lstm'"


@pytest.mark.parametrize("recipe", ["cnn", "transformer", "rnn"])
def test_weights_are_the_same_variables_with_the_same_values(recipe):
    keras_amp.enable("mixed_bfloat16")
    model = BUILDERS[recipe]()
    for w in model.weights:  # non-default values, so equality is not a coincidence of initialisers
        w.assign(np.random.default_rng(len(w.path)).normal(size=w.shape).astype(w.dtype))
    before = [(id(w), w.numpy()) for w in model.weights]
    recipes.apply_recipe(model, recipe)
    assert [id(w) for w in model.weights] == [i for i, _ in before]
    for w, (_, value) in zip(model.weights, before):
        assert w.dtype == "float32"
        np.testing.assert_array_equal(w.numpy(), value)


def _rebuilt_with(plan, make):
    """A model constructed afresh, each layer given `plan`'s policy as its dtype (sublayers follow)."""
    policy = plan.policy_map()
    fresh = make()  # layer names differ from the planned paths only by Keras's uniquifying suffixes
    for (_, layer), entry in zip(model_graph.walk(fresh), plan.layers):
        assert type(layer).__name__ == entry.layer_class
        layer.dtype_policy = policy[entry.path]
    return fresh


@pytest.mark.parametrize("recipe", ["cnn", "transformer", "rnn"])
def test_keras_computes_with_the_new_policies_on_a_model_built_before_enable(recipe):
    keras.utils.set_random_seed(0)
    model = BUILDERS[recipe]()  # built in float32, before enable()
    keras_amp.enable("mixed_float16")
    x = _data(recipe, n=4)[0]
    float32_out = np.asarray(model.predict(x, verbose=0), np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_amp.AmpWarning)
        plan = recipes.plan_recipe(model, recipe)
        recipes.apply_recipe(model, recipe)
    assert not model_graph.is_stale(model)
    ours = np.asarray(model.predict(x, verbose=0), np.float64)
    # Reference: a model constructed under enable() with the planned policies and the same weights.
    keras.utils.set_random_seed(0)
    reference = _rebuilt_with(plan, BUILDERS[recipe])
    reference.set_weights(model.get_weights())
    np.testing.assert_array_equal(ours, np.asarray(reference.predict(x, verbose=0), np.float64))
    # Guard: the 16-bit layers (and the rnn recipe's 16-bit matmuls) really compute in float16 now.
    assert np.abs(ours - float32_out).max() > 0


def test_next_fit_traces_anew():
    keras_amp.enable("mixed_bfloat16")
    model = transformer_encoder(dropout=0.0)
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    x, y = _data("transformer", n=8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.predict(x, verbose=0)
    assert model.train_function is not None and model.predict_function is not None
    optimizer = model.optimizer
    recipes.apply_recipe(model, "transformer", rules={".*": "float32"})
    assert (model.train_function, model.test_function, model.predict_function) == (None, None, None)
    assert model.optimizer is optimizer  # optimizer state carries on
    # predict retraced: it matches an eager float32 call (a stale bfloat16 trace would not).
    np.testing.assert_allclose(model.predict(x, verbose=0), model(x), rtol=1e-6, atol=1e-6)
    assert keras.backend.standardize_dtype(model(x).dtype) == "float32"
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history["loss"]
    assert np.isfinite(history[-1])


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


def test_sequential_and_nested_models():
    keras_amp.enable("mixed_bfloat16")
    inner_in = keras.Input((8,))
    inner = keras.Model(inner_in, keras.layers.Dense(8, name="inner_dense")(inner_in), name="block")
    inp = keras.Input((8,), name="features")
    out = keras.layers.Dense(3, name="out")(inner(keras.layers.Dense(8, name="first")(inp)))
    model = keras.Model(inp, out)
    plan = recipes.plan_recipe(model, "cnn")
    assert plan.policies() == {
        "first": "float32", "block": "mixed_bfloat16", "block/inner_dense": "mixed_bfloat16", "out": "float32",
    }
    x = np.ones((2, 8), "float32")
    before = model.predict(x, verbose=0)
    recipes.apply_recipe(model, "cnn")
    assert model.get_layer("block").get_layer("inner_dense").dtype_policy.name == "mixed_bfloat16"
    np.testing.assert_allclose(model.predict(x, verbose=0), before, rtol=0.05, atol=0.05)


class Blocks(keras.Model):
    """A subclassed Transformer-like model: no graph, no get_config."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(32, 16, name="embed")
        self.attention = keras.layers.MultiHeadAttention(2, 8, name="attention")
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.logits = keras.layers.Dense(32, name="logits")

    def call(self, tokens):
        h = self.embed(tokens)
        return self.logits(self.norm(h + self.attention(h, h)))


def test_subclassed_model_is_converted_in_place():
    keras_amp.enable("mixed_float16")
    model = Blocks(name="blocks")
    tokens = np.arange(16, dtype="int32").reshape(2, 8)
    model(tokens)
    assert not model_graph.is_graph(model)  # guard: no layer graph to clone or rebuild from
    recipes.apply_recipe(model, "transformer", rules={"logits": "float32"})
    # Called from the model's own code (`h + attention(...)`), layers keep their output dtype:
    # the norm's statistics are float32 by keras_amp's op rules; a rule still applies as asked.
    assert layer_policies(model) == {
        "embed": "mixed_float16", "attention": "mixed_float16", "norm": "mixed_float16", "logits": "float32",
    }
    reasons = {e.path: e.reason for e in recipes.plan_recipe(model, "transformer").layers}
    assert reasons["norm"].endswith("its statistics run in float32 (Keras computes them in float32)")
    assert keras.backend.standardize_dtype(model(tokens).dtype) == "float32"
    assert model_graph.is_stale(model) is False and model.dtype_policy.name == "mixed_float16"


class Tagger(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(32, 8, name="embed")
        self.lstm = keras.layers.LSTM(8, return_sequences=True, name="lstm")
        self.tags = keras.layers.Dense(3, name="tags")

    def call(self, tokens):
        h = self.embed(tokens)
        return self.tags(self.lstm(h) + h)  # raw code: a float32 LSTM output would meet bfloat16 h


def test_rnn_in_a_subclassed_model_keeps_its_output_dtype_and_its_cell_gets_the_role():
    keras_amp.enable("mixed_bfloat16")
    model = Tagger(name="tagger")
    tokens = np.arange(12, dtype="int32").reshape(2, 6)
    model(tokens)
    # Guard: a float32 LSTM output here breaks the model's own `+`.
    model.lstm.dtype_policy = "float32"
    with pytest.raises(Exception, match="bfloat16|float"):
        model(tokens)
    model.lstm.dtype_policy = "mixed_bfloat16"
    plan = recipes.plan_recipe(model, "rnn")
    reasons = {e.path: (e.policy, e.reason) for e in plan.layers}
    assert reasons["lstm"] == (
        "mixed_bfloat16",
        f"{RNN_ROLE}: its output kept in mixed_bfloat16 for 'tagger''s own code; its cell computes in float32",
    )
    assert reasons["lstm/lstm_cell"] == ("matmul16_from_mixed_bfloat16", recipe_roles.RNN_CELL_ROLE)
    recipes.apply_recipe(model, "rnn")
    out = model(tokens)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(keras.ops.cast(out, "float32"))))
    assert model.lstm.cell.compute_dtype == "float32"


class NoConfig(keras.layers.Layer):
    """A third-party layer whose get_config() does not give its constructor arguments."""

    def __init__(self, units, kernel_fn, **kwargs):
        super().__init__(**kwargs)
        self.kernel_fn = kernel_fn
        self.dense = keras.layers.Dense(units, name="inner")

    def call(self, x):
        return self.kernel_fn(self.dense(x))


def test_layer_whose_config_does_not_round_trip():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((4,))
    layer = NoConfig(4, lambda h: keras.ops.exp(-keras.ops.square(h)), name="rbf")
    model = keras.Model(inp, keras.layers.Dense(2, name="out")(layer(keras.layers.Dense(4, name="d")(inp))))
    with pytest.raises(NotImplementedError):  # guard: the round trip the old clone needed fails
        NoConfig.from_config(layer.get_config())
    recipes.apply_recipe(model, "transformer", rules={"rbf": "float32"})
    assert (layer.dtype_policy.name, layer.dense.dtype_policy.name) == ("float32", "float32")
    assert keras.backend.standardize_dtype(layer(np.ones((1, 4), "float32")).dtype) == "float32"


class FixedPolicy(keras.layers.Dense):
    """A layer that refuses a policy change (a read-only `dtype_policy`)."""

    @property
    def dtype_policy(self):
        return self._dtype_policy


def test_a_layer_that_refuses_the_policy_is_named_with_what_to_do():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((4,))
    model = keras.Model(inp, FixedPolicy(4, name="fixed", dtype="float32")(keras.layers.Softmax(name="probs")(inp)))
    with pytest.raises(ValueError, match=re.escape("layer 'fixed' (FixedPolicy) to 'mixed_bfloat16'")) as info:
        recipes.apply_recipe(model, "transformer")
    assert "rules={'fixed': 'float32'}" in str(info.value)
    assert not isinstance(info.value.__cause__, KeyError)
    # All or nothing: the softmax, set float32 before 'fixed' failed, is back to its policy.
    assert model.get_layer("probs").dtype_policy.name == "mixed_bfloat16"
    recipes.apply_recipe(model, "transformer", rules={"fixed": "float32"})  # the fix it names works


def test_policy_map_is_a_keras_dtype_policy_map():
    keras_amp.enable("mixed_bfloat16")
    plan = recipes.plan_recipe(transformer_encoder(), "transformer")
    pmap = plan.policy_map()
    assert isinstance(pmap, keras.dtype_policies.DTypePolicyMap)
    assert pmap["mha/softmax"].name == "mixed_bfloat16" and pmap["ffn_1"].name == "mixed_bfloat16"
    assert pmap["ln_1"].name == "mixed_bfloat16"  # between 16-bit layers: float32 inside anyway
    assert pmap.default_policy.name == "mixed_bfloat16"
    assert "mha/softmax" in str(plan) and "deny list: softmax" in str(plan)


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
    model = recipes.apply_recipe(deny_model(), "transformer")
    assert type(model.get_layer("softmax")) is keras.layers.Softmax  # no class swap
    assert model.get_layer("softmax").dtype_policy.name == "float32"


def test_deny_list_normalization_is_what_the_ops_compute_not_the_name():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((8,))
    x = MyNorm(name="my_norm")(keras.layers.Dense(8, name="d")(inp))
    out = keras.layers.Dense(8, name="out")(Scaler(name="scaler")(x))
    plan = recipes.plan_recipe(keras.Model(inp, out), "transformer")
    reasons = {e.path: (e.policy, e.reason) for e in plan.layers}
    assert reasons["my_norm"] == ("mixed_bfloat16", "transformer: compute dtype")
    assert reasons["scaler"] == ("float32", "deny list: normalization")


def test_rules_override_recipe_and_deny_list_later_rules_win():
    keras_amp.enable("mixed_float16")
    model = transformer_encoder()
    rules = {
        keras.layers.LayerNormalization: "mixed_float16",  # overrides the deny list
        r"ffn_.*": "float32",
        "ffn_2": keras.DTypePolicy("mixed_float16"),  # later rule wins
        "mha": "float32",
        r"head": "float32",  # a user can still pin the head
    }
    recipes.apply_recipe(model, "transformer", rules=rules)
    got = layer_policies(model)
    assert (got["ln_1"], got["ln_2"], got["ffn_1"], got["ffn_2"], got["mha"], got["head"]) == (
        "mixed_float16", "mixed_float16", "float32", "mixed_float16", "float32", "float32",
    )
    # A float32 layer's sublayers are float32 by default.
    assert model.get_layer("mha")._query_dense.dtype_policy.name == "float32"


def test_invalid_arguments_list_what_is_allowed_and_change_nothing():
    # The rows (error class, argument named) are in tests/test_bad_input.py; here: the messages
    # list what is allowed, and a refused call leaves the model as it was.
    model = lstm_model()
    with pytest.raises(ValueError, match=re.escape("Received: recipe='vit'. Allowed: 'cnn', 'rnn', 'transformer'")):
        recipes.apply_recipe(model, "vit")
    with pytest.raises(ValueError, match=re.escape("Received: rules['lstm']='int8'. Allowed: float32, mixed_bfloat16")):
        recipes.apply_recipe(model, "rnn", rules={"lstm": "int8"})
    with pytest.raises(ValueError, match=re.escape("Received: rules['lstm']='bfloat16'")):
        recipes.apply_recipe(model, "rnn", rules={"lstm": "bfloat16"})  # would need 16-bit variables
    with pytest.raises(ValueError, match=r"valid regex.*Received: rules key '\(lstm'"):
        recipes.apply_recipe(model, "rnn", rules={"(lstm": "float32"})
    with pytest.raises(TypeError, match="Received: rules key 3 of type int"):
        recipes.apply_recipe(model, "rnn", rules={3: "float32"})
    with pytest.raises(TypeError, match="Received: rules key <class 'int'>"):
        recipes.apply_recipe(model, "rnn", rules={int: "float32"})
    with pytest.raises(ValueError, match="must be built.*built=False"):
        recipes.apply_recipe(keras.Sequential([keras.layers.Dense(4)]), "cnn")
    assert layer_policies(model)["lstm"] == keras.config.dtype_policy().name  # nothing was changed


def test_unmatched_rule_is_logged_not_raised(caplog):
    keras_amp.enable("mixed_bfloat16")
    model = lstm_model()
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")
        recipes.apply_recipe(model, "rnn", rules={"no_such_layer": "float32", "gru": "mixed_bfloat16"})
    assert layer_policies(model) == {**expected("rnn", "mixed_bfloat16"), "gru": "mixed_bfloat16"}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["apply_recipe: rules matched no layer of 'rnn': ['no_such_layer']"]


class Island(model_graph.Float32Island, keras.layers.Dense):
    """A float32 island: keeps float32 whatever the recipe or the rules."""


def test_islands_and_non_float_layers_are_left_as_built(caplog):
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((16,))
    x = Island(16, activation="relu", name="inner_head", dtype="float32")(inp)
    x = keras.layers.Dense(16, name="hidden")(x)
    ids = keras.layers.Lambda(lambda t: keras.ops.cast(t, "int32"), dtype="int32", name="ids")(x)
    model = keras.Model(inp, [Island(8, name="head", dtype="float32")(x), ids])
    with caplog.at_level(logging.WARNING):
        plan = recipes.plan_recipe(model, "cnn", rules={keras.layers.Dense: "mixed_bfloat16"})
    assert plan.policies() == {"inner_head": "float32", "hidden": "mixed_bfloat16", "ids": "int32", "head": "float32"}
    reasons = {e.path: e.reason for e in plan.layers}
    assert reasons["inner_head"] == "float32 island: kept as built" and reasons["ids"] == "int32 layer: kept as built"
    skipped = sorted(r.args[1] for r in caplog.records if "skipped" in r.msg)
    assert skipped == ["head", "inner_head"]


def test_a_float32_sublayer_inside_a_16bit_layer_is_kept():
    class Attention(keras.layers.Layer):  # like keras-hub's: its softmax built float32 on purpose
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.proj = keras.layers.Dense(8, name="proj")
            self.scores = keras.layers.Dense(8, dtype="float32", name="scores")

        def call(self, x):
            return self.scores(self.proj(x))

    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((8,))
    model = keras.Model(inp, Attention(name="attn")(keras.layers.Dense(8, name="d")(inp)))
    plan = recipes.plan_recipe(model, "transformer")
    assert plan.policies() == {"d": "mixed_bfloat16", "attn": "mixed_bfloat16", "attn/proj": "mixed_bfloat16", "attn/scores": "float32"}
    assert {e.path: e.reason for e in plan.layers}["attn/scores"] == "kept: built float32 inside a bfloat16 parent"


def test_recipe_model_is_not_flagged_as_built_before_enable():
    inp = keras.Input((16,))
    model = keras.Model(inp, keras.layers.Dense(8, name="d2")(keras.layers.Dense(16, name="d1")(inp)))
    keras_amp.enable("mixed_bfloat16")
    assert model_graph.is_stale(model)  # guard: built before enable(), it is stale
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_amp.AmpWarning)
        recipes.apply_recipe(model, "cnn")
        # First and last layers float32 is the recipe, not a model built before enable().
        assert set(layer_policies(model).values()) == {"float32"}
        assert model_graph.warn_if_built_before_enable(model, caller="test") is False
    assert not [a for a in vars(model) if a.startswith("_keras_amp")]  # no marker attribute


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
    # Guard: built under the mixed policy, every inner layer computes in bfloat16.
    assert model.get_layer("bi").forward_layer.cell.compute_dtype == "bfloat16"
    recipes.apply_recipe(model, "rnn")
    bi, head = model.get_layer("bi"), model.get_layer("per_step")
    inner = [bi, bi.forward_layer, bi.backward_layer, bi.forward_layer.cell, bi.backward_layer.cell]
    assert [l.dtype_policy.name for l in inner] == ["matmul16_from_mixed_bfloat16"] * 5
    assert head.layer.dtype_policy.name == "mixed_bfloat16"  # the output layer: compute dtype
    x = np.random.default_rng(0).normal(size=(2, 6, 4)).astype("float32")
    assert keras.backend.standardize_dtype(bi(x).dtype) == "float32"
    assert keras.backend.standardize_dtype(model(x).dtype) == "bfloat16"


def test_rnn_recipe_model_round_trips_through_keras_file(tmp_path):
    # Keras's Operation.from_config turns a policy into its name: the recipe's policies must be
    # ones that load (Matmul16DTypePolicy on RNN layers, whose from_config keeps it; cells float32).
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((6, 4))
    h = keras.layers.RNN(keras.layers.LSTMCell(8), return_sequences=True, name="generic")(inp)
    h = keras.layers.Bidirectional(keras.layers.RNN(keras.layers.GRUCell(4), return_sequences=True), name="bi")(h)
    h = keras.layers.SimpleRNN(4, return_sequences=True, name="simple")(h)
    model = recipes.apply_recipe(keras.Model(inp, keras.layers.Dense(2, name="head")(h)), "rnn")
    model.save(tmp_path / "rnn.keras")
    loaded = keras.saving.load_model(tmp_path / "rnn.keras")
    policies = lambda m: {p: l.dtype_policy.name for p, l in model_graph.walk(m)}  # noqa: E731
    assert policies(loaded) == policies(model)
    assert policies(model)["generic"] == "matmul16_from_mixed_bfloat16"
    assert policies(model)["generic/lstm_cell"] == "float32"  # saved in its RNN's config
    assert policies(model)["simple/simple_rnn_cell"] == "matmul16_from_mixed_bfloat16"  # rebuilt by it
    x = _data("rnn", n=2)[0]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_a_rule_on_an_rnn_decides_its_cell_too():
    keras_amp.enable("mixed_bfloat16")
    plan = recipes.plan_recipe(lstm_model(), "rnn", rules={"lstm": "mixed_bfloat16", "gru": "float32"})
    policies = plan.policies()
    assert (policies["lstm"], policies["lstm/lstm_cell"]) == ("mixed_bfloat16", "mixed_bfloat16")
    assert (policies["gru"], policies["gru/gru_cell"]) == ("float32", "float32")


def test_recipe_model_round_trips_through_keras_file(tmp_path):
    keras_amp.enable("mixed_bfloat16")
    model = recipes.apply_recipe(resnet_cnn(), "cnn")
    path = tmp_path / "resnet.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert layer_policies(loaded) == expected("cnn", "mixed_bfloat16")
    x = _data("cnn", n=2)[0]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_float16_head_overflows_unless_a_rule_pins_it():
    keras_amp.enable("mixed_float16")
    inp = keras.Input((16,))
    hidden = keras.layers.Dense(16, name="hidden")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(hidden))
    model.get_layer("hidden").set_weights([np.eye(16, dtype="float32"), np.zeros(16, "float32")])
    model.get_layer("head").set_weights([np.full((16, 1), 1000.0, "float32"), np.zeros(1, "float32")])
    x = np.full((2, 16), 5.0, "float32")
    ref = x.astype(np.float64).sum(axis=1, keepdims=True) * 1000.0  # 80000 > float16 max 65504
    # The transformer recipe leaves the head in the compute dtype: as stock, it overflows here.
    recipes.apply_recipe(model, "transformer")
    assert np.all(np.isinf(np.asarray(model.predict(x, verbose=0), np.float64)))
    recipes.apply_recipe(model, "transformer", rules={"head": "float32"})
    fixed = np.asarray(model.predict(x, verbose=0), np.float64)
    np.testing.assert_allclose(fixed, ref, rtol=1e-6)  # hidden values 5.0 are exact in float16


def test_keras_amp_island_layers_are_left_as_built():
    from keras_amp import layers as amp_layers

    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((6, 4))
    h = amp_layers.LSTM(8, return_sequences=True, name="lstm")(inp)
    model = keras.Model(inp, amp_layers.OutputHead(2, name="head")(h))
    plan = recipes.plan_recipe(model, "rnn", rules={"head": "mixed_bfloat16"})
    assert {e.path: (e.policy, e.reason) for e in plan.layers} == {
        "lstm": ("mixed_bfloat16", "float32 island: kept as built"),
        "head": ("float32", "float32 island: kept as built"),
    }


@pytest.mark.parametrize("adapted", [False, True], ids=["given_mean", "adapted"])
def test_build_time_constants_follow_the_new_policy(adapted):
    # keras.layers.Normalization casts its mean and variance to the compute dtype when built
    # (EfficientNetV2's and MobileNetV3's input layers): a policy change must recompute them.
    keras_amp.enable("mixed_bfloat16")
    mean, variance = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225]) ** 2
    x = np.random.default_rng(0).uniform(0, 1, (2, 4, 4, 3)).astype("float32")
    if adapted:
        norm = keras.layers.Normalization(name="norm")
        norm.adapt(x)
        mean, variance = norm.adapt_mean.numpy().astype(np.float64), norm.adapt_variance.numpy().astype(np.float64)
    else:
        norm = keras.layers.Normalization(mean=mean, variance=variance, name="norm")
    inp = keras.Input((4, 4, 3))
    model = keras.Model(inp, keras.layers.Conv2D(2, 1, name="conv")(norm(inp)))
    assert keras.backend.standardize_dtype(norm.mean.dtype) == "bfloat16"  # guard: cached in bfloat16
    recipes.apply_recipe(model, "cnn")  # first layers float32: the normalisation among them
    assert norm.dtype_policy.name == "float32"
    ref = (x.astype(np.float64) - mean) / np.sqrt(variance)
    np.testing.assert_allclose(np.asarray(norm(x), np.float64), ref, rtol=1e-5, atol=1e-5)


def test_stock_in_place_setter_keeps_the_16bit_constants_built_before():
    # Stock Keras's way to a per-layer policy on a built model is its setter, which leaves what
    # build() cast to the old compute dtype as it was: the outputs stay bfloat16-rounded (apply_recipe
    # recomputes them: test_build_time_constants_follow_the_new_policy). Otherwise: rebuild the model.
    keras_amp.enable("mixed_bfloat16")
    mean, variance = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225]) ** 2
    norm = keras.layers.Normalization(mean=mean, variance=variance, name="norm")
    inp = keras.Input((4, 4, 3))
    keras.Model(inp, keras.layers.Conv2D(2, 1, name="conv")(norm(inp)))
    norm.dtype_policy = "float32"  # stock
    x = np.random.default_rng(0).uniform(0, 1, (2, 4, 4, 3)).astype("float32")
    ref = (x.astype(np.float64) - mean) / np.sqrt(variance)
    assert norm.compute_dtype == "float32"  # guard: the policy did change
    assert np.abs(np.asarray(norm(x), np.float64) - ref).max() > 1e-3  # the bfloat16 mean (0.484375) is kept


def test_a_float32_layer_the_plan_lowers_is_said_in_a_mixed_model_only(caplog):
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(4, name="head", dtype="float32")(keras.layers.Dense(8, name="d")(inp)))
    with caplog.at_level("WARNING"):
        keras_amp.apply_recipe(model, "transformer")
    said = [r.getMessage() for r in caplog.records if "apply_recipe on" in r.getMessage()]
    assert len(said) == 1 and "'head' computed in float32" in said[0] and "rules={'head': 'float32'}" in said[0], said
    assert model.get_layer("head").compute_dtype == "bfloat16"  # the plan is applied as planned
    caplog.clear()
    with caplog.at_level("WARNING"):
        keras_amp.apply_recipe(model, "transformer", rules={"head": "float32"})  # as the warning says
        # A model built wholly in float32 is what a recipe converts: nothing to say.
        keras.config.set_dtype_policy("float32")
        built32 = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="only")])
        keras_amp.apply_recipe(built32, "transformer")
    assert model.get_layer("head").compute_dtype == "float32" and built32.get_layer("only").compute_dtype == "bfloat16"
    assert not [r for r in caplog.records if "apply_recipe on" in r.getMessage()]


def test_plan_columns_are_as_wide_as_the_longest_path():
    keras_amp.enable("mixed_bfloat16")
    inp = keras.Input((8,))
    long = "multi_head_attention_with_a_long_name_attention_output_dense"  # keras-hub paths run this long
    model = keras.Model(inp, keras.layers.Dense(4, name="head")(keras.layers.Dense(8, name=long)(inp)))
    rows = str(keras_amp.plan_recipe(model, "transformer")).splitlines()[1:]
    assert any(long in row for row in rows)
    assert len({row.index("Dense") for row in rows}) == 1, rows  # the class column starts at one place

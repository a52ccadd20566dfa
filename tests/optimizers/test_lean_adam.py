"""keras_amp.optimizers.LeanAdam: 16-bit weights with compensated updates and 16-bit moments."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_amp
from keras_amp import memory
from keras_amp.optimizers import LeanAdam, LeanAdamW

X = np.random.RandomState(0).randn(64, 16).astype("float32")
Y = np.random.RandomState(1).randn(64, 4).astype("float32")


def _model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.LayerNormalization(), keras.layers.Dense(4)])


def _grads(model, seed):
    r = np.random.RandomState(seed)
    return [tf.constant(r.randn(*v.shape).astype("float32") * 10.0 ** r.uniform(-6, 0)) for v in model.trainable_variables]


@pytest.mark.parametrize("weight_decay", [None, 0.01])
@pytest.mark.parametrize("jit", [False, True])
def test_split_update_is_keras_adams_update_on_a_float32_master(weight_decay, jit):
    """Bit for bit as TensorFlow ops; within 16 float32 ulps as one XLA kernel (which contracts
    multiply-adds into FMAs)."""
    keras_amp.enable("mixed_bfloat16")
    ref, lean = _model(), _model()
    adam = keras.optimizers.Adam(1e-3, weight_decay=weight_decay)
    opt = LeanAdam(1e-3, weight_decay=weight_decay, moments="float32", jit_update=jit)
    memory.prepare(lean, opt)
    opt.build(lean.trainable_variables)
    adam.build(ref.trainable_variables)
    for step in range(6):
        grads = _grads(ref, step)
        adam.apply(grads, ref.trainable_variables)
        opt.apply(grads, lean.trainable_variables)
    masters = opt.master_weights()
    for r, v in zip(ref.trainable_variables, lean.trainable_variables):
        got = masters[id(v)].numpy() if id(v) in masters else v.numpy()
        if jit and id(v) in masters:
            ulps = np.abs(got.view(np.int32).astype(np.int64) - r.numpy().view(np.int32).astype(np.int64))
            assert ulps.max() <= 16, (v.path, ulps.max())
        else:
            np.testing.assert_array_equal(got.view(np.uint32), r.numpy().view(np.uint32), err_msg=v.path)


def test_weights_of_16bit_layers_are_stored_in_16bit_and_islands_stay_float32():
    keras_amp.enable("mixed_bfloat16")
    model = _model()
    opt = LeanAdam(1e-3)
    done = memory.prepare(model, opt)
    stored = {v.path.split("/", 1)[1]: memory.storage_dtype(v) for v in model.trainable_variables}
    assert stored == {"dense/kernel": "bfloat16", "dense/bias": "bfloat16", "layer_normalization/gamma": "float32",
                      "layer_normalization/beta": "float32", "dense_1/kernel": "bfloat16", "dense_1/bias": "bfloat16"}
    assert len(done.lean) == 4


def test_state_is_8_bytes_per_lean_parameter_6_with_stochastic_rounding_against_12_for_stock():
    keras_amp.enable("mixed_bfloat16")
    sizes = {}
    for name, opt in (("stock", keras.optimizers.Adam()), ("split", LeanAdam()),
                      ("stochastic", LeanAdam(compensation="stochastic"))):
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, use_bias=False)])
        model.compile(opt, "mse")
        model.fit(X[:, :1].repeat(64, 1), X[:, :1].repeat(64, 1), epochs=1, verbose=0)
        b = memory.state_bytes(model)
        sizes[name] = (b["trainable"] + b["optimizer"] - 12) / 64 ** 2  # less iteration (int64) and learning rate
    assert sizes == {"stock": 12.0, "split": 8.0, "stochastic": 6.0}


def test_small_updates_survive_with_compensation_and_vanish_without():
    """Stock pure bfloat16 Adam does not move the weights at all (1 - 0.999**t rounds to 0 in
    bfloat16); plain 16-bit rounding loses most updates; the lean tier keeps them."""
    moved = {}
    for name in ("stock_bfloat16", "none", "split", "kahan", "stochastic"):
        if name == "stock_bfloat16":
            keras.config.set_dtype_policy("bfloat16")
            model, opt = _model(), keras.optimizers.Adam(1e-4)
            opt.build(model.trainable_variables)
        else:
            keras_amp.enable("mixed_bfloat16")
            model, opt = _model(), LeanAdam(1e-4, compensation=name)
            memory.prepare(model, opt)
            opt.build(model.trainable_variables)
        kernel = model.layers[0].kernel
        before = kernel.numpy().astype(np.float64)
        for step in range(20):
            opt.apply(_grads(model, step), model.trainable_variables)
        if name == "stock_bfloat16":
            after = kernel.numpy().astype(np.float64)
        else:
            after = opt.master_weights()[id(kernel)].numpy().astype(np.float64)
        moved[name] = np.mean(np.abs(after - before))
        keras_amp.disable()
        keras.config.set_dtype_policy("float32")
    assert moved["stock_bfloat16"] == 0.0
    # Adam moves each weight by up to lr per step (20 steps of 1e-4; random gradients walk).
    for name in ("split", "kahan", "stochastic"):
        assert moved[name] > 2e-4, (name, moved)
    assert moved["none"] < 0.2 * moved["split"], moved


def test_fit_close_to_float32_masters_and_pure_bfloat16_is_shown_worse():
    losses = {}
    for name in ("float32_master", "lean", "pure_bf16"):
        keras_amp.enable("mixed_bfloat16")
        model = _model()
        opt = {"float32_master": keras.optimizers.Adam(3e-4), "lean": LeanAdam(3e-4),
               "pure_bf16": LeanAdam(3e-4, compensation="none")}[name]
        model.compile(opt, "mse")
        model.fit(X, Y, batch_size=8, epochs=6, verbose=0, shuffle=False)
        losses[name] = float(model.evaluate(X, Y, verbose=0))
        keras_amp.disable()
    assert losses["lean"] == pytest.approx(losses["float32_master"], rel=0.01), losses
    assert losses["pure_bf16"] > losses["lean"] * 1.01, losses


def test_under_loss_scale_optimizer_float16_uses_kahan_and_trains():
    keras_amp.enable("mixed_float16")
    model = _model()
    opt = keras_amp.LossScaleOptimizer(LeanAdam(1e-3))
    model.compile(opt, "mse")
    history = model.fit(X, Y, batch_size=16, epochs=4, verbose=0)
    assert memory.storage_dtype(model.layers[0].kernel) == "float16"
    assert opt.inner_optimizer._kinds[0] == ("kahan", "float16")
    loss = history.history["loss"]
    assert np.all(np.isfinite(loss)) and loss[-1] < loss[0]


def test_float32_checkpoint_loads_into_a_float32_model_and_16bit_storage_returns_exactly(tmp_path):
    keras_amp.enable("mixed_bfloat16")
    model = _model()
    model.compile(LeanAdam(1e-3), "mse")
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    masters = {id(v): m.numpy() for v, m in ((v, model.optimizer.master_weights().get(id(v)))
                                             for v in model.trainable_variables) if m is not None}
    memory.save_float32_weights(model, str(tmp_path / "f32.weights.h5"))
    assert {memory.storage_dtype(v) for v in model.layers[0].weights} == {"bfloat16"}
    after = model.optimizer.master_weights()
    for key, value in masters.items():
        np.testing.assert_array_equal(after[key].numpy(), value)
    keras_amp.disable()
    plain = _model()
    plain.load_weights(str(tmp_path / "f32.weights.h5"))
    for v, p in zip(model.trainable_variables, plain.trainable_variables):
        assert p.dtype == "float32"
        if id(v) in masters:
            np.testing.assert_array_equal(p.numpy(), masters[id(v)])
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)  # the lean model trains on after it


def test_keras_file_round_trip_restores_the_master_and_moments(tmp_path):
    keras_amp.enable("mixed_bfloat16")
    model = _model()
    model.compile(LeanAdam(1e-3), "mse")
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    masters = [m.numpy() for m in model.optimizer.master_weights().values()]
    slots = [v.numpy() for v in model.optimizer.variables]
    model.save(str(tmp_path / "lean.keras"))
    loaded = keras.models.load_model(str(tmp_path / "lean.keras"))
    assert isinstance(loaded.optimizer, LeanAdam) and loaded.optimizer.compensation is None
    memory.prepare(loaded)
    loaded.optimizer.build(loaded.trainable_variables)
    for got, want in zip(loaded.optimizer.master_weights().values(), masters):
        np.testing.assert_array_equal(got.numpy(), want)
    for got, want in zip(loaded.optimizer.variables, slots):
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_fit_resumed_from_a_keras_file_continues_the_uninterrupted_run(tmp_path, policy):
    """fit builds a loaded LeanAdam inside its first traced step: the state saved in the file is
    what the resumed run starts from (it restarted from zero moments and step 0 before)."""
    keras_amp.enable(policy)
    model = _model()
    opt = LeanAdam(1e-3)
    model.compile(keras_amp.LossScaleOptimizer(opt) if policy == "mixed_float16" else opt, "mse")
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    model.save(str(tmp_path / "lean.keras"))
    loaded = keras.models.load_model(str(tmp_path / "lean.keras"))
    resumed = loaded.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
    uninterrupted = model.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
    assert resumed == uninterrupted
    inner = getattr(loaded.optimizer, "inner_optimizer", loaded.optimizer)
    assert int(inner.iterations.numpy()) == 12
    for a, b in zip(model.weights + model.optimizer.variables, loaded.weights + loaded.optimizer.variables):
        np.testing.assert_array_equal(np.atleast_1d(a.numpy()).view(np.uint8), np.atleast_1d(b.numpy()).view(np.uint8))


def test_a_loaded_lean_state_without_prepare_is_refused_not_dropped(tmp_path):
    keras_amp.enable("mixed_bfloat16")
    model = _model()
    model.compile(LeanAdam(1e-3), "mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    model.save(str(tmp_path / "lean.keras"))
    keras_amp.disable()  # no prepare in fit: a float32 build would drop the saved moments and low bits
    loaded = keras.models.load_model(str(tmp_path / "lean.keras"))
    with pytest.raises(ValueError, match=r"loaded from a file for weights stored in 16 bits.*prepare"):
        loaded.fit(X, Y, batch_size=16, epochs=1, verbose=0)


def test_bad_arguments_and_misuse_get_clear_errors():
    with pytest.raises(ValueError, match="compensation"):
        LeanAdam(compensation="exact")
    with pytest.raises(ValueError, match="moments"):
        LeanAdam(moments="float16")
    with pytest.raises(ValueError, match="amsgrad"):
        LeanAdam(amsgrad=True)
    keras_amp.enable("mixed_float16")
    model = _model()
    with pytest.raises(ValueError, match="needs bfloat16") as info:
        memory.prepare(model, LeanAdam(compensation="split"))
    assert f"weight {model.trainable_variables[0].path!r} is read in float16" in str(info.value)  # names it
    keras_amp.enable("mixed_bfloat16")
    model, opt = _model(), LeanAdam()
    memory.prepare(model, opt)
    opt.build(model.trainable_variables)
    with pytest.raises(ValueError, match="already built"):
        opt.adopt_lean([(model.layers[0].kernel, "bfloat16")])
    with pytest.raises(ValueError, match="weight_decay=None"):  # as keras.optimizers.AdamW
        LeanAdamW(weight_decay=None)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_unprepared_weights_train_as_keras_adam_with_a_warning(traced):
    # No weight stored in 16 bits (prepare not run): Adam's contract, Keras's numbers bit for bit, and a
    # warning that nothing is saved. Built only by the first apply: Keras builds optimizers before prepare.
    ref, plain = _model(), _model()
    adam, opt = keras.optimizers.Adam(1e-3, weight_decay=0.01), LeanAdam(1e-3, weight_decay=0.01)
    opt.build(plain.trainable_variables)
    assert not opt.built  # waits: prepare may still store weights in 16 bits
    apply_ref = lambda grads: adam.apply(grads, ref.trainable_variables)  # noqa: E731
    apply_opt = lambda grads: opt.apply(grads, plain.trainable_variables)  # noqa: E731
    if traced:
        apply_ref, apply_opt = tf.function(apply_ref), tf.function(apply_opt)
    for step in range(4):
        grads = _grads(ref, step)
        apply_ref(grads)
        if step:
            apply_opt(grads)
            continue
        with pytest.warns(keras_amp.AmpWarning, match=r"none stored in 16 bits.*keras_amp.memory.prepare"):
            apply_opt(grads)
    assert opt.built and opt.master_weights() == {} and int(opt.iterations.numpy()) == 4
    for r, v in zip(ref.trainable_variables, plain.trainable_variables):
        assert v.dtype == "float32"
        np.testing.assert_array_equal(v.numpy().view(np.uint32), r.numpy().view(np.uint32), err_msg=v.path)


def test_adamw_default_decay_and_config_round_trip():
    opt = LeanAdamW(compensation="kahan")
    assert opt.weight_decay == 0.004
    again = LeanAdamW.from_config(opt.get_config())
    assert (again.compensation, again.moments, again.weight_decay, again.jit_update) == ("kahan", "bfloat16", 0.004, True)
    assert LeanAdamW.from_config({**opt.get_config(), "jit_update": False}).jit_update is False


def test_large_weights_update_in_chunks_with_the_same_result(monkeypatch):
    """As TensorFlow ops, a large weight's update runs a slice of rows at a time, bit for bit."""
    from keras_amp.optimizers import lean_adam as lean  # noqa: PLC0415

    keras_amp.enable("mixed_bfloat16")
    results = []
    for chunk in (1 << 20, 64):  # whole, then 64 elements (4 rows of 16) at a time
        monkeypatch.setattr(lean, "CHUNK_ELEMENTS", chunk)
        model, opt = _model(), LeanAdam(1e-3, moments="float32", jit_update=False)
        memory.prepare(model, opt)
        opt.build(model.trainable_variables)

        @tf.function
        def step(grads):
            opt.apply(grads, model.trainable_variables)

        for i in range(3):
            step(_grads(model, i))
        results.append([m.numpy() for m in opt.master_weights().values()])
    for whole, chunked in zip(*results):
        np.testing.assert_array_equal(whole, chunked)


@pytest.mark.parametrize("policy,compensation,moments,weight_decay", [
    ("mixed_bfloat16", "split", "float32", 0.01),  # first, second, put; float32 moments
    ("mixed_bfloat16", "stochastic", "bfloat16", None),  # single (as "none"); bfloat16 moments
    ("mixed_float16", "kahan", "bfloat16", 0.01)])
def test_large_weights_are_updated_in_place_with_the_single_kernels_result(
        monkeypatch, policy, compensation, moments, weight_decay):
    """Under XLA a large weight's update is `adam16.in_place`'s calls writing into the variables'
    buffers; its state is the one the single compiled kernel returns, bit for bit."""
    from keras_amp.optimizers import lean_adam as lean  # noqa: PLC0415

    keras_amp.enable(policy)
    states = []
    for chunk in (1 << 20, 100):  # the single kernel, then in place (the kernels, 16x32 and 32x4, are large)
        monkeypatch.setattr(lean, "CHUNK_ELEMENTS", chunk)
        model, opt = _model(), LeanAdam(1e-3, compensation=compensation, moments=moments, weight_decay=weight_decay)
        memory.prepare(model, opt)
        before = [np.asarray(v.numpy()).view(np.uint8) for v in model.trainable_variables]
        opt.build(model.trainable_variables)
        step = tf.function(lambda grads: opt.apply(grads, model.trainable_variables))
        for i in range(4):
            step([g * 50.0 for g in _grads(model, i)])  # large enough to move 16-bit weights
        states.append([np.atleast_1d(v.numpy()).view(np.uint8) for v in model.trainable_variables + opt.variables])
        assert not np.array_equal(states[-1][0], before[0]), "the first kernel did not move"
        if chunk == 100:
            graph = step.get_concrete_function([tf.constant(g) for g in _grads(model, 0)]).graph
            calls = [op.get_attr("f").name for op in graph.get_operations()
                     if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
            in_place = [c for c in calls if any(k in c for k in ("first", "second", "single", "both_moments"))]
            assert len(in_place) == 2 * (3 if compensation in ("split", "kahan") else 2), calls
    for whole, in_place in zip(*states):
        np.testing.assert_array_equal(whole, in_place)


def test_large_weights_update_one_after_another_in_place(monkeypatch):
    """Each large weight's calls wait for the previous large weight's last call, so that two large
    updates (each holding a new compensation half) never run at once."""
    from keras_amp.optimizers import lean_adam as lean  # noqa: PLC0415

    keras_amp.enable("mixed_bfloat16")
    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", 100)  # the kernels (16x32, 32x4) are large, the biases not
    model, opt = _model(), LeanAdam(1e-3)
    memory.prepare(model, opt)
    opt.build(model.trainable_variables)
    grads = _grads(model, 0)
    graph = tf.function(lambda: opt.apply(grads, model.trainable_variables)).get_concrete_function().graph
    calls = [op for op in graph.get_operations() if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    firsts = [op for op in calls if "first" in op.get_attr("f").name]
    moments = [op for op in calls if "both_moments" in op.get_attr("f").name]
    assert len(firsts) == len(moments) == 2
    assert not firsts[0].control_inputs
    assert moments[0] in firsts[1].control_inputs
    # Eagerly the calls run in order and update the weight; nothing is kept from one step to the next.
    kept = list(opt._large_updates[1])
    before = model.trainable_variables[0].numpy().view(np.uint16)
    for _ in range(2):
        opt.apply([g * 50.0 for g in grads], model.trainable_variables)
    assert not np.array_equal(model.trainable_variables[0].numpy().view(np.uint16), before)
    assert opt._large_updates[1] == kept

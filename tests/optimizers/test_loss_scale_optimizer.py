"""keras_amp.optimizers.LossScaleOptimizer: update rule, counters, bounds, config, saving, fit."""

import inspect
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.callbacks import LossScaleMonitor
from keras_amp.optimizers import LossScaleOptimizer, MinScaleError
from keras_amp.policy import AmpWarning
from tests.helpers import built_optimizer as _setup, step_runner as _runner

INF = float("inf")


def _loop(opt, v, grad, n):
    """`n` steps with gradient `grad` inside one tf.function (a while loop: fast)."""

    @tf.function
    def run():
        for _ in tf.range(n):
            opt.apply([tf.fill([4], tf.constant(grad, tf.float32))], [v])

    run()


def test_200_overflows_floor_at_min_scale_stock_reaches_zero():
    v, ours = _setup(initial_scale=2.0**15, min_scale=1.0)
    _loop(ours, v, INF, 200)
    assert ours.scale == 1.0  # exact: halvings of a power of two, floored (so > 0)
    assert int(ours.overflow_count.numpy()) == 200
    assert int(ours.consecutive_overflows.numpy()) == 200
    sv, stock = _setup(keras.optimizers.LossScaleOptimizer, initial_scale=2.0**15)
    _loop(stock, sv, INF, 200)
    assert float(stock.dynamic_scale.numpy()) == 0.0  # stock defect: no floor


def test_10000_growth_steps_cap_at_max_scale_stock_reaches_inf():
    v, ours = _setup(dynamic_growth_steps=1, max_scale=2.0**24)
    _loop(ours, v, 0.0, 10_000)
    assert ours.scale == 2.0**24 and np.isfinite(ours.scale)
    assert int(ours.iterations.numpy()) == 10_000 and int(ours.overflow_count.numpy()) == 0
    sv, stock = _setup(keras.optimizers.LossScaleOptimizer, dynamic_growth_steps=1)
    _loop(stock, sv, 0.0, 200)
    assert np.isinf(float(stock.dynamic_scale.numpy()))  # stock defect: no ceiling
    # Once at inf every step overflows (inf * 0 = nan would be the loss) and is skipped.


def test_growth_stops_at_float32_max_never_inf():
    f32_max = float(np.finfo(np.float32).max)
    v, opt = _setup(initial_scale=2.0**100, max_scale=f32_max, dynamic_growth_steps=1)
    _loop(opt, v, 0.0, 40)
    # 2**127 * 2 is inf in float32; the ceiling (the largest float32) caps it.
    assert opt.scale == f32_max and np.isfinite(opt.scale)
    with pytest.raises(ValueError, match=r"`max_scale` must fit in float32.*Received: max_scale=1e\+300"):
        LossScaleOptimizer(keras.optimizers.SGD(), max_scale=1e300)


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
def test_update_rule_counters_and_skipped_weights_bit_identical(mode):
    inner = keras.optimizers.Adam(0.01)
    v, opt = _setup(inner=inner, initial_scale=8.0, dynamic_growth_steps=2, max_scale=16.0,
                    min_scale=2.0)
    step = _runner(opt, v, mode)
    expected_scales = []
    for g in [1.0, 1.0, 1.0, 1.0, INF, float("nan"), INF, 1.0]:
        before = [x.numpy().copy() for x in [v] + inner.variables]
        step(g)
        after = [x.numpy() for x in [v] + inner.variables]
        if not np.isfinite(g):
            # Skipped: weights and every inner variable (iterations, moments) bit for bit.
            assert all(np.array_equal(a, b) for a, b in zip(after, before))
        else:
            assert not np.array_equal(after[0], before[0])
        expected_scales.append(opt.scale)
    # grow at steps 2 and 4 (capped at 16), back off 3 times (floored at 2), then 1 finite step.
    assert expected_scales == [8.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0]
    assert int(opt.overflow_count.numpy()) == 3
    assert int(opt.consecutive_overflows.numpy()) == 0
    assert int(opt.iterations.numpy()) == 5  # applied steps (the inner optimizer's count)
    assert int(opt.total_steps.numpy()) == 8
    assert int(opt.step_counter.numpy()) == 1


def test_hysteresis_first_overflow_of_a_run_only_skips():
    v, opt = _setup(initial_scale=64.0, hysteresis=2)
    step = _runner(opt, v, "tf_function")
    scales, consecutive = [], []
    for g in [INF, INF, INF, 1.0, INF, 1.0, INF, INF]:
        step(g)
        scales.append(opt.scale)
        consecutive.append(int(opt.consecutive_overflows.numpy()))
    assert scales == [64.0, 32.0, 16.0, 16.0, 16.0, 16.0, 16.0, 8.0]
    assert consecutive == [1, 2, 3, 0, 1, 0, 1, 2]
    assert int(opt.overflow_count.numpy()) == 6


def test_static_scaling_keeps_scale_and_skips_stock_refuses():
    v, opt = _setup(initial_scale=128.0, dynamic=False, dynamic_growth_steps=1)
    step = _runner(opt, v, "tf_function")
    w0 = v.numpy().copy()
    for g in [1.0, 1.0, INF, 1.0]:
        before = v.numpy().copy()
        step(g)
        if not np.isfinite(g):
            np.testing.assert_array_equal(v.numpy(), before)
    assert opt.scale == 128.0
    assert int(opt.overflow_count.numpy()) == 1
    # The applied gradient is the scaled one: 1 / 128 per finite step, SGD lr 0.1, 3 steps.
    np.testing.assert_allclose(v.numpy(), w0 - 0.3 / 128.0, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="dynamic=False"):
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False)


def test_unscaled_gradient_matches_float64_reference():
    v, opt = _setup(initial_scale=1024.0)
    w0 = v.numpy().astype("float64")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(v.value))
        scaled = opt.scale_loss(loss)
    opt.apply(tape.gradient(scaled, [v.value]), [v])
    np.testing.assert_allclose(v.numpy(), w0 - 0.1 * 2.0 * w0, rtol=1e-6, atol=0)


def test_host_callback_only_when_the_scale_changes():
    v, opt = _setup(initial_scale=8.0, dynamic_growth_steps=1, max_scale=16.0)
    calls = []
    opt._host_event = lambda *args: calls.append(float(args[3].numpy()))  # the new scale
    _loop(opt, v, 1.0, 20)  # grows 8 -> 16 on the first step, then sits at max_scale
    assert opt.scale == 16.0 and int(opt.total_steps.numpy()) == 20
    assert calls == [16.0]  # one host round trip for the one change, none for the 19 capped steps


def test_static_scale_is_not_bounded_by_the_tier():
    v, opt = _setup(initial_scale=2.0**25, dynamic=False)  # above tier None's max_scale 2**24
    _loop(opt, v, 1.0, 3)
    _loop(opt, v, INF, 1)
    assert opt.scale == 2.0**25 and int(opt.overflow_count.numpy()) == 1


def test_stock_saved_zero_scale_is_clamped_on_load(tmp_path):
    v = keras.Variable(np.ones(4, "float32"))
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    stock.build([v])
    stock.dynamic_scale.assign(0.0)  # what 1,100 halvings leave in stock Keras
    store = {}
    stock.save_own_variables(store)
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    ours.build([v])
    ours.load_own_variables(store)
    assert ours.scale == ours.min_scale == 1.0  # tier None floor, not 0.0
    ours.apply([tf.fill([4], 0.5)], [v])
    assert np.all(np.isfinite(v.numpy())) and np.allclose(v.numpy(), 1.0 - 0.1 * 0.5 / 1.0, atol=1e-7)


# ------------------------------------------------------------------- validation
def test_validation_inner_optimizer():
    with pytest.raises(TypeError, match="inner_optimizer"):
        LossScaleOptimizer("sgd")
    with pytest.raises(ValueError, match="scaled twice"):
        LossScaleOptimizer(LossScaleOptimizer(keras.optimizers.SGD()))


# ------------------------------------------------------------------- tiers and config
def test_scale_before_build_is_the_initial_scale():
    for opt, expected in ((LossScaleOptimizer(keras.optimizers.SGD()), 2.0**15),
                          (LossScaleOptimizer(keras.optimizers.SGD(), tier="medium"), 2.0**12),
                          (LossScaleOptimizer(keras.optimizers.SGD(), tier="auto", initial_scale=2048.0), 2048.0)):
        assert not opt.built and type(opt.scale) is float and opt.scale == expected
        assert opt.initial_scale_for([keras.Variable(np.zeros((3,), "float32"))]) == expected


def test_auto_tier_resolves_at_build_and_config_records_choice():
    opt = LossScaleOptimizer(keras.optimizers.SGD(), tier="auto")
    assert opt.get_config()["tier"] == "auto" and opt.get_config()["initial_scale"] is None
    # Before build the scale is not known yet: an error saying how to get it, never None.
    with pytest.raises(ValueError, match=r"small 1024, medium 4096, large 65536.*initial_scale_for"
                                         r".*Received: tier='auto', built=False"):
        opt.scale
    variables = [keras.Variable(np.zeros((10, 10), "float32"))]
    assert opt.initial_scale_for(variables) == 2.0**10  # 100 parameters: "small"
    # 2e8 parameters (shapes only: the count reads nothing else): "medium".
    assert opt.initial_scale_for([types.SimpleNamespace(shape=(20_000, 10_000))]) == 2.0**12
    opt.build(variables)
    assert opt.scale == opt.initial_scale_for(variables) == 2.0**10
    config = opt.get_config()
    assert (config["tier"], config["initial_scale"], config["dynamic_growth_steps"]) == (
        "small", 2.0**10, 100)
    assert float(opt.scale_loss(tf.constant(1.0))) == 2.0**10


def test_get_config_is_constructor_arguments_and_round_trips():
    opt = LossScaleOptimizer(keras.optimizers.Adam(3e-4), tier="large", hysteresis=2,
                             on_min_scale="raise", dynamic=True, name="lso")
    config = opt.get_config()
    params = set(inspect.signature(LossScaleOptimizer.__init__).parameters) - {"self", "kwargs"}
    assert set(config) == params
    own = {k: v for k, v in config.items() if k != "inner_optimizer"}
    clone = LossScaleOptimizer.from_config(config)
    assert {k: v for k, v in clone.get_config().items() if k != "inner_optimizer"} == own
    assert type(clone.inner_optimizer) is keras.optimizers.Adam
    revived = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(revived) is LossScaleOptimizer
    assert {k: v for k, v in revived.get_config().items() if k != "inner_optimizer"} == own


@pytest.mark.parametrize("legacy", [False, True], ids=["stock_config", "legacy_stock_config"])
def test_stock_config_loads_into_ours(legacy):
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=512.0,
                                                dynamic_growth_steps=7)
    config = stock.get_config()
    if legacy:  # older Keras wrote the base optimizer arguments too
        config.update({"clipnorm": None, "use_ema": False, "loss_scale_factor": None})
    ours = LossScaleOptimizer.from_config(config)
    assert (ours.initial_scale, ours.dynamic_growth_steps, ours.tier) == (512.0, 7, None)
    assert float(ours.inner_optimizer.learning_rate) == 0.5


# ------------------------------------------------------------------- fit and saving
def _model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="head")(hidden))


def _data(poison_row=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    if poison_row is not None:
        x[poison_row] = np.inf
    return x, y


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_fit_with_monitor_puts_counters_in_logs(policy, jit):
    keras.config.set_dtype_policy(policy)
    model = _model()
    opt = LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=256.0)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    assert model.optimizer is opt  # compile keeps ours
    x, y = _data(poison_row=40)  # batch 5 of 8 overflows in every epoch
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                        callbacks=[LossScaleMonitor(update_freq=3)])
    assert history.history["overflow_count"] == [1, 2]
    assert history.history["loss_scale"] == [128.0, 64.0]
    assert history.history["consecutive_overflows"] == [0, 0]
    assert int(opt.iterations.numpy()) == 14 and int(opt.total_steps.numpy()) == 16
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("inner_kwargs", [{"use_ema": True}, {"clipnorm": 1.0},
                                          {"gradient_accumulation_steps": 2}],
                         ids=["ema", "clipnorm", "grad_accumulation"])
def test_inner_optimizer_features_work(inner_kwargs):
    keras.config.set_dtype_policy("mixed_float16")
    model = _model()
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01, **inner_kwargs), initial_scale=256.0)
    model.compile(optimizer=opt, loss="mse")
    x, y = _data(poison_row=40)
    w0 = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    # 7 applied steps; with accumulation over 2 the inner optimizer counts 3 updates (Keras).
    applied = 3 if "gradient_accumulation_steps" in inner_kwargs else 7
    assert int(opt.overflow_count.numpy()) == 1 and int(opt.iterations.numpy()) == applied
    weights = model.get_weights()
    assert all(np.isfinite(w).all() for w in weights)
    assert any(not np.array_equal(a, b) for a, b in zip(weights, w0))


def _trained(tmp_path, optimizer):
    keras.config.set_dtype_policy("mixed_float16")
    model = _model()
    model.compile(optimizer=optimizer, loss="mse")
    x, y = _data(poison_row=40)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    path = str(tmp_path / "model.keras")
    model.save(path)
    return model, path


@pytest.mark.parametrize("stock", [True, False])
def test_load_weights_before_the_optimizer_is_built_keeps_its_state_stock_skips_it(tmp_path, stock):
    # The usual resume: a fresh model, compiled, `load_weights`, then `fit` (which builds the optimizer).
    make = (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))) if stock else (
        lambda: LossScaleOptimizer(keras.optimizers.Adam(1e-3), tier="auto", hysteresis=2))
    model, _ = _trained(tmp_path, make())
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    fresh = _model()
    fresh.compile(optimizer=make(), loss="mse")
    if stock:  # Keras 3.15 skips the optimizer's state: the scale and Adam's moments restart
        with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
            fresh.load_weights(path)
        return
    fresh.load_weights(path)  # before: ValueError from `scale` of the unbuilt tier="auto" optimizer
    assert not fresh.optimizer.built
    fresh.optimizer.build(fresh.trainable_variables)
    assert len(fresh.optimizer.variables) == len(model.optimizer.variables)
    for a, b in zip(fresh.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert int(fresh.optimizer.overflow_count.numpy()) == int(model.optimizer.overflow_count.numpy()) > 0


def test_load_weights_before_fit_builds_the_optimizer_resumes_in_fit(tmp_path):
    # fit builds the optimizer itself (possibly inside its first traced step): the loaded state is what it trains on.
    make = lambda: LossScaleOptimizer(keras.optimizers.Adam(1e-3), tier="auto", hysteresis=2)  # noqa: E731
    model, _ = _trained(tmp_path, make())
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    fresh = _model()
    fresh.compile(optimizer=make(), loss="mse")
    fresh.load_weights(path)
    x, y = _data(poison_row=None)
    for m in (model, fresh):
        m.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(fresh.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    for a, b in zip(fresh.weights, model.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_load_weights_before_build_reports_the_loaded_state_without_keras_false_warning(tmp_path):
    # The state waits for build; meanwhile the public reads answer with it, and Keras's "Skipping
    # variable loading" for the inner optimizer (restored at that build too) is kept back.
    make = lambda: LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=1024.0)  # noqa: E731
    model, _ = _trained(tmp_path, make())
    ref = model.optimizer
    assert ref.scale != 1024.0 and int(ref.overflow_count.numpy()) > 0  # guard: state to carry over
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    fresh = _model()
    fresh.compile(optimizer=make(), loss="mse")
    opt = fresh.optimizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_weights(path)
    assert [str(w.message) for w in caught] == []
    assert not opt.built and opt.scale == ref.scale
    for name in ("iterations", "total_steps", "overflow_count", "consecutive_overflows", "overflows_at_min_scale"):
        assert int(getattr(opt, name).numpy()) == int(getattr(ref, name).numpy()), name
    # Saved again before build, the held state is kept; an eager step scales and unscales by it.
    fresh.save_weights(path)
    again = _model()
    again.compile(optimizer=make(), loss="mse", run_eagerly=True)
    again.load_weights(path)
    x, y = _data()
    for m in (model, again):
        m.compile(optimizer=m.optimizer, loss="mse", run_eagerly=True)
        m.fit(x[:8], y[:8], batch_size=8, verbose=0)
    # A scale off by the 2x of one back-off would double the update; 1e-6 allows a float32 ulp.
    for a, b in zip(again.weights + again.optimizer.variables, model.weights + ref.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=0, err_msg=a.path)


def test_load_weights_before_build_still_lets_keras_warn_for_plain_optimizers(tmp_path):
    model = _model()
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    x, y = _data()
    model.fit(x[:8], y[:8], verbose=0)
    model.save_weights(str(tmp_path / "w.weights.h5"))
    fresh = _model()
    fresh.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        fresh.load_weights(str(tmp_path / "w.weights.h5"))


@pytest.mark.parametrize("on_min_scale", ["raise", "warn"])
def test_xla_fit_applies_on_min_scale_when_it_ends(on_min_scale, caplog):
    # XLA runs no host callback inside the step: `fit` checks when it ends, "raise" warns at trace.
    keras.config.set_dtype_policy("mixed_float16")
    model = _model()
    opt = LossScaleOptimizer(keras.optimizers.SGD(1e-2), initial_scale=4.0, min_scale=2.0, on_min_scale=on_min_scale)
    model.compile(optimizer=opt, loss="mse", jit_compile=True)
    x, y = np.full((64, 4), np.inf, "float32"), np.zeros((64, 1), "float32")  # every step overflows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if on_min_scale == "raise":
            with pytest.raises(MinScaleError, match=r"consecutive steps overflowed at min_scale=2"):
                model.fit(x, y, batch_size=4, verbose=0)
        else:
            model.fit(x, y, batch_size=4, verbose=0)
            assert any("consecutive steps overflowed" in r.getMessage() for r in caplog.records)
    assert int(opt.overflows_at_min_scale.numpy()) >= opt.min_scale_patience  # guard: the streak happened
    xla = [str(w.message) for w in caught if issubclass(w.category, AmpWarning) and "XLA" in str(w.message)]
    assert len(xla) == (on_min_scale == "raise") and all("LossScaleMonitor" in m for m in xla)


def test_keras_round_trip_under_other_policy_keeps_state_stock_drops_it(tmp_path):
    (tmp_path / "stock").mkdir()
    stock_model, stock_path = _trained(tmp_path / "stock", keras.optimizers.Adam(1e-3))
    assert type(stock_model.optimizer) is keras.optimizers.LossScaleOptimizer  # auto-wrapped
    keras.config.set_dtype_policy("float32")
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        stock_loaded = keras.saving.load_model(stock_path)
    assert not isinstance(stock_loaded.optimizer, keras.optimizers.LossScaleOptimizer)

    (tmp_path / "ours").mkdir()
    model, path = _trained(tmp_path / "ours", LossScaleOptimizer(
        keras.optimizers.Adam(1e-3), tier="auto", hysteresis=2))
    keras.config.set_dtype_policy("float32")
    loaded = keras.saving.load_model(path)
    opt, ref = loaded.optimizer, model.optimizer
    assert type(opt) is LossScaleOptimizer
    assert opt.get_config() == ref.get_config() and opt.get_config()["tier"] == "small"
    assert len(opt.variables) == len(ref.variables)
    for a, b in zip(opt.variables, ref.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert int(opt.overflow_count.numpy()) == 1 and opt.scale == ref.scale
    assert int(opt.iterations.numpy()) == 7  # inner Adam state came back


def test_tf_train_checkpoint_round_trip(tmp_path):
    v, opt = _setup(inner=keras.optimizers.Adam(0.01), initial_scale=64.0, hysteresis=2)
    step = _runner(opt, v, "tf_function")
    for g in [1.0, INF, INF, 1.0, INF]:
        step(g)
    saved = [x.numpy().copy() for x in opt.variables]
    prefix = tf.train.Checkpoint(optimizer=opt, v=v).save(str(tmp_path / "ckpt"))
    keras.config.set_dtype_policy("mixed_bfloat16")  # a different global policy at load time
    v2, opt2 = _setup(inner=keras.optimizers.Adam(0.01), initial_scale=64.0, hysteresis=2)
    tf.train.Checkpoint(optimizer=opt2, v=v2).restore(prefix).assert_consumed()
    restored = [x.numpy() for x in opt2.variables]
    assert len(restored) == len(saved) == 7 + 4  # 7 own (4 stock + 3 counters), Adam's 4
    for a, b, var in zip(restored, saved, opt2.variables):
        np.testing.assert_array_equal(a, b, err_msg=var.path)
    assert int(opt2.consecutive_overflows.numpy()) == 1 and opt2.scale == 32.0


@pytest.mark.parametrize("stock", [True, False])
def test_a_second_build_keeps_the_restored_state_stock_makes_new_variables(tmp_path, stock):
    # A custom loop that restores a checkpoint into a built optimizer, then builds it again before training.
    cls = keras.optimizers.LossScaleOptimizer if stock else LossScaleOptimizer
    kwargs = {} if stock else {"hysteresis": 1}
    v, opt = _setup(opt_cls=cls, initial_scale=64.0, **kwargs)
    step = _runner(opt, v, "tf_function")
    for g in [INF, 1.0, INF]:
        step(g)
    prefix = tf.train.Checkpoint(optimizer=opt, v=v).save(str(tmp_path / "ckpt"))
    v2, opt2 = _setup(opt_cls=cls, initial_scale=64.0, **kwargs)
    tf.train.Checkpoint(optimizer=opt2, v=v2).restore(prefix).assert_consumed()
    count = len(opt2.variables)
    opt2.build([v2])
    if stock:  # Keras 3.15: a second scale variable, at its initial value, is the one training reads
        assert len(opt2.variables) > count and float(opt2.dynamic_scale.numpy()) == 64.0
        return
    assert len(opt2.variables) == count and opt2.scale == 16.0 and int(opt2.overflow_count.numpy()) == 2
    _runner(opt2, v2, "tf_function")(1.0)
    assert opt2.scale == 16.0 and int(opt2.total_steps.numpy()) == 4


def test_stock_saved_state_loads_into_ours(tmp_path):
    (tmp_path / "s").mkdir()
    stock_model, path = _trained(tmp_path / "s", keras.optimizers.Adam(1e-3))
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.saving.load_model(path, compile=False)
    opt = LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    model.load_weights(path)
    stock = stock_model.optimizer
    assert opt.scale == float(stock.dynamic_scale.numpy())
    assert opt.scale != opt.initial_scale  # guard: there was state to carry over
    assert int(opt.iterations.numpy()) == int(stock.iterations.numpy()) > 0
    for a, b in zip(opt.inner_optimizer.variables, stock.inner_optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(opt.overflow_count.numpy()) == 0  # not recorded by stock Keras
    # Stock never advances its own `iteration`: total_steps restarts from the applied steps.
    assert int(opt.total_steps.numpy()) == int(opt.iterations.numpy())


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_overwrite_with_gradient_variables_get_the_raw_gradient(mode):
    # Float8 scaling factors (`overwrite_with_gradient`) receive values, not gradients: unscaled.
    v = keras.Variable(np.zeros(4, "float32"))
    v.overwrite_with_gradient = True
    w = keras.Variable(np.ones(4, "float32"))
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8.0)
    opt.build([v, w])

    def step():
        opt.apply([tf.fill([4], 3.0), tf.fill([4], 8.0)], [v, w])

    (step if mode == "eager" else tf.function(step))()
    np.testing.assert_array_equal(v.numpy(), np.full(4, 3.0))  # written as is, not 3 / 8
    np.testing.assert_allclose(w.numpy(), 1.0 - 0.5 * 8.0 / 8.0, rtol=0, atol=0)  # unscaled by 8


def test_subnormal_min_scale_rejected_where_float32_would_make_it_zero():
    # float32 holds neither as a normal number: 1e-46 becomes 0.0, 1e-40 a subnormal. A zero floor
    # lets the scale reach 0, where the next step's 0/0 writes NaN weights.
    assert np.float32(1e-46) == 0.0 and np.float32(1e-40) < np.finfo(np.float32).tiny
    with pytest.raises(ValueError, match=r"`min_scale` must be at least float32's smallest normal.*min_scale=1e-40"):
        LossScaleOptimizer(keras.optimizers.SGD(), min_scale=1e-40)
    with pytest.raises(ValueError, match=r"`min_scale` must be a number > 0.0"):  # 0 is not offered above
        LossScaleOptimizer(keras.optimizers.SGD(), min_scale=0.0)
    with pytest.raises(ValueError, match=r"min_scale=1e-46"):
        LossScaleOptimizer(keras.optimizers.SGD(), min_scale=1e-46)
    # The smallest normal float32 is accepted and holds as a floor.
    tiny = float(np.finfo(np.float32).tiny)
    v, opt = _setup(initial_scale=tiny * 4, min_scale=tiny)
    _loop(opt, v, INF, 5)
    assert opt.scale == np.float32(tiny) > 0.0


def test_auto_tier_eager_first_step_before_build_is_unscaled_by_the_scale_it_took():
    # fit(run_eagerly=True) and custom loops scale the first loss before `apply` builds the optimizer
    # (and picks the tier's scale): that step's gradients are unscaled by the scale the loss took.
    def first_step(build_first):
        v = keras.Variable(np.array([1.0, -2.0, 3.0], "float32"))
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), tier="auto")
        if build_first:
            opt.build([v])
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_sum(v.value * v.value))
        opt.apply(tape.gradient(scaled, [v]), [v])
        return opt, v.numpy()

    late, moved = first_step(build_first=False)
    early, reference = first_step(build_first=True)
    np.testing.assert_array_equal(moved, reference)  # powers of two: exact either way
    np.testing.assert_allclose(reference, [0.8, -1.6, 2.4], rtol=1e-6)  # v - 0.1 * 2v: one step, unscaled
    assert late.scale == early.scale == 2.0**10 and int(late.overflow_count.numpy()) == 0
    assert late._first_scale is None  # the next steps use the built scale


def test_fit_run_eagerly_under_auto_tier_matches_the_traced_fit():
    # Stock Keras's LossScaleOptimizer trains eagerly; so does ours (tier="auto", built by fit's first apply).
    def losses(run_eagerly):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1), tier="auto"), loss="mse",
                      run_eagerly=run_eagerly)
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
        return model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]

    eager, traced = losses(True), losses(False)
    np.testing.assert_allclose(eager, traced, rtol=1e-6)
    assert eager[1] < eager[0]


def test_an_eager_loss_scaled_before_build_and_never_applied_does_not_unscale_later_steps():
    v = keras.Variable(np.array([1.0, -2.0, 3.0], "float32"))
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), tier="auto")
    opt.scale_loss(tf.constant(1.0))  # eager and unbuilt: looked at, never applied
    opt.build([v])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_sum(v.value * v.value))
        opt.apply(tape.gradient(scaled, [v]), [v])

    step()
    np.testing.assert_allclose(v.numpy(), [0.8, -1.6, 2.4], rtol=1e-6)  # unscaled by the built scale
    assert opt._first_scale is None

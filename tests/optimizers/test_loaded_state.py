"""keras_amp.optimizers.loaded_state: which saved layouts `assign` takes, and `clamp_scale`'s bounds."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.optimizers import LossScaleOptimizer, loaded_state
from tests.helpers import built_optimizer as _setup, step_runner as _runner

INF = float("inf")


def _store(opt):
    store = {}
    opt.save_own_variables(store)
    return store


def _trained(opt_cls, grads, **kwargs):
    v, opt = _setup(opt_cls=opt_cls, inner=keras.optimizers.Adam(0.01), initial_scale=64.0, **kwargs)
    step = _runner(opt, v, "tf_function")
    for g in grads:
        step(g)
    return opt


def test_ours_with_a_built_inner_optimizer_is_left_to_keras_which_loads_it_whole():
    saved = _trained(LossScaleOptimizer, [1.0, INF, INF, 1.0], hysteresis=1)
    _, fresh = _setup(inner=keras.optimizers.Adam(0.01), initial_scale=64.0, hysteresis=1)
    store = _store(saved)
    assert len(store) == len(fresh.variables)  # one entry per variable: Keras's own loading fits it
    initial = [v.numpy().copy() for v in fresh.variables]
    assert not loaded_state.assign(fresh, store)
    for a, b in zip(fresh.variables, initial, strict=True):
        np.testing.assert_array_equal(a.numpy(), b, err_msg=a.path)
    fresh.load_own_variables(store)
    for a, b in zip(fresh.variables, saved.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert fresh.scale == 16.0 and int(fresh.overflow_count.numpy()) == 2


def test_stock_layout_fills_ours_counters_start_at_zero_steps_from_inner_iterations():
    stock = _trained(keras.optimizers.LossScaleOptimizer, [1.0, INF, 1.0, 1.0])
    store = _store(stock)
    assert len(store) == loaded_state.STOCK_OWN_VARIABLES + len(stock.inner_optimizer.variables)
    _, ours = _setup(inner=keras.optimizers.Adam(0.01), initial_scale=64.0)
    assert loaded_state.assign(ours, store)
    assert ours.scale == float(stock.dynamic_scale.numpy()) == 32.0
    for a, b in zip(ours.inner_optimizer.variables, stock.inner_optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert int(ours.overflow_count.numpy()) == 0
    # Stock's own `iteration` stays 0; the steps it applied (3 of 4) become total_steps.
    assert int(stock.iterations.numpy()) == 3 and int(ours.total_steps.numpy()) == 3


def test_another_layout_is_left_to_keras_and_nothing_is_assigned():
    _, ours = _setup(inner=keras.optimizers.Adam(0.01), initial_scale=64.0)
    before = [v.numpy().copy() for v in ours.variables]
    store = {str(i): np.zeros_like(b) for i, b in enumerate(before[:3])}  # neither layout: 3 entries
    assert not loaded_state.assign(ours, store)
    for a, b in zip(ours.variables, before, strict=True):
        np.testing.assert_array_equal(a.numpy(), b)


def test_inner_not_yet_built_takes_only_the_own_variables():
    # An inner optimizer that builds later (LeanAdam after memory.prepare) loads its own entry then.
    saved = _trained(LossScaleOptimizer, [INF, 1.0], hysteresis=1)
    v = keras.Variable(np.zeros(4, "float32"))
    fresh = LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=64.0, hysteresis=1)
    fresh.build([v])
    fresh.inner_optimizer.built = False  # as LossScaleOptimizer leaves a deferred inner optimizer
    own = list(fresh._variables)
    assert loaded_state.assign(fresh, _store(saved))
    for a, b in zip(own, saved._variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert fresh.scale == 32.0


@pytest.mark.parametrize("loaded, expected", [(0.0, 1.0), (-4.0, 1.0), (float("nan"), 1.0), (INF, 2.0**24),
                                              (2.0**30, 2.0**24), (0.5, 1.0)])
def test_out_of_bounds_scale_is_brought_to_the_nearer_bound_nan_to_the_floor(loaded, expected):
    _, opt = _setup(min_scale=1.0, max_scale=2.0**24)
    opt.dynamic_scale.assign(loaded)
    loaded_state.clamp_scale(opt)
    assert opt.scale == expected


@pytest.mark.parametrize("loaded", [1.0, 3.0, 2.0**24])
def test_in_bounds_scale_is_kept(loaded):
    _, opt = _setup(min_scale=1.0, max_scale=2.0**24)
    opt.dynamic_scale.assign(loaded)
    loaded_state.clamp_scale(opt)
    assert opt.scale == loaded


def test_static_scale_is_never_clamped():
    _, opt = _setup(dynamic=False, initial_scale=2.0**30, max_scale=2.0**24)
    loaded_state.clamp_scale(opt)
    assert opt.scale == 2.0**30


@pytest.mark.parametrize("read_first", ["total_steps", "step"])
def test_stock_tf_checkpoint_sets_total_steps_to_iterations_plus_overflows(tmp_path, read_first):
    # Stock's checkpoint has no counters and its own `iteration`, restored into our total_steps, stays 0.
    stock = _trained(keras.optimizers.LossScaleOptimizer, [1.0, INF, 1.0, 1.0])
    assert int(stock.iterations.numpy()) == 3 and int(stock._iterations.numpy()) == 0  # guard: the gap to fill
    path = tf.train.Checkpoint(optimizer=stock).write(str(tmp_path / "ckpt"))
    v, opt = _setup(inner=keras.optimizers.Adam(0.01), initial_scale=64.0)
    status = tf.train.Checkpoint(optimizer=opt).read(path)
    with pytest.raises(AssertionError, match="overflow_count"):  # guard: the counters are not in it
        status.assert_existing_objects_matched()
    if read_first == "step":  # the step itself counts from iterations + overflow_count
        _runner(opt, v, "tf_function")(1.0)
        assert int(opt._iterations.numpy()) == 4
    assert int(opt.total_steps.numpy()) == int(opt.iterations.numpy()) + int(opt.overflow_count.numpy())
    assert int(opt.iterations.numpy()) == 3 + (read_first == "step")


def test_our_tf_checkpoint_keeps_total_steps_with_its_overflows(tmp_path):
    saved = _trained(LossScaleOptimizer, [1.0, INF, INF, 1.0])
    path = tf.train.Checkpoint(optimizer=saved).write(str(tmp_path / "ckpt"))
    _, opt = _setup(inner=keras.optimizers.Adam(0.01), initial_scale=64.0)
    tf.train.Checkpoint(optimizer=opt).read(path)
    assert (int(opt.total_steps.numpy()), int(opt.iterations.numpy()), int(opt.overflow_count.numpy())) == (4, 2, 2)


def test_peek_reads_our_layout_and_stocks_and_declines_an_unbuilt_save():
    ours = _store(_trained(LossScaleOptimizer, [1.0, INF, 1.0]))
    stock = _store(_trained(keras.optimizers.LossScaleOptimizer, [1.0, INF, 1.0]))
    unbuilt = _store(LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=64.0))
    as_arrays = lambda store: {k: np.asarray(v) for k, v in store.items()}  # noqa: E731
    assert loaded_state.peek(as_arrays(ours)) == dict(
        loss_scale=32.0, total_steps=3, iterations=2, overflow_count=1, consecutive_overflows=0,
        overflows_at_min_scale=0, inner_start=loaded_state.OWN_VARIABLES)
    assert loaded_state.peek(as_arrays(stock)) == dict(
        loss_scale=32.0, total_steps=2, iterations=2, overflow_count=0, consecutive_overflows=0,
        overflows_at_min_scale=0, inner_start=loaded_state.STOCK_OWN_VARIABLES)
    assert len(unbuilt) == 4 and loaded_state.peek(as_arrays(unbuilt)) is None

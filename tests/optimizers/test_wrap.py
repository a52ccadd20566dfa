"""keras_amp.optimizers.wrap: float16-only wrapping, idempotence, stock conversion."""

import warnings

import keras
import numpy as np
import pytest

from keras_amp.optimizers import LossScaleOptimizer, wrap
from keras_amp.policy import AmpWarning


def test_wraps_under_mixed_float16_and_is_idempotent():
    keras.config.set_dtype_policy("mixed_float16")
    inner = keras.optimizers.Adam()
    opt = wrap(inner)
    assert type(opt) is LossScaleOptimizer and opt.inner_optimizer is inner
    assert opt.tier == "auto"
    assert wrap(opt) is opt
    with pytest.warns(AmpWarning, match=r"returned unchanged; ignored: hysteresis, tier"):
        assert wrap(opt, tier="large", hysteresis=3) is opt
    assert opt.hysteresis == 1


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_unchanged_without_float16(policy):
    keras.config.set_dtype_policy(policy)
    inner = keras.optimizers.SGD()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wrap(inner) is inner
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert wrap(stock) is stock


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_forced_wrap_warns(policy):
    keras.config.set_dtype_policy(policy)
    with pytest.warns(AmpWarning, match=policy):
        opt = wrap(keras.optimizers.SGD(), force=True, tier="small")
    assert type(opt) is LossScaleOptimizer and opt.initial_scale == 2.0**10


def test_converts_unbuilt_stock_optimizer_carrying_non_defaults():
    keras.config.set_dtype_policy("mixed_float16")
    inner = keras.optimizers.SGD()
    stock = keras.optimizers.LossScaleOptimizer(inner, initial_scale=4096.0, name="mine")
    opt = wrap(stock, tier="small")
    assert type(opt) is LossScaleOptimizer and opt.inner_optimizer is inner
    # Explicit non-default value kept; the default growth interval yields to the tier's.
    assert (opt.initial_scale, opt.dynamic_growth_steps, opt.name) == (4096.0, 100, "mine")


@pytest.mark.parametrize("make, match", [
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=2.0**20),
     r"they fit no tier.*initial_scale=1048576.0.*from the stock LossScaleOptimizer .*tier=None"),
    (lambda: keras.optimizers.Adam(), r"they do not fit: small \[1, 65536\]\. Received: initial_scale=131072.0"),
], ids=["stock_initial_scale_above_every_tier", "initial_scale_above_small"])
def test_auto_tier_values_that_fail_some_model_size_fail_in_wrap_not_in_fit(make, match):
    keras.config.set_dtype_policy("mixed_float16")
    kwargs = {} if isinstance(make(), keras.optimizers.LossScaleOptimizer) else {"initial_scale": 2.0**17}
    with pytest.raises(ValueError, match=match):
        wrap(make(), **kwargs)
    # Under tier=None (bounds [1, 2**24]) both are valid.
    assert wrap(make(), tier=None, **kwargs).initial_scale == kwargs.get("initial_scale", 2.0**20)


def test_refuses_built_stock_optimizer():
    keras.config.set_dtype_policy("mixed_float16")
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    stock.build([keras.Variable(np.zeros(3, "float32"))])
    with pytest.raises(ValueError, match="built=True"):
        wrap(stock)


def test_accepts_names_and_kwargs():
    keras.config.set_dtype_policy("mixed_float16")
    opt = wrap("adam", tier=None, hysteresis=3)
    assert type(opt.inner_optimizer) is keras.optimizers.Adam and opt.hysteresis == 3


# Issue 14: the same call must fail under every policy, not only where it would wrap.
BAD_WRAP_CALLS = {
    "tier_bogus": (dict(tier="bogus"), ValueError, r"Unknown `tier`. Received: tier='bogus'"),
    "tier_int": (dict(tier=3), TypeError, r"`tier` must be a string"),
    "min_scale_negative": (dict(min_scale=-1), ValueError, r"`min_scale` must be .*Received: min_scale=-1"),
    "min_scale_subnormal": (dict(min_scale=1e-40), ValueError, r"min_scale=1e-40"),
    "initial_scale_past_float32": (dict(initial_scale=1e39), ValueError, r"initial_scale=1e\+39"),
    "growth_steps_past_int64": (dict(dynamic_growth_steps=10**20), ValueError, r"dynamic_growth_steps="),
    "hysteresis_past_int64": (dict(hysteresis=10**20), ValueError, r"hysteresis="),
    "unknown_kwarg": (dict(foo=1), TypeError, r"wrap\(\) got unexpected keyword argument\(s\): foo"),
    "force_string": (dict(force="no"), TypeError, r"`force` must be True or False. Received: force='no'"),
    "initial_outside_tier_bounds": (dict(tier="small", initial_scale=2.0**20), ValueError, r"tier='small'"),
}


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("case", sorted(BAD_WRAP_CALLS))
def test_bad_arguments_raise_under_every_policy(policy, case):
    kwargs, error, match = BAD_WRAP_CALLS[case]
    keras.config.set_dtype_policy(policy)
    inner = keras.optimizers.SGD(loss_scale_factor=4.0)
    with pytest.raises(error, match=match):
        wrap(inner, **kwargs)
    assert inner.loss_scale_factor == 4.0  # nothing half-done: wrapping would have reset it


@pytest.mark.parametrize("bad, error", [(3, TypeError), ("bogus_optimizer", ValueError), ({"x": 1}, ValueError)],
                         ids=["int", "unknown_name", "config_without_class"])
def test_bad_optimizer(bad, error):
    with pytest.raises(error, match=r"optimizer="):
        wrap(bad)


def test_numpy_integers_are_integers():
    keras.config.set_dtype_policy("mixed_float16")
    opt = wrap(keras.optimizers.SGD(), tier=None, hysteresis=np.int64(3), dynamic_growth_steps=np.int32(7))
    assert (opt.hysteresis, opt.dynamic_growth_steps) == (3, 7) and type(opt.hysteresis) is int

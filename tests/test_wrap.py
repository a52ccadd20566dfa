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

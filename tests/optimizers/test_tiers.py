"""keras_amp.optimizers.tiers: the loss-scaling table by model size and the "auto" choice."""

import dataclasses
import types

import keras
import numpy as np
import pytest

from keras_amp.optimizers import LossScaleOptimizer, settings, tiers


def test_tier_none_keeps_keras_defaults_and_explicit_overrides_tier():
    opt = LossScaleOptimizer(keras.optimizers.SGD())
    assert (opt.initial_scale, opt.dynamic_growth_steps, opt.min_scale, opt.max_scale) == (
        2.0**15, 2000, 1.0, 2.0**24)
    opt = LossScaleOptimizer(keras.optimizers.SGD(), tier="medium", min_scale=8.0)
    assert (opt.initial_scale, opt.dynamic_growth_steps, opt.min_scale, opt.max_scale) == (
        2.0**12, 50, 8.0, 131072.0)


def test_keras_default_row_is_stock_keras_initial_scale_and_growth_interval():
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert tiers.KERAS_DEFAULT.initial_scale == stock.initial_scale == 2.0**15
    assert tiers.KERAS_DEFAULT.dynamic_growth_steps == stock.dynamic_growth_steps == 2000


@pytest.mark.parametrize(
    "num_params, tier",
    [(0, "small"), (99_999_999, "small"), (100_000_000, "medium"), (1_000_000_000, "medium"),
     (1_000_000_001, "large"), (np.int64(5 * 10**9), "large")],
    ids=["empty", "just-below-100M", "100M", "1B", "just-above-1B", "numpy-5B"],
)
def test_choose_tier_thresholds(num_params, tier):
    assert tiers.choose_tier(num_params) == tier


def test_count_params_multiplies_each_shape_out():
    variables = [keras.Variable(np.zeros((10, 10), "float32")), keras.Variable(np.zeros((3,), "float32")),
                 keras.Variable(np.float32(0.0)), types.SimpleNamespace(shape=(20_000, 10_000))]
    assert tiers.count_params(variables) == 100 + 3 + 1 + 200_000_000  # a scalar counts 1
    assert tiers.count_params([]) == 0


@pytest.mark.parametrize("name", ["small", "medium", "large"])
def test_each_row_is_its_own_name_and_within_its_own_bounds(name):
    row = tiers.tier_values(name)
    assert row is tiers.TIERS[name] and row.name == name
    settings.check_bounds(True, dataclasses.asdict(row))  # raises if a row broke its own bounds
    assert row.min_scale <= row.initial_scale <= row.max_scale


def test_larger_models_start_higher_and_grow_more_often():
    rows = [tiers.TIERS[name] for name in ("small", "medium", "large")]
    assert [r.initial_scale for r in rows] == [2.0**10, 2.0**12, 2.0**16]
    assert [r.dynamic_growth_steps for r in rows] == [100, 50, 20]
    assert [r.min_scale for r in rows] == [1.0, 256.0, 1024.0]
    assert [r.max_scale for r in rows] == [2.0**16, 2.0**17, 2.0**18]


def test_tier_values_none_is_keras_default_and_auto_counts_the_variables():
    assert tiers.tier_values(None) is tiers.KERAS_DEFAULT and tiers.KERAS_DEFAULT.name is None
    assert tiers.tier_values("auto", [keras.Variable(np.zeros((10, 10), "float32"))]) is tiers.TIERS["small"]
    assert tiers.tier_values("auto", [types.SimpleNamespace(shape=(40_000, 40_000))]) is tiers.TIERS["large"]
    with pytest.raises(ValueError, match=r"build it first.*Received: var_list=None"):
        tiers.tier_values("auto")


def test_validate_tier_names_what_is_allowed():
    assert tiers.TIER_NAMES == (None, "auto", "small", "medium", "large")
    for name in tiers.TIER_NAMES:
        tiers.validate_tier(name)
    with pytest.raises(ValueError, match=r"Received: tier='huge'. Allowed: None \(Keras's defaults\), 'auto', 'small', 'medium', 'large'"):
        tiers.validate_tier("huge")
    with pytest.raises(TypeError, match="`tier` must be a string"):
        tiers.validate_tier(1)

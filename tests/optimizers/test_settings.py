"""keras_amp.optimizers.settings: the checks of LossScaleOptimizer's (and wrap()'s) arguments, the
explicit values over a tier's, and the `min_scale <= initial_scale <= max_scale` bounds."""

import keras
import pytest

from keras_amp.optimizers import LossScaleOptimizer, settings, tiers

INF = float("inf")


@pytest.mark.parametrize(
    "kwargs, exc, fragment",
    [
        ({"min_scale": 0.0}, ValueError, "min_scale=0.0"),
        ({"min_scale": 4.0, "max_scale": 2.0}, ValueError, "max_scale=2.0"),
        ({"initial_scale": 2.0**30}, ValueError, "initial_scale=1073741824"),
        ({"initial_scale": 0.5}, ValueError, "initial_scale=0.5"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor=1.0"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor=1.0"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor=0.0"),
        ({"hysteresis": 0}, ValueError, "hysteresis=0"),
        ({"hysteresis": 1.5}, TypeError, "hysteresis=1.5"),
        ({"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps=0"),
        ({"tier": "huge"}, ValueError, "tier='huge'"),
        ({"on_min_scale": "panic"}, ValueError, "on_min_scale='panic'"),
        ({"dynamic": "yes"}, TypeError, "dynamic='yes'"),
        ({"min_scale": "1"}, TypeError, "min_scale='1'"),
        ({"max_scale": INF}, ValueError, "max_scale=inf"),
    ],
    ids=lambda x: str(x) if not isinstance(x, dict) else "-".join(map(str, x.items())),
)
def test_validation_errors_name_argument_and_value(kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment.replace("(", r"\(").replace("+", r"\+")):
        LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


def test_unknown_arguments_raise_the_stock_value_error():
    # Stock Keras raises ValueError naming them in the order given; a drop-in subclass must too
    # (Keras's own test_init_unsupported_arg runs in tests/layers/test_keras_suites.py).
    pattern = "does not support arguments: `foo`, `bar`"
    with pytest.raises(ValueError, match=pattern):
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), foo=True, bar=3)
    with pytest.raises(ValueError, match=pattern + r"\. Received: foo=True, bar=3\. Allowed: inner_optimizer"):
        LossScaleOptimizer(keras.optimizers.SGD(), foo=True, bar=3)
    # The legacy base-optimizer arguments keep the stock rule: accepted at their defaults only.
    LossScaleOptimizer(keras.optimizers.SGD(), clipnorm=None, use_ema=False)
    with pytest.raises(ValueError, match="on the `inner_optimizer`"):
        LossScaleOptimizer(keras.optimizers.SGD(), clipnorm=1.0)


def test_check_known_kwargs_passes_every_legacy_name():
    settings.check_known_kwargs({name: None for name in settings.LEGACY_KWARGS})
    with pytest.raises(ValueError, match=r"arguments: `zeta`, `alpha`\. Received: zeta=1, alpha='a'\."):
        settings.check_known_kwargs({"zeta": 1, "clipnorm": None, "alpha": "a"})


def test_check_arguments_defaults_and_no_explicit_tier_values():
    found, explicit = settings.check_arguments()
    assert found == {"on_min_scale": "warn", "dynamic": True, "growth_factor": 2.0, "backoff_factor": 0.5,
                     "hysteresis": 1}
    assert explicit == dict.fromkeys(settings.TIER_KEYS)


def test_check_arguments_refuses_unknown_keywords_with_type_error():
    # Unlike the LossScaleOptimizer constructor (which first raises the stock ValueError), the shared
    # check, as wrap() calls it, raises TypeError listing what passes through.
    with pytest.raises(TypeError, match=r"LossScaleOptimizer\(\) got unexpected keyword argument\(s\): a, b\. "
                                        r"Allowed: weight_decay, clipnorm"):
        settings.check_arguments(b=1, a=2)


def test_out_of_bounds_initial_scale_names_the_tier_bounds_it_broke():
    with pytest.raises(ValueError, match=r"Received: initial_scale=1073741824.0, min_scale=1.0, "
                                         r"max_scale=16777216.0 \(tier=None\)$"):
        settings.check_arguments(initial_scale=2.0**30)
    with pytest.raises(ValueError, match=r"initial_scale=8.0, min_scale=256.0, max_scale=131072.0 \(tier='medium'\)$"):
        settings.check_arguments(initial_scale=8.0, tier="medium")


def test_auto_tier_checks_the_explicit_bounds_first():
    with pytest.raises(ValueError, match=r"initial_scale=1073741824.0, min_scale=None, max_scale=1024.0$"):
        settings.check_arguments(tier="auto", initial_scale=2.0**30, max_scale=1024.0)


@pytest.mark.parametrize("kwargs, why", [
    (dict(initial_scale=0.5), r"they fit no tier: small \[1, 65536\]; medium \[256, 131072\]; large \[1024, 262144\]"),
    (dict(initial_scale=2.0**20), r"they fit no tier: .*Received: initial_scale=1048576.0\."),
    (dict(initial_scale=2.0**17), r"they do not fit: small \[1, 65536\]\. Received: initial_scale=131072.0\."),
    (dict(initial_scale=64.0), r"they do not fit: medium \[256, 131072\]; large \[1024, 262144\]\."),
    (dict(min_scale=2.0**17), r"they fit no tier: .*Received: min_scale=131072.0\."),
], ids=["below_every_floor", "above_every_ceiling", "above_small_ceiling", "below_medium_floor", "min_above_ceiling"])
def test_auto_tier_fails_at_construction_unless_the_values_suit_every_tier(kwargs, why):
    # The tier is picked at build, inside the first `fit` step: a value that suits only some tiers
    # would fail there for some model sizes. It fails here, for every size.
    with pytest.raises(ValueError, match=r"With tier='auto'.*every tier it may pick.*" + why):
        settings.check_arguments(tier="auto", **kwargs)


@pytest.mark.parametrize("kwargs", [dict(initial_scale=1024.0), dict(initial_scale=65536.0),
                                    dict(initial_scale=2.0**17, max_scale=2.0**18),
                                    dict(initial_scale=2.0, min_scale=1.0), dict(initial_scale=2.0**20, dynamic=False)],
                         ids=["every_floor", "every_ceiling", "own_ceiling", "own_floor", "static"])
def test_auto_tier_accepts_values_that_suit_every_tier(kwargs):
    settings.check_arguments(tier="auto", **kwargs)


def test_name_errors_are_value_errors_like_stock():
    for name in (3, "a/b"):
        with pytest.raises(ValueError, match=r"Argument `name` must be a string and cannot contain character `/`"):
            settings.check_arguments(name=name)
        with pytest.raises(ValueError):
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), name=name)


def test_a_static_scale_ignores_the_bounds_but_not_their_order():
    settings.check_bounds(False, {"initial_scale": 2.0**30, "min_scale": 1.0, "max_scale": 2.0**24})
    with pytest.raises(ValueError, match=r"`max_scale` must be >= `min_scale`. Received: min_scale=4.0, max_scale=2.0"):
        settings.check_bounds(False, {"initial_scale": 3.0, "min_scale": 4.0, "max_scale": 2.0})


def test_resolve_takes_the_explicit_values_and_the_tier_for_the_rest():
    explicit = {"initial_scale": None, "dynamic_growth_steps": 7, "min_scale": 8.0, "max_scale": None}
    assert settings.resolve(explicit, tiers.TIERS["medium"]) == {
        "initial_scale": 4096.0, "dynamic_growth_steps": 7, "min_scale": 8.0, "max_scale": 131072.0}
    assert settings.resolve(dict.fromkeys(settings.TIER_KEYS), tiers.KERAS_DEFAULT) == {
        "initial_scale": 2.0**15, "dynamic_growth_steps": 2000, "min_scale": 1.0, "max_scale": 2.0**24}

"""Property tests: `scale_rule.adjust` against a float64 reference model, and the optimizer
against `adjust`."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_amp.optimizers import LossScaleOptimizer, scale_rule

FIELDS = scale_rule.ScaleState._fields


def reference(steps, *, initial, growth_steps, lo, hi, growth, backoff, hysteresis, dynamic, patience):
    """The documented rule in float64 Python; one (state dict, min_scale_reached) per step."""
    s = dict(scale=initial, step_counter=0, total_steps=0, overflow_count=0, consecutive_overflows=0,
             overflows_at_min_scale=0)
    trace = []
    for finite in steps:
        s["total_steps"] += 1
        if finite:
            s["consecutive_overflows"] = s["overflows_at_min_scale"] = 0
            s["step_counter"] += 1
            if dynamic and s["step_counter"] >= growth_steps:
                s["scale"], s["step_counter"] = min(s["scale"] * growth, hi), 0
        else:
            at_floor = s["scale"] <= lo if dynamic else True
            s["overflow_count"] += 1
            s["consecutive_overflows"] += 1
            s["step_counter"] = 0
            s["overflows_at_min_scale"] = s["overflows_at_min_scale"] + 1 if at_floor else 0
            if dynamic and s["consecutive_overflows"] >= hysteresis:
                s["scale"] = max(s["scale"] * backoff, lo)
        trace.append((dict(s), s["overflows_at_min_scale"] >= patience))
    return trace


RULES = dict(
    steps=st.lists(st.booleans(), min_size=1, max_size=40),
    growth_steps=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    log2=st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)),
    growth=st.sampled_from([2.0, 4.0]),
    backoff=st.sampled_from([0.5, 0.25]),
    dynamic=st.booleans(),
    patience=st.integers(1, 4),
)


def _case(steps, growth_steps, hysteresis, log2, growth, backoff, dynamic, patience):
    lo = 2.0 ** log2[0]
    initial = lo * 2.0 ** log2[1]
    hi = initial * 2.0 ** log2[2]
    rule = scale_rule.ScaleRule(dynamic=dynamic, dynamic_growth_steps=growth_steps, growth_factor=growth,
                                backoff_factor=backoff, min_scale=lo, max_scale=hi, hysteresis=hysteresis,
                                min_scale_patience=patience)
    want = reference(steps, initial=initial, growth_steps=growth_steps, lo=lo, hi=hi, growth=growth,
                     backoff=backoff, hysteresis=hysteresis, dynamic=dynamic, patience=patience)
    return rule, initial, want


def _as_dict(state):
    return {k: np.asarray(v).item() for k, v in zip(FIELDS, state)}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(as_tensor=st.booleans(), **RULES)
def test_adjust_matches_reference(as_tensor, steps, growth_steps, hysteresis, log2, growth, backoff, dynamic,
                                  patience):
    rule, initial, want = _case(steps, growth_steps, hysteresis, log2, growth, backoff, dynamic, patience)
    state = scale_rule.initial_state(initial)
    if as_tensor:  # the optimizer's form: float32 scale, int64 counters, a boolean tensor flag
        state = scale_rule.ScaleState(tf.constant(initial, tf.float32), *(tf.constant(0, tf.int64),) * 5)
    for finite, (expected, reached) in zip(steps, want):
        state = scale_rule.adjust(rule, state, tf.constant(finite) if as_tensor else finite)
        # Powers of two: float32 holds every scale exactly, so equality is exact (tolerance 0).
        assert _as_dict(state) == expected
        assert bool(scale_rule.min_scale_reached(rule, state)) is reached


def test_the_floor_and_the_ceiling_are_reached():
    # Guards for the properties above: their random cases do reach both bounds.
    rule = scale_rule.ScaleRule(dynamic_growth_steps=1, min_scale=2.0, max_scale=8.0, min_scale_patience=2)
    state = scale_rule.initial_state(4.0)
    for _ in range(3):
        state = scale_rule.adjust(rule, state, True)
    assert _as_dict(state)["scale"] == 8.0
    for _ in range(4):
        state = scale_rule.adjust(rule, state, False)
    assert _as_dict(state)["scale"] == 2.0 and _as_dict(state)["overflows_at_min_scale"] == 2
    assert bool(scale_rule.min_scale_reached(rule, state))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**RULES)
def test_optimizer_state_is_adjust_applied_per_step(steps, growth_steps, hysteresis, log2, growth, backoff,
                                                    dynamic, patience):
    rule, initial, want = _case(steps, growth_steps, hysteresis, log2, growth, backoff, dynamic, patience)
    v = keras.Variable(np.zeros(2, "float32"))
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=initial, dynamic_growth_steps=growth_steps,
        min_scale=rule.min_scale, max_scale=rule.max_scale, growth_factor=growth, backoff_factor=backoff,
        hysteresis=hysteresis, dynamic=dynamic, on_min_scale="ignore")
    opt.build([v])
    assert opt.rule == scale_rule.ScaleRule(**{**vars(rule), "min_scale_patience": opt.min_scale_patience})

    @tf.function
    def run(flags):
        scales = tf.TensorArray(tf.float32, size=tf.shape(flags)[0])
        for i in tf.range(tf.shape(flags)[0]):
            g = tf.where(flags[i], 1.0, float("nan"))
            opt.apply([tf.fill([2], g)], [v])
            scales = scales.write(i, opt.dynamic_scale.value)
        return scales.stack()

    got = run(tf.constant(steps)).numpy()
    np.testing.assert_array_equal(got, np.array([w["scale"] for w, _ in want], "float64"))  # exact
    final = {k: np.asarray(getattr(opt, a).numpy()).item() for k, a in zip(FIELDS, (
        "dynamic_scale", "step_counter", "total_steps", "overflow_count", "consecutive_overflows",
        "overflows_at_min_scale"))}
    assert final == want[-1][0]
    assert int(opt.iterations.numpy()) == sum(steps)  # applied steps only


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        pytest.param({"min_scale": 1e-39}, ValueError, "min_scale=1e-39", id="min_scale_subnormal"),
        pytest.param({"max_scale": 1e39}, ValueError, "max_scale=1e+39", id="max_scale_past_float32"),
        pytest.param({"min_scale": 4.0, "max_scale": 2.0}, ValueError, "max_scale=2.0", id="max_below_min"),
        pytest.param({"dynamic_growth_steps": 2**63}, ValueError, "dynamic_growth_steps=", id="steps_past_int64"),
        pytest.param({"hysteresis": np.float32(2)}, TypeError, "hysteresis=", id="hysteresis_float"),
        pytest.param({"dynamic": 1}, TypeError, "dynamic=1", id="dynamic_int"),
    ],
)
def test_rule_validates_its_constants(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace("+", r"\+")):
        scale_rule.ScaleRule(**kwargs)


def test_rule_accepts_numpy_numbers_as_plain_python():
    rule = scale_rule.ScaleRule(dynamic_growth_steps=np.int64(3), hysteresis=np.int32(2), min_scale=np.float32(2.0))
    assert (rule.dynamic_growth_steps, rule.hysteresis, rule.min_scale) == (3, 2, 2.0)
    assert type(rule.dynamic_growth_steps) is int and type(rule.min_scale) is float

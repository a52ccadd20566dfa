"""Property test: the scale and counters follow a pure-Python model of the update rule."""

import keras
import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_amp.optimizers import LossScaleOptimizer


def reference(steps, *, initial, growth_steps, lo, hi, growth, backoff, hysteresis, dynamic):
    """The documented rule, in float64 Python (exact here: all values are powers of two)."""
    scale, counter, overflows, consecutive = initial, 0, 0, 0
    trace = []
    for finite in steps:
        if finite:
            consecutive = 0
            counter += 1
            if dynamic and counter >= growth_steps:
                scale, counter = min(scale * growth, hi), 0
        else:
            overflows += 1
            consecutive += 1
            counter = 0
            if dynamic and consecutive >= hysteresis:
                scale = max(scale * backoff, lo)
        trace.append((scale, overflows, consecutive))
    return trace




@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(st.booleans(), min_size=1, max_size=40),
    growth_steps=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    log2=st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)),
    growth=st.sampled_from([2.0, 4.0]),
    backoff=st.sampled_from([0.5, 0.25]),
    dynamic=st.booleans(),
)
def test_scale_matches_reference(steps, growth_steps, hysteresis, log2, growth, backoff, dynamic):
    lo = 2.0 ** log2[0]
    initial = lo * 2.0 ** log2[1]
    hi = initial * 2.0 ** log2[2]
    kwargs = dict(initial=initial, growth_steps=growth_steps, lo=lo, hi=hi, growth=growth,
                  backoff=backoff, hysteresis=hysteresis, dynamic=dynamic)
    v = keras.Variable(np.zeros(2, "float32"))
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=initial, dynamic_growth_steps=growth_steps,
        min_scale=lo, max_scale=hi, growth_factor=growth, backoff_factor=backoff,
        hysteresis=hysteresis, dynamic=dynamic, on_min_scale="ignore")
    opt.build([v])

    @tf.function
    def run(flags):
        scales = tf.TensorArray(tf.float32, size=tf.shape(flags)[0])
        for i in tf.range(tf.shape(flags)[0]):
            g = tf.where(flags[i], 1.0, float("nan"))
            opt.apply([tf.fill([2], g)], [v])
            scales = scales.write(i, opt.dynamic_scale.value)
        return scales.stack()

    got = run(tf.constant(steps)).numpy()
    want = reference(steps, **kwargs)
    # Powers of two: float32 holds them exactly, so the comparison is exact (tolerance 0).
    np.testing.assert_array_equal(got, np.array([w[0] for w in want], "float64"))
    assert int(opt.overflow_count.numpy()) == want[-1][1]
    assert int(opt.consecutive_overflows.numpy()) == want[-1][2]
    assert int(opt.total_steps.numpy()) == len(steps)

"""Stock Keras 3.15 where README's "what keras_amp adds" table says it falls short, shown without keras_amp.

For the rows whose keras_amp test modules show only keras_amp's side. Each test fails once Keras
itself changes the behaviour: then the README row (and the keras_amp feature) should be revisited.
"""

import warnings

import keras
import numpy as np
import pytest


def test_stock_keras_takes_a_policy_by_hand_and_says_nothing_about_the_hardware():
    # No policy chosen from the hardware: "auto" is no Keras policy.
    with pytest.raises(ValueError):
        keras.config.set_dtype_policy("auto")
    # mixed_float16 is accepted on any machine without a word (on a CPU its matmuls are slower
    # than float32's: README's figures), and layers then compute in float16.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras.config.set_dtype_policy("mixed_float16")
        layer = keras.layers.Dense(4)
        out = layer(np.ones((2, 4), "float32"))
    assert layer.compute_dtype == "float16" and out.dtype == "float16"


def test_stock_loss_scale_optimizer_skips_steps_without_a_trace_in_the_logs():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-4), initial_scale=2.0**15)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((32, 4), "float32"), np.full((32, 1), 300.0, "float32")
    # The float16 gradient of the output, 2 * 300 / 4 * 2**15 ~ 4.9e6, overflows at the initial
    # scale: steps are skipped until the scale has backed off; the loss itself stays finite.
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    applied = int(optimizer.iterations.numpy())
    assert applied < 16  # guard: steps were skipped
    assert float(optimizer.dynamic_scale.numpy()) < 2.0**15  # guard: the scale backed off
    assert set(history.history) == {"loss"} and all(np.isfinite(history.history["loss"]))
    # No counter says how many: neither the logs nor the optimizer's variables.
    names = {v.path.split("/")[-1] for v in optimizer.variables}
    assert not {"overflow_count", "total_steps", "skipped_steps"} & names and not hasattr(optimizer, "overflow_count")

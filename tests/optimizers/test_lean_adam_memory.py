"""LeanAdam's update of a large weight under XLA holds only the new compensation half beside the
state (TF allocator peak, in a process of its own: TF's CPU allocator reports a peak only as BFC)."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os
import numpy as np, tensorflow as tf, keras, keras_amp
from keras_amp.optimizers import LeanAdam, lean_adam

keras_amp.enable("mixed_bfloat16")
result = {}
for path, chunk in (("in_place", lean_adam.CHUNK_ELEMENTS), ("kernel", 1 << 30)):
    lean_adam.CHUNK_ELEMENTS = chunk
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(2048, use_bias=False)])
    opt = LeanAdam(1e-3)
    keras_amp.memory.prepare(model, opt)
    opt.build(model.trainable_variables)
    grads = [tf.constant(np.random.RandomState(0).randn(1024, 2048).astype("float32") * 1e-3)]
    step = tf.function(lambda: opt.apply(grads, model.trainable_variables))
    step(); step()
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    result[path] = (peak - before) / (1024 * 2048)  # bytes per parameter held beside the state
print("RESULT " + json.dumps(result))
"""


def test_a_large_weights_update_holds_two_bytes_a_parameter_beside_the_state_not_eight():
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    per_param = json.loads(lines[-1][len("RESULT "):])
    # In place: the new low half (2 bytes) and nothing of the weight's size else.
    assert per_param["in_place"] <= 2.1, per_param
    # The single kernel's outputs: the whole new state (8 bytes) until assigned, and its temporaries.
    assert per_param["kernel"] >= 8.0, per_param

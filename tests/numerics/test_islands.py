"""keras_amp.numerics.islands: variables read as float32 inside an autocast scope, the calling-layer
stack, and weight casts made once before an RNN's time loop instead of at every step."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend import AutocastScope

from keras_amp import hardware
from keras_amp.numerics import islands
from keras_amp.numerics.islands import float32_value
from tests.helpers import MIXED, while_bodies

# 1 + 2**-8 + 2**-20: bfloat16 rounds it up to 1 + 2**-7 (above the midpoint 1 + 2**-8); through
# float16 first it becomes 1 + 2**-8, which bfloat16 rounds (a tie, to even) down to 1.
JUST_ABOVE_A_BFLOAT16_TIE = 1 + 2.0**-8 + 2.0**-20


@pytest.mark.parametrize("mixed_policy", MIXED, ids=lambda p: p)
def test_float32_value_reads_float32_inside_a_16_bit_autocast_scope(mixed_policy):
    """Guard for the private `AutocastScope` read: inside a compute-dtype scope (what Keras opens
    around a mixed layer called outside a model) `float32_value` still gives the float32 value."""
    keras.config.set_dtype_policy(mixed_policy)
    compute = keras.dtype_policies.get(mixed_policy).compute_dtype
    v = keras.Variable(np.float32(1 + 2.0**-20))  # not representable in float16/bfloat16
    with AutocastScope(compute):
        assert keras.backend.standardize_dtype(v.value.dtype) == compute  # guard: the scope autocasts
        got = float32_value(v)
    assert got.dtype == tf.float32 and float(got) == 1 + 2.0**-20


class _Recorder(keras.layers.Layer):
    def __init__(self, seen, **kwargs):
        super().__init__(**kwargs)
        self.record = seen.append  # a list attribute would be a tracked copy

    def call(self, x):
        self.record([layer.name for layer in islands.calling_layers()])
        return x


class _Outer(keras.layers.Layer):
    def __init__(self, seen, **kwargs):
        super().__init__(**kwargs)
        self.inner = _Recorder(seen, name="inner")

    def call(self, x):
        return self.inner(x)


def test_calling_layers_are_the_running_calls_innermost_first():
    seen = []
    x = np.ones((1, 2), "float32")
    _Outer(seen, name="outer")(x)
    inp = keras.Input((2,))
    keras.Model(inp, _Outer(seen, name="outer_in_model")(inp), name="model")(x)
    assert seen[0] == ["inner", "outer"]
    assert seen[-1] == ["inner", "outer_in_model", "model"]
    assert islands.calling_layers() == []  # outside any call


def test_cast_weight_rounds_the_float32_value_once_even_in_an_autocast_scope():
    v = keras.Variable(np.float32(JUST_ABOVE_A_BFLOAT16_TIE))
    with AutocastScope("float16"):
        autocast = float(tf.cast(v.value, tf.bfloat16))
        got = islands.cast_weight(v, tf.bfloat16)
    assert autocast == 1.0  # guard: the autocast read rounds twice (to float16, then bfloat16)
    assert got.dtype == tf.bfloat16 and float(got) == 1 + 2.0**-7  # the float32 value, rounded once
    tensor = tf.constant(np.float32(JUST_ABOVE_A_BFLOAT16_TIE))
    assert float(islands.cast_weight(tensor, tf.float16)) == 1 + 2.0**-8  # a tensor: a plain cast


class _CastingCell(keras.layers.Layer):
    """h_t = h_{t-1} + x_t @ kernel, the kernel cast to bfloat16 by `cast_weight` at each step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state_size = 3

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(4, 3), initializer="ones")

    def call(self, x, states):
        kernel = islands.cast_weight(self.kernel, tf.bfloat16)
        h = states[0] + tf.cast(tf.matmul(tf.cast(x, tf.bfloat16), kernel), tf.float32)
        return h, [h]


def _kernel_casts(graph):
    return [op for op in graph.get_operations()
            if op.type == "Cast" and op.outputs[0].dtype == tf.bfloat16 and tuple(op.outputs[0].shape) == (4, 3)]


@pytest.mark.parametrize("unroll", [False, True], ids=["loop", "unrolled"])
def test_cast_weight_in_an_rnn_time_loop_is_made_before_the_loop(unroll):
    rnn = keras.layers.RNN(_CastingCell(), unroll=unroll)
    graph = tf.function(rnn).get_concrete_function(tf.TensorSpec((2, 5, 4))).graph
    bodies = list(while_bodies(graph))
    if unroll:
        assert not bodies and len(_kernel_casts(graph)) == 5  # no loop: one cast per step
    else:
        assert len(bodies) == 1  # guard: the RNN ran a tf.while_loop
        assert _kernel_casts(bodies[0]) == []
        # Before the loop: the hoisted cast, and the step Keras's `rnn` runs once for the output structure.
        assert len(_kernel_casts(graph)) == 2
    # Five steps of ones(4) @ ones(4, 3): every state entry is 5 * 4, exact in bfloat16.
    np.testing.assert_array_equal(rnn(np.ones((2, 5, 4), "float32")).numpy(), np.full((2, 3), 20.0))


def test_cast_weight_in_another_loop_stays_in_it():
    # A loop that is not an RNN's (a custom training loop) may assign the weight between iterations.
    v = keras.Variable(np.ones((4, 3), "float32"))

    @tf.function
    def run():
        def body(i, total):
            v.assign_add(tf.ones((4, 3)))
            return i + 1, total + tf.cast(tf.reduce_sum(islands.cast_weight(v, tf.bfloat16)), tf.float32)

        return tf.while_loop(lambda i, _: i < 3, body, (tf.constant(0), tf.constant(0.0)))[1]

    graph = run.get_concrete_function().graph
    assert [len(_kernel_casts(body)) for body in while_bodies(graph)] == [1]
    assert float(run()) == 12 * (2 + 3 + 4)  # read after each assignment: 2, 3 and 4 in all 12 entries


def test_onednn_bfloat16_kernels_is_bfloat16_on_a_native_cpu_in_graphs_outside_xla_and_saving(monkeypatch, tmp_path):
    monkeypatch.setattr(islands, "native_bfloat16_cpu", lambda: True)
    seen = {}

    @tf.function
    def graph():
        seen["graph"] = (islands.onednn_bfloat16_kernels("bfloat16"), islands.onednn_bfloat16_kernels(tf.float16))
        return tf.constant(0.0)

    @tf.function(jit_compile=True)
    def compiled():
        seen["xla"] = islands.onednn_bfloat16_kernels("bfloat16")
        return tf.constant(0.0)

    graph()
    compiled()
    module = tf.Module()
    module.f = tf.function(lambda: graph.python_function(), input_signature=[])
    seen["graph"], graph_seen = None, seen["graph"]
    tf.saved_model.save(module, str(tmp_path / "saved"))  # traced again while the SavedModel is written
    assert graph_seen == (True, False) and seen["xla"] is False and seen["graph"] == (False, False)
    assert islands.onednn_bfloat16_kernels("bfloat16")  # eager: the ops run as they come
    monkeypatch.setattr(islands, "native_bfloat16_cpu", lambda: False)  # a GPU, or no native bfloat16
    graph.python_function()
    assert seen["graph"] == (False, False)


def test_cpu_kernels_is_16_bit_on_a_cpu_alone_in_graphs_outside_xla_and_saving(monkeypatch, tmp_path):
    monkeypatch.setattr(islands, "cpu_alone", lambda: True)
    seen = {}

    @tf.function
    def graph():
        seen["graph"] = tuple(islands.cpu_kernels(d) for d in ("bfloat16", tf.float16, "float32"))
        return tf.constant(0.0)

    @tf.function(jit_compile=True)
    def compiled():
        seen["xla"] = islands.cpu_kernels("float16")
        return tf.constant(0.0)

    graph()
    compiled()
    graph_seen = seen["graph"]
    module = tf.Module()
    module.f = tf.function(lambda: graph.python_function(), input_signature=[])
    tf.saved_model.save(module, str(tmp_path / "saved"))  # traced again while the SavedModel is written
    assert graph_seen == (True, True, False) and seen["xla"] is False and seen["graph"] == (False, False, False)
    assert islands.cpu_kernels("bfloat16")  # eager
    monkeypatch.setattr(islands, "cpu_alone", lambda: False)  # a GPU or TPU beside the CPU
    graph.python_function()
    assert seen["graph"] == (False, False, False)
    monkeypatch.undo()
    assert islands.cpu_alone() == (not hardware.detect().gpus and not hardware.detect().tpu_count)

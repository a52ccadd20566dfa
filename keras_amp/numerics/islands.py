"""Float32-island helpers: variables read as float32, weight casts, the calling-layer stack.

Shared by the float32-island layers (`keras_amp.layers`) and the matmul rule
(`keras_amp.op_rules.matmul`, for `keras_amp.matmul16_policy`).
"""

import keras
import tensorflow as tf
from keras import ops

from keras_amp import _compat

# No public API reads a variable without autocasting (Keras 3.15.1), nor lists the calling layers;
# the private objects below are keras_amp._compat pins.
_AUTOCAST_SCOPE = _compat.original("keras.src.backend.common.variables.AutocastScope")
_GET_GLOBAL = _compat.original("keras.src.backend.common.global_state.get_global_attribute")
_WHILE_BODY = _compat.original("tensorflow.python.ops.control_flow_v2_func_graphs.WhileBodyFuncGraph")
_COND_BRANCH = _compat.original("tensorflow.python.ops.control_flow_v2_func_graphs.CondBranchFuncGraph")


def float32_variables():
    """Context in which variables are read as stored (float32), never autocast.

    `autocast=False` on a layer does not stop Keras (3.15.1) from opening a compute-dtype
    `AutocastScope` when a mixed-policy layer is called outside any model, so islands
    read their weights and state variables inside this.
    """
    _compat.require(_compat.FLOAT32_LAYERS)
    return _AUTOCAST_SCOPE(None)


def float32_value(variable):
    """The float32 value of a float32 variable, never autocast."""
    with float32_variables():
        return ops.cast(variable.value, "float32")


def autocast_scope_dtype():
    """The dtype Keras's current `AutocastScope` casts variables to, or None (no scope, or off)."""
    if _GET_GLOBAL is None:
        return None
    scope = _GET_GLOBAL("autocast_scope")
    return None if scope is None else scope.dtype


def calling_layers():
    """The layers whose `call` is running, innermost first: `Layer.__call__` (Keras 3.15) runs
    `call` inside `backend.name_scope(self.name, caller=self)`, which Keras keeps on its
    thread-local "name_scope_stack"."""
    if _GET_GLOBAL is None:
        return []  # the features reading it (float32 islands, the matmul rule) are off and said so
    stack = _GET_GLOBAL("name_scope_stack")
    return [e.caller for e in reversed(stack or ()) if getattr(e, "caller", None) is not None]


def _rnn_loop_outer_graph():
    """The graph around the innermost RNN's time loop, when the current op is built in that loop's
    body (through `tf.cond` branches, if any) and that RNN runs a loop (`unroll=False`); else None.

    Only the RNN's own loop: a loop around the RNN (a custom training loop under `tf.function`)
    may assign the weights between its iterations, so a read must not leave it.
    """
    rnn = next((layer for layer in calling_layers() if isinstance(layer, keras.layers.RNN)), None)
    if rnn is None or rnn.unroll:
        return None
    graph = tf.compat.v1.get_default_graph()
    if _WHILE_BODY is None or _COND_BRANCH is None:
        return None  # no hoisting: the cast stays in the loop (correct, slower; the feature warned)
    while isinstance(graph, _COND_BRANCH):
        graph = graph.outer_graph
    if not isinstance(graph, _WHILE_BODY):
        return None
    return graph.outer_graph


def cast_weight(x, dtype):
    """`x` cast to `dtype`; a Keras variable read in an RNN's time loop is cast once, before it.

    An RNN's cell reads its kernels at every step of its `tf.while_loop`: cast there, the 16-bit
    copy is made at every step and, for the backward pass, kept once per step (64 steps of a
    2x256-unit LSTM: ~100 MiB; stock's autocast does the same). Cast in the graph around the
    loop, it is one loop-invariant tensor the body captures; TensorFlow's while-loop gradient
    sums its gradient over the steps, as for any captured tensor. A layer's weights do not
    change during its own call.
    """
    if not isinstance(x, keras.Variable):
        return tf.cast(x, dtype)
    outer = _rnn_loop_outer_graph()
    if outer is None:
        return tf.cast(float32_value(x), dtype)
    with outer.as_default():
        return tf.cast(float32_value(x), dtype)

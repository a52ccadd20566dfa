"""Float32-island helpers: variables read as float32, weight casts, the calling-layer stack.

Shared by the float32-island layers (`keras_amp.layers`), the matmul rule (`keras_amp.op_rules.matmul`,
for `keras_amp.matmul16_policy` and for a weight's product on float32 kernels), the einsum-rows rule and
the convolution-gradient rule (`float32_kernels`, `onednn_bfloat16_kernels`, `cpu_kernels`).
"""

import functools

import keras
import tensorflow as tf
from keras import ops

from keras_amp import _compat, hardware
from keras_amp.custom_gradient import custom_gradient

# No public API reads a variable without autocasting (Keras 3.15.1), nor lists the calling layers;
# the private objects below are keras_amp._compat pins.
_AUTOCAST_SCOPE = _compat.original("keras.src.backend.common.variables.AutocastScope")
_GET_GLOBAL = _compat.original("keras.src.backend.common.global_state.get_global_attribute")
_WHILE_BODY = _compat.original("tensorflow.python.ops.control_flow_v2_func_graphs.WhileBodyFuncGraph")
_COND_BRANCH = _compat.original("tensorflow.python.ops.control_flow_v2_func_graphs.CondBranchFuncGraph")
_in_xla_context = _compat.original("tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext")
_in_save_context = _compat.original("tensorflow.python.saved_model.save_context.in_save_context")


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
    loop, it is one loop-invariant tensor the body captures. TensorFlow's while-loop gradient
    sums a captured tensor's gradient over the steps in that tensor's dtype, 16 bits here: a
    matmul by a loop weight goes through `weight_matmul`, which sums it in float32. A layer's
    weights do not change during its own call.
    """
    if not isinstance(x, keras.Variable):
        return tf.cast(x, dtype)
    outer = _rnn_loop_outer_graph()
    if outer is None:
        return tf.cast(float32_value(x), dtype)
    with outer.as_default():
        return tf.cast(float32_value(x), dtype)


def weight_matmul(x, weight, dtype, columns=None, matmul=tf.matmul):
    """`x @ cast(weight[:, columns], dtype)` in `dtype` (`x` already in it); `columns` a `slice`.

    In an RNN's time loop (`weight` a Keras variable) the float32 read, the column slice and the
    16-bit cast are made once, before the loop (as `cast_weight`), and the weight's gradient is
    summed over the steps in float32: each step's 16-bit `x^T dy` is upcast and added to a float32
    sum. Summed in 16 bits (TensorFlow's sum for the captured 16-bit copy), a bfloat16 sum of
    ones stops at 256, and a 256-step LSTM's kernel gradients end 3-4x further from float64
    (tests/numerics/test_loop_weight_gradient.py). `matmul` computes the forward product.

    Where the CPU has no 16-bit matmul kernels of its own (`float32_kernels`: Eigen's bfloat16 MatMul,
    slower than its float32 one and truncating its sums), the products forward and backward are
    float32 kernels' on exact upcasts of the 16-bit operands, each rounded once to `dtype` (the
    loop's weight gradient is not rounded: it is summed in float32). In the loop the weight's float32
    upcast, made once before it, takes the place of its 16-bit copy; the activation's upcast is made
    again in the backward pass rather than kept.
    """
    upcast = float32_kernels(dtype)
    outer = _rnn_loop_outer_graph() if isinstance(weight, keras.Variable) else None
    if outer is None:
        w = float32_value(weight) if isinstance(weight, keras.Variable) else weight
        w = w if columns is None else w[:, columns]
        w16 = tf.cast(w, dtype)
        return upcast_matmul(x, w16, matmul) if upcast else matmul(x, w16)
    with outer.as_default():
        w32 = float32_value(weight)
        w32 = w32 if columns is None else w32[:, columns]
        w = tf.cast(w32, dtype)
        w = tf.cast(w, tf.float32) if upcast else w  # the 16-bit copy, or its exact upcast alone
    return _float32_summed_matmul(x, w, w32, matmul)


def _own_kernels_now() -> bool:
    """Whether an op built now runs on TensorFlow's own kernels: outside XLA (its own kernels) and outside a
    SavedModel being written (it may be served on another device)."""
    if _in_xla_context is None or _in_save_context is None or _in_save_context():
        return False
    return tf.executing_eagerly() or not _in_xla_context(tf.compat.v1.get_default_graph())


def float32_kernels(dtype) -> bool:
    """Whether a 16-bit `dtype` product (matmul, convolution) built now runs on float32 kernels from
    exact upcasts: where this device's 16-bit kernels are Eigen's (`hardware.emulated`), outside XLA
    and outside a SavedModel being written (`_own_kernels_now`)."""
    dtype = tf.as_dtype(dtype)
    return dtype in (tf.bfloat16, tf.float16) and hardware.emulated(dtype.name) and _own_kernels_now()


@functools.lru_cache(maxsize=None)
def cpu_alone() -> bool:
    """Whether this machine's devices are a CPU alone (no GPU, no TPU)."""
    device = hardware.detect()
    return not device.gpus and not device.tpu_count


@functools.lru_cache(maxsize=None)
def native_bfloat16_cpu() -> bool:
    """Whether this machine's devices are a CPU alone whose oneDNN runs bfloat16 natively."""
    return cpu_alone() and hardware.detect().cpu_fast_bfloat16


def onednn_bfloat16_kernels(dtype) -> bool:
    """Whether a `dtype` op built now runs on oneDNN's native bfloat16 kernels: bfloat16, a CPU alone
    whose oneDNN runs bfloat16 natively, outside XLA and outside a SavedModel being written."""
    return tf.as_dtype(dtype) == tf.bfloat16 and native_bfloat16_cpu() and _own_kernels_now()


def cpu_kernels(dtype) -> bool:
    """Whether a 16-bit `dtype` op built now runs on TensorFlow's CPU kernels: a CPU alone, outside XLA and
    outside a SavedModel being written."""
    return tf.as_dtype(dtype) in (tf.bfloat16, tf.float16) and cpu_alone() and _own_kernels_now()


def _rows(t):
    """`t` as a 2-D matrix of its rows (its last axis kept; known statically or not)."""
    last = t.shape[-1] if t.shape.rank is not None else None
    return tf.reshape(t, [-1, last if last is not None else tf.shape(t)[-1]])


def _float32_forward(x, w, matmul):
    """`matmul(x, w)` from float32 kernels on exact upcasts, rounded once to `x`'s dtype."""
    return tf.cast(matmul(tf.cast(x, tf.float32), tf.cast(w, tf.float32)), x.dtype)


def _float32_backward(x, w, dy):
    """The float32 gradients (dx, dw) of `x @ w` (`x` of rank 2 or more, `w` 2-D) from exact upcasts,
    made in the backward pass (not kept); both as 2-D matmuls of the rows."""
    dy32 = tf.cast(dy, tf.float32)
    with tf.control_dependencies([dy]):
        x32, w32 = tf.cast(x, tf.float32), tf.cast(w, tf.float32)
    dx = tf.matmul(_rows(dy32), w32, transpose_b=True)
    if dy.shape.rank != 2:
        dx = tf.reshape(dx, tf.shape(x))
    return dx, tf.matmul(_rows(x32), _rows(dy32), transpose_a=True)


def _float32_summed_matmul(x, w, w32, matmul):
    """`matmul(x, w)` in `x`'s dtype, `w` the 16-bit weight or (float32 kernels, `weight_matmul`) its
    float32 upcast; the gradient goes to `x` (16-bit) and to `w32` (float32), none to `w`."""
    upcast = w.dtype == tf.float32

    @custom_gradient
    def product(x, w, w32):
        def grad(dy):
            if upcast:
                dx, dw = _float32_backward(x, w, dy)
                return tf.cast(dx, x.dtype), None, dw
            dx = tf.matmul(dy, w, transpose_b=True)
            dw = tf.matmul(_rows(x), _rows(dy), transpose_a=True)
            return dx, None, tf.cast(dw, w32.dtype)

        return (_float32_forward(x, w, matmul) if upcast else matmul(x, w)), grad

    return product(x, w, w32)


def upcast_matmul(x, w16, matmul=tf.matmul):
    """`matmul(x, w16)` (`x` 16-bit of rank 2 or more, `w16` a 2-D weight of its dtype) from float32
    kernels on exact upcasts, each product rounded once, forward and backward (`float32_kernels`)."""

    @custom_gradient(transparent=True)  # the gradient of the same product, from float32 kernels
    def product(x, w16):
        def grad(dy):
            dx, dw = _float32_backward(x, w16, dy)
            return tf.cast(dx, x.dtype), tf.cast(dw, w16.dtype)

        return _float32_forward(x, w16, matmul), grad

    return product(x, w16)

"""`custom_gradient`: `tf.custom_gradient` whose graph-mode gradient is freed with its graph.

In graph mode (inside `tf.function`, where `fit` runs) TensorFlow 2.21's `tf.custom_gradient`
registers each call's gradient closure in the process-wide gradient registry under a fresh name
and never removes it. The closure holds the call's tensors, so every traced graph that used it
stays in memory for the life of the process: a `fit` after each `make_train_function(force=True)`
(fallback, schedule), every candidate of `search_precision`, every retrace. Measured on a
keras.applications DenseNet121 step: +0.25 GiB per trace, never returned.

This version registers one gradient function, once, that finds the closure on the op itself
(`op._keras_amp_backward`, the IdentityN's Python object, which the graph keeps): graph, op and
closure form a cycle that Python's collector frees with the graph. Otherwise it does what
TensorFlow's graph mode does (an IdentityN over results and inputs, its gradient overridden, the
call recorded on the active tapes), except that the gradient's ops are named as TensorFlow names an
op's gradient ("gradient_tape/<forward scope>/", `backward_scope`), not at the root scope. Eager
calls use `tf.custom_gradient` as it is (nothing leaks there). Restrictions, as keras_amp uses it:
positional tensor arguments, no variables read inside `f` (their gradient would need
`grad_fn(..., variables=...)`), no composite tensors. A SavedModel keeps the forward pass; its
gradient fails if run.
"""

from __future__ import annotations

import functools
from typing import Callable

import tensorflow as tf

from keras_amp import _compat

_NAME = "KerasAmpCustomGradient"
_ATTR = "_keras_amp_backward"
_TRANSPARENT = "_keras_amp_transparent"
_record_operation = _compat.original("tensorflow.python.eager.record.record_operation")


UNSAVED = ("keras_amp's custom gradients are not saved in a SavedModel (they share one gradient type, so a "
           "saved one would be the first op's for every op); the saved forward pass is complete. To differentiate "
           "a loaded model, export it after keras_amp.disable()")


@tf.RegisterGradient(_NAME)
def _dispatch(op, *grads):
    if op is None:
        # `tf.saved_model.save` traces each custom gradient type's function once, with no op: the
        # saved gradient fails if run (differentiating through a loaded model: `UNSAVED`, or TF's
        # binding error where another op's inputs differ), where one op's closure would silently
        # stand for all of them.
        with tf.control_dependencies([tf.debugging.Assert(False, [UNSAVED])]):
            return [tf.identity(g) for g in grads]
    return getattr(op, _ATTR)(*grads)


def is_transparent(op: tf.Operation) -> bool:
    """Whether `op` is the IdentityN of a `custom_gradient(transparent=True)` call."""
    return op.type == "IdentityN" and getattr(op, _TRANSPARENT, False)


def backward_scope() -> str:
    """The name scope TensorFlow gives an op's gradient ops, "gradient_tape/<forward scope>/", for
    the current scope. A custom gradient's ops would be made at the root scope (TF 2.21, both
    `tf.custom_gradient` and a recorded backward), where neither the diagnostics' op-to-layer
    attribution nor a profile could tell them from the forward pass's; `custom_gradient` runs each
    `grad_fn` in the scope taken when its forward ops are built."""
    scope = tf.compat.v1.get_default_graph().get_name_scope()
    return f"gradient_tape/{scope}/" if scope else "gradient_tape/"


def _scoped(f: Callable, scope: str) -> Callable:
    """`f`, whose `grad_fn` runs in name scope `scope`."""

    def scoped(*args):
        result, grad_fn = f(*args)

        def grad(*upstream, **kwargs):
            with tf.name_scope(scope):
                return grad_fn(*upstream, **kwargs)

        return result, grad

    return scoped


def custom_gradient(f: Callable | None = None, *, transparent: bool = False) -> Callable:
    """Decorator like `tf.custom_gradient`: `f(*args)` returns `(result, grad_fn)`, where
    `grad_fn(*upstream)` (one upstream gradient per flattened result) returns the gradients of
    `args`. See the module docstring for what differs and what is not supported.

    `transparent=True` (as `@custom_gradient(transparent=True)`) declares that `grad_fn` is the
    gradient of the ops in `f`, only computed better (the bias rule's float32 sum): a graph rewrite
    (the dataflow rules) may then look through the IdentityN (`is_transparent`) and rebuild those
    ops with their own gradients. Any other custom gradient stops the walks, so it is never lost.
    """
    if f is None:
        return functools.partial(custom_gradient, transparent=transparent)
    eager_version = tf.custom_gradient(f)

    @functools.wraps(f)
    def wrapper(*args):
        if tf.executing_eagerly():
            return eager_version(*args)
        scope = backward_scope()
        if _record_operation is None or not _compat.warn_off(_compat.GRADIENTS):
            return tf.custom_gradient(_scoped(f, scope))(*args)
        args = [tf.convert_to_tensor(a) for a in args]
        graph = tf.compat.v1.get_default_graph()
        result, grad_fn = _scoped(f, scope)(*args)
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(result)]
        count = len(flat)

        def backward(*upstream):
            grads = grad_fn(*upstream[:count])
            grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
            return [None] * count + grads

        with graph.gradient_override_map({"IdentityN": _NAME}):
            outputs = tf.identity_n(flat + args)
        setattr(outputs[0].op, _ATTR, backward)
        if transparent:
            setattr(outputs[0].op, _TRANSPARENT, True)
        _record_operation(f.__name__, outputs, flat + args, backward)
        return tf.nest.pack_sequence_as(result, outputs[:count])

    return wrapper

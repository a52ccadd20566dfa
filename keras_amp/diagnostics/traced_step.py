"""One diagnostic training step: forward, loss, scaled backward, each graph op attributed to a layer.

`find_overflow` and the gradient statistics stand on this module. The step runs in its own
`tf.function` (compiled with XLA when asked), applies nothing, and puts back every non-trainable
variable it touched (batch-norm statistics, dropout seeds), so the model leaves it as it came.
Each op's layer comes from `keras_amp.diagnostics.attribution`, recorded while the step is traced.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from keras_amp import losses as amp_losses
from keras_amp import model_graph
from keras_amp import validation
from keras_amp.diagnostics.attribution import Trace, assign_owners, attributing

# The reference backward pass runs at this multiple of the scale (2**12: lifts float16 values
# from below its smallest subnormal, 6e-8, into range, without overflowing typical gradients).
REFERENCE_FACTOR = 4096.0


def current_loss_scale(model: keras.Model) -> float:
    """The loss scale `model`'s next training step runs at: its optimizer's current scale or,
    before the optimizer is built, the scale its first step will use (keras_amp's tier "auto"
    picks it from the trainable variables, which `fit` builds it with). 1.0 without a
    LossScaleOptimizer."""
    opt = getattr(model, "optimizer", None)
    if not isinstance(opt, keras.optimizers.LossScaleOptimizer):
        return 1.0
    if opt.built:
        return float(keras.ops.convert_to_numpy(opt.dynamic_scale))
    first_scale = getattr(opt, "initial_scale_for", None)  # keras_amp's LossScaleOptimizer
    if first_scale is not None:
        return float(first_scale(model.trainable_variables))
    initial = getattr(opt, "initial_scale", None)
    return float(initial) if initial is not None else 2.0**15


def resolve_loss(model: keras.Model, y: Any, loss: Any) -> Callable:
    """`fn(x, y, y_pred) -> scalar loss` from `loss`, the compiled loss, or a label-free surrogate."""
    if loss is not None:
        if isinstance(loss, (str, dict)):
            try:
                fn = keras.losses.get(loss)
            except ValueError:
                raise ValueError(
                    f"Unknown `loss`. Received: loss={loss!r}. Allowed: a Keras loss name or a callable"
                ) from None
        else:
            fn = loss
        validation.check_callable("loss", fn)
        if y is None:
            raise ValueError("`y` is needed with an explicit `loss`. Received: y=None, "
                             f"loss={loss!r}. Allowed: the labels of `x`, or loss=None")
        fn = amp_losses.as_compiled(fn)  # as fit computes it: in float32, whatever the outputs' dtype
        return lambda x, y, y_pred: keras.ops.mean(fn(y, y_pred))
    if y is None:
        # No labels: the mean of the outputs reaches every layer's gradient, which is what the
        # overflow and underflow counts need; the magnitudes differ from a real loss's.
        def surrogate(x, y, y_pred):
            flat = [keras.ops.mean(keras.ops.cast(t, "float32")) for t in keras.tree.flatten(y_pred)]
            return keras.ops.sum(keras.ops.stack(flat))
        return surrogate
    if getattr(model, "compiled", False) and getattr(model, "loss", None) is not None:
        return lambda x, y, y_pred: model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
    raise ValueError("A loss is needed for labels `y`: compile the model with a loss or pass "
                     "`loss=`. Received: loss=None and a model compiled without a loss. Allowed: a "
                     "Keras loss name or callable, or y=None (the mean of the outputs stands in)")


def own_trainable_variables(layer: Any, *, tree: model_graph.LayerTree | None = None) -> list:
    """The trainable variables of `layer` that none of its sublayers owns.

    `tree`: a `model_graph.LayerTree` holding `layer`, when the caller has read one (None: read
    `layer`'s sublayers from it).
    """
    children = model_graph.children(layer) if tree is None else tree.children(layer)
    inner = {id(v) for child in children for v in child.trainable_weights}
    return [v for v in layer.trainable_weights if id(v) not in inner]


def weighted_layers(model: keras.Model, *, tree: model_graph.LayerTree | None = None) -> list[tuple[str, Any, list]]:
    """`(path, layer, own trainable variables)` for every layer under `model` owning some, in model order.

    `tree`: the model's `model_graph.layer_tree`, when the caller has read it (None: walked here).
    """
    tree = model_graph.layer_tree(model, tree)
    found = []
    own = own_trainable_variables(model, tree=tree)
    if own:
        found.append((model.name, model, own))
    for path, layer in model_graph.walk(model, tree=tree):
        own = own_trainable_variables(layer, tree=tree)
        if own:
            found.append((path, layer, own))
    return found


class DiagnosticStep:
    """A compiled forward + scaled-backward step of `model` on one batch, with reductions attached.

    `reduce(trace, grads, reference, loss)` runs inside the traced function after the backward
    pass and returns a nested structure of tensors; `run(scale)` executes the step and returns
    it as NumPy values. `reference` holds the same gradients at `REFERENCE_FACTOR` times the
    scale: an element that is 0 at the scale but not in the reference underflowed (a gradient
    that is truly 0, such as an embedding row not looked up, is 0 in both).

    Args:
        model: Built `keras.Model`.
        x, y: The batch (y may be None).
        loss: As `resolve_loss`.
        reduce: Callable `(trace, grads_by_layer, reference_by_layer, loss) -> nest of tensors`.
        training: Bool. The `training` argument of the forward pass.
        jit_compile: Bool. Compile the step with XLA.
        attribute: Bool. Record op owners (find_overflow) or not (cheaper statistics).
        tree: The model's `model_graph.layer_tree`, when the caller has read it; None (default):
            the model is walked once, when the step is first traced. An unbuilt model is built
            first and then walked again: building makes the sublayers a layer creates in `build()`.
    """

    def __init__(self, model, x, y, loss, reduce, *, training=True, jit_compile=False, attribute=True,
                 tree=None):
        self.model = model
        self._tree = tree
        self.x, self.y = x, y
        self._loss_fn = resolve_loss(model, y, loss)
        self._reduce = reduce
        self.training = training
        self.attribute = attribute
        self.trace = Trace()
        self.layers = None
        self._fn = tf.function(self._step, jit_compile=jit_compile, autograph=False)
        self._concrete = None

    def _step(self, x, y, scale):
        model = self.model
        graph = tf.compat.v1.get_default_graph()
        self.trace.graph = graph
        saved = [(v, tf.identity(v.value)) for v in model.non_trainable_variables]
        variables = [v for _, _, vs in self.layers for v in vs]
        model_start = len(graph.get_operations())
        with tf.GradientTape(persistent=True) as tape:
            y_pred = model(x, training=self.training)
            self.trace.model_outputs = [t for t in keras.tree.flatten(y_pred) if tf.is_tensor(t)]
            model_end = len(graph.get_operations())
            loss = keras.ops.cast(self._loss_fn(x, y, y_pred), "float32")
            scaled = loss * scale
        forward_end = len(graph.get_operations())
        zero = tf.UnconnectedGradients.ZERO
        grads = tape.gradient(scaled, variables, unconnected_gradients=zero)
        ops = graph.get_operations()  # the step as measured; the reference pass comes after
        # The loss's own gradient seeded with the factor: no extra forward op to measure.
        reference = tape.gradient(scaled, variables, output_gradients=tf.constant(REFERENCE_FACTOR),
                                  unconnected_gradients=zero)
        if self.attribute:
            assign_owners(self.trace, ops, forward_end, model_start, model_end, model.name)
        grads_by_layer, reference_by_layer, k = [], [], 0
        for _, _, vs in self.layers:
            grads_by_layer.append([tf.convert_to_tensor(g) for g in grads[k:k + len(vs)]])
            reference_by_layer.append([tf.convert_to_tensor(g) for g in reference[k:k + len(vs)]])
            k += len(vs)
        out = self._reduce(self.trace, grads_by_layer, reference_by_layer, loss)
        # Training-mode side effects (batch-norm statistics, seeds) are put back: diagnosis
        # must not move the model. Automatic control dependencies order these after the step.
        with tf.control_dependencies(tf.nest.flatten(out)):
            for v, value in saved:
                v.assign(value)
        return tf.nest.map_structure(tf.identity, out)

    def _build(self):
        model = self.model
        tree = self._tree
        if not model.built:
            model(self.x, training=False)  # variables must exist before tracing
            tree = None  # read before the build: without the sublayers build() made
        tree = model_graph.layer_tree(model, tree)
        self.layers = weighted_layers(model, tree=tree)
        x = keras.tree.map_structure(tf.convert_to_tensor, self.x)
        y = None if self.y is None else keras.tree.map_structure(tf.convert_to_tensor, self.y)
        scale = tf.constant(1.0, tf.float32)
        ctx = attributing(model, self.trace, tree=tree) if self.attribute else contextlib.nullcontext()
        with ctx:
            self._concrete = self._fn.get_concrete_function(x, y, scale)
        self._args = (x, y)

    def traced(self) -> Trace:
        """Traces the step (once, with attribution when asked) and returns what tracing recorded."""
        if self._concrete is None:
            self._build()
        return self.trace

    def run(self, scale: float):
        """Executes the step at loss scale `scale`; NumPy values of the reduction."""
        if self._concrete is None:
            self._build()
        x, y = self._args
        # The concrete function traced under attribution (calling self._fn could retrace).
        out = self._concrete(x, y, tf.constant(scale, tf.float32))
        return tf.nest.map_structure(lambda t: t.numpy(), out)


def float_info(dtype: str) -> np.finfo:
    """NumPy's float info for a Keras float dtype name (bfloat16 through ml_dtypes)."""
    if dtype == "bfloat16":
        import ml_dtypes
        return ml_dtypes.finfo(ml_dtypes.bfloat16)
    return np.finfo(np.dtype(dtype))

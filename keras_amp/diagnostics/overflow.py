"""`find_overflow()`: which layer first produces inf/NaN, forward and backward, and how close the rest come.

One batch runs forward and backward (at the loss scale training uses) in a step of its own, with
every graph op's output reduced to "all finite?" and "largest |value|". An op *produces* a
non-finite value when its output is non-finite while all of its inputs are finite; the first such
op in the forward pass, and the first in the backward pass, are reported with the layer that
created them. Layers that only pass a NaN on are not blamed. A cast at a float16/float32 boundary
(of a layer's input to its compute dtype, or that cast's gradient) is the layer's on its 16-bit
side, and `Producer.boundary` says what it cast. The reductions are outputs of the step, not
checks: unlike `tf.debugging.check_numerics`, they also run under XLA.

Because every intermediate value is fetched, graph rewrites that would drop an intermediate do
not happen in this step: grappler may compute `x * a * b` (scalars a, b) as `x * (a * b)` in a
training step, so an overflow of `x * a` that find_overflow reports can be absent from `fit`.
Matmuls, convolutions, exponentials and reductions are not rewritten that way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_amp import model_graph, validation
from keras_amp.diagnostics import attribution, gradient_probe
from keras_amp.diagnostics import traced_step as diag_step


_NOT_LAYERS = (attribution.INPUT, attribution.LOSS, attribution.GRADIENT_SUM)


@dataclasses.dataclass(frozen=True)
class Producer:
    """The first op that turned finite inputs into a non-finite output.

    Args:
        layer: String. Path of the layer that created the op ("(input)": the batch itself,
            "(loss)": the loss, "(gradient sum)": the sum of gradients of a reused tensor).
        op: String. The graph op's name.
        op_type: String. The op's type ("MatMul", "Exp", "Cast", "ReadVariableOp": the layer's
            weights are non-finite).
        phase: String. "forward" or "backward".
        boundary: String. For a cast between float widths (Keras's cast of a layer's input to its
            compute dtype, or that cast's gradient): what it casts, from which layer to which; "" otherwise.
    """

    layer: str
    op: str
    op_type: str
    phase: str
    boundary: str = ""


@dataclasses.dataclass(frozen=True)
class LayerOverflowStats:
    """One layer: its largest |activation|, headroom, and its gradient statistics.

    Args:
        path: String. Layer path.
        compute_dtype: String. The layer's compute dtype.
        output_dtype: String or None. Dtype of its output (an island may output float32).
        max_abs: Float or None. Largest finite |output| over the batch (None: no float output).
        nonfinite_output: Bool. Some output element is inf or NaN.
        headroom_bits: Float or None. log2(largest finite value of output_dtype / max_abs): how
            many doublings the activations can take before they overflow; inf for an all-zero
            output, None when the output already overflowed (or there is no float output).
        gradients: `LayerGradientStats` or None (a layer without trainable weights).
    """

    path: str
    compute_dtype: str
    output_dtype: str | None
    max_abs: float | None
    nonfinite_output: bool
    headroom_bits: float | None
    gradients: gradient_probe.LayerGradientStats | None = None


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """The result of `find_overflow`; `str()` is for people.

    Args:
        model: String. Model name.
        loss: Float. The (unscaled) loss of the batch.
        loss_scale: Float. The scale the backward pass ran at.
        forward: `Producer` or None.
        backward: `Producer` or None.
        backward_note: String. Why `backward` is None when it is ("" otherwise).
        layers: Tuple of `LayerOverflowStats`, in model order.
        data: Tuple of strings. Where the batch itself holds NaN/inf ("inputs: 1 of 128 values
            NaN/inf, first at row 3, feature 5"), one per input or label array; () when it is finite.
    """

    model: str
    loss: float
    loss_scale: float
    forward: Producer | None
    backward: Producer | None
    backward_note: str
    layers: tuple[LayerOverflowStats, ...]
    data: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """The batch is finite and no non-finite value was produced, forward or backward."""
        return self.forward is None and self.backward is None and not self.backward_note and not self.data

    def offending_layers(self) -> list[str]:
        """Paths of the producing layers, forward first (what to move to float32); the batch,
        the loss and gradient sums are not layers and are left out (a non-finite batch is in
        `data`)."""
        return list(dict.fromkeys(p.layer for p in (self.forward, self.backward)
                                  if p is not None and p.layer not in _NOT_LAYERS))

    def underflowing(self, threshold: float = 0.5) -> list[LayerOverflowStats]:
        """Layers losing at least `threshold` of their gradient elements to underflow (zero here
        but not at a 4096x larger scale) or to subnormals."""
        return [s for s in self.layers if s.gradients is not None
                and s.gradients.underflow_fraction >= threshold]

    def layer(self, path: str) -> LayerOverflowStats:
        """The stats of the layer at `path`."""
        for s in self.layers:
            if s.path == path:
                return s
        raise ValueError(f"No layer at `path`. Received: path={path!r}. Allowed: "
                         f"{', '.join(s.path for s in self.layers)}")

    def __str__(self) -> str:
        lines = [f"find_overflow({self.model!r}): loss={self.loss:.6g} at loss scale {self.loss_scale:g}"]
        for where in self.data:
            lines.append(f"  data: {where}: repair or filter the data first (the batch itself is not finite)")
        for phase, p in (("forward", self.forward), ("backward", self.backward)):
            if p is not None:
                lines.append(f"  {phase}: first non-finite value produced in layer {p.layer!r} "
                             f"(op {p.op_type} {p.op!r})" + (f": {p.boundary}" if p.boundary else ""))
            elif phase == "backward" and self.backward_note:
                lines.append(f"  backward: {self.backward_note}")
            else:
                lines.append(f"  {phase}: all values finite")
        width = max([len(s.path) for s in self.layers] + [5])
        lines.append(f"  {'layer':{width}} dtype     max|act|   headroom  grad zero  underfl  subnorm  non-fin")
        for s in self.layers:
            g = s.gradients
            act = "non-finite" if s.nonfinite_output else ("-" if s.max_abs is None else f"{s.max_abs:.3g}")
            room = "-" if s.headroom_bits is None else f"{s.headroom_bits:.1f} bits"
            gz = "-" if g is None else f"{g.zero_fraction:.1%}"
            gu = "-" if g is None else f"{g.underflow_zero_fraction:.1%}"
            gs = "-" if g is None else f"{g.subnormal_fraction:.1%}"
            gn = "-" if g is None else f"{g.nonfinite_fraction:.1%}"
            lines.append(f"  {s.path:{width}} {s.compute_dtype:9} {act:>10} {room:>10} {gz:>9} {gu:>8} "
                         f"{gs:>8} {gn:>8}")
        return "\n".join(lines)


def non_finite_data(x: Any, y: Any = None) -> tuple[str, ...]:
    """Where the floating-point arrays of `x` and `y` hold NaN/inf: one line per array.

    Names the array ("inputs", "inputs['ids']", "labels"), how many values are not finite, and
    the first one's row and, for 2-D arrays and beyond, its index past the batch axis ("feature").
    """
    found = []
    for part, value in (("inputs", x), ("labels", y)):
        if value is None:
            continue
        for path, leaf in keras.tree.flatten_with_path(value):
            if leaf is None or isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor)):
                continue
            try:
                array = np.asarray(leaf)
            except (TypeError, ValueError):
                continue
            if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
                continue
            bad = ~np.isfinite(array.astype("float32"))
            if not bad.any():
                continue
            name = part + "".join(f"[{k!r}]" for k in path)
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            where = f"first at row {first[0]}" if first else "a scalar"
            if len(first) == 2:
                where += f", feature {first[1]}"
            elif len(first) > 2:
                where += f", index {first[1:]}"
            found.append(f"{name}: {int(bad.sum())} of {bad.size} values NaN/inf, {where}")
    return tuple(found)


def _measured(trace: attribution.Trace) -> list[tuple[int, Any]]:
    """(op index, tensor) for every floating-point output of the step's ops."""
    return [(i, t) for i, op in enumerate(trace.ops) for t in op.outputs if t.dtype.is_floating]


def _finite_and_max(t):
    v = tf.cast(t, tf.float32)
    finite = tf.reduce_all(tf.math.is_finite(v))
    # Largest finite |value|, 0 for an empty or all-non-finite tensor.
    finite_abs = tf.where(tf.math.is_finite(v), tf.abs(v), tf.zeros_like(v))
    return finite, tf.reduce_max(tf.concat([tf.reshape(finite_abs, [-1]), [0.0]], 0))


class _Reducer:
    def __init__(self):
        self.measured = []
        self.layer_paths = []
        self.grad_dtypes = []

    def __call__(self, trace, grads_by_layer, reference_by_layer, loss, layers):
        self.measured = _measured(trace)
        flags, maxes = zip(*[_finite_and_max(t) for _, t in self.measured]) if self.measured else ((), ())
        self.layer_paths = [p for p, outs in trace.layer_outputs.items() if outs]
        per_layer = [[_finite_and_max(t) for t in trace.layer_outputs[p]] for p in self.layer_paths]
        layer_fin = [tf.stack([f for f, _ in pairs]) for pairs in per_layer]
        layer_max = [tf.stack([m for _, m in pairs]) for pairs in per_layer]
        self.grad_dtypes = [_float_dtype(layer.compute_dtype) for _, layer, _ in layers]
        return {
            "loss": loss,
            "finite": tf.stack(flags) if flags else tf.zeros([0], tf.bool),
            "max": tf.stack(maxes) if maxes else tf.zeros([0]),
            "layer_max": [tf.reduce_max(m) for m in layer_max],
            "layer_finite": [tf.reduce_all(f) for f in layer_fin],
            "grads": [gradient_probe.stats_tensors(g, d, r) for g, r, d
                      in zip(grads_by_layer, reference_by_layer, self.grad_dtypes)],
        }


def _float_dtype(dtype: str | None) -> str:
    return dtype if dtype and keras.backend.is_float_dtype(dtype) else "float32"


def _first_producer(trace, measured, finite, start, stop, phase) -> Producer | None:
    bad_ops = {}
    for (i, _), ok in zip(measured, finite):
        if not ok:
            bad_ops[i] = True
    index = {op.name: i for i, op in enumerate(trace.ops)}
    for i in sorted(bad_ops):
        if not start <= i < stop:
            continue
        op = trace.ops[i]
        if not any(bad_ops.get(index.get(t.op.name)) for t in op.inputs if t.dtype.is_floating):
            return Producer(layer=trace.owners[i], op=op.name, op_type=op.type, phase=phase,
                            boundary=_boundary(trace, i, start))
    return None


def _boundary(trace, i, start) -> str:
    """What a cast between float widths casts: whose output (forward) or gradient (backward), for which layer."""
    dtypes = attribution.float_cast(trace.ops[i])
    if dtypes is None:
        return ""
    src, dst = dtypes
    names = {attribution.INPUT: "the batch", attribution.LOSS: "the loss"}
    source = attribution.linked_owners(trace.ops, trace.owners, i, start, downstream=False)
    source = " and ".join(names.get(s, f"layer {s!r}") for s in source) or "outside the model"
    what, side = ("gradient", "output") if i >= trace.backward_start else ("values", "input")
    return (f"at a {src.name}/{dst.name} boundary, the {src.name} {what} from {source} cast to {dst.name} "
            f"for the {side} of layer {trace.owners[i]!r}")


def _check_batch(x: Any, y: Any) -> None:
    """TypeError or ValueError, before any graph runs, for a batch one step cannot run on."""
    if x is None:
        raise TypeError("`x` must be the model's input: an array, a tensor or the structure the model "
                        "takes. Received: x=None")
    rows = {}
    for name, value in (("x", x), ("y", y)):
        for path, leaf in [] if value is None else keras.tree.flatten_with_path(value):
            where = name + "".join(f"[{k!r}]" for k in path)
            try:
                tensor = leaf if tf.is_tensor(leaf) else tf.convert_to_tensor(leaf)
            except (TypeError, ValueError):
                tensor = None
            if tensor is None or name == "y" and not (tensor.dtype.is_floating or tensor.dtype.is_integer
                                                      or tensor.dtype.is_bool):
                allowed = "numbers (the labels)" if name == "y" else "values the model takes"
                got = (f"{where} of dtype {leaf.dtype}, shape {tuple(leaf.shape)}" if hasattr(leaf, "shape")
                       else f"{where}={leaf!r:.80} of type {type(leaf).__name__}")
                raise TypeError(f"`{where}` must be an array or tensor of {allowed}. Received: {got}")
            if len(tensor.shape) and tensor.shape[0] is not None:
                rows[where] = (int(tensor.shape[0]), tuple(tensor.shape))
    xs = {n for w, (n, _) in rows.items() if w[0] == "x"}
    if 0 in xs:
        raise ValueError("`x` must hold at least one sample (an empty batch has no loss to overflow). "
                         f"Received: x with batch size 0 (shapes {[s for w, (_, s) in rows.items() if w[0] == 'x']})")
    if len({n for n, _ in rows.values()}) > 1:
        need = ("`x` must hold the same number of samples in every array" if len(xs) > 1 else
                "`y` must hold one label row per sample of `x` (the same batch size)")
        raise ValueError(f"{need}. Received: {', '.join(f'{w} of shape {s}' for w, (_, s) in rows.items())}")


def _headroom(max_abs: float, dtype: str) -> float | None:
    if max_abs is None:
        return None
    if max_abs == 0.0:
        return math.inf
    return math.log2(float(diag_step.float_info(dtype).max) / max_abs)


def find_overflow(model: keras.Model, x: Any, y: Any = None, loss: Any = None, *,
                  loss_scale: float | None = None, training: bool = True,
                  jit_compile: bool | None = None,
                  tree: model_graph.LayerTree | None = None) -> OverflowReport:
    """Runs one batch forward and backward and names the layer that first produces inf/NaN.

    Reports where the batch itself holds NaN/inf (`data`: repair the data first); for the
    forward and for the backward pass, the first layer whose op turns finite
    inputs into a non-finite output (not the layers that pass it on); each layer's largest
    |activation| and its headroom in bits to its output dtype's limit (65504 for float16); and
    the fraction of each layer's weight-gradient elements that are zero, underflowed to zero
    (zero here, not at a 4096x larger scale) or subnormal in its compute dtype at the loss
    scale. The model is left as it was: nothing is applied, and training-mode state
    (batch-norm statistics) is put back.

    Args:
        model: A `keras.Model`: Sequential, functional, nested or subclassed.
        x: One batch of inputs.
        y: Its labels, or None: the mean of the outputs then stands in for the loss (enough to
            reach every gradient; magnitudes differ from the real loss's).
        loss: None (the compiled loss), a Keras loss name or a callable `loss(y_true, y_pred)`.
        loss_scale: Float > 0 or None: the scale of the backward pass. None takes the scale the
            model trains at (`traced_step.current_loss_scale`): its `LossScaleOptimizer`'s current scale,
            before the first step the one that step will use (1.0 without one).
        training: Bool, default True: the forward pass runs as in a training step.
        jit_compile: Bool or None. Run the step under XLA; None follows `model.jit_compile`.
        tree: `keras_amp.model_graph.LayerTree` or None (default: the model is walked once). The
            model's `model_graph.layer_tree(model)`, for a caller that has read it already.

    Returns:
        An `OverflowReport`.

    Example:
        >>> report = keras_amp.find_overflow(model, x_batch, y_batch)
        >>> print(report)               # producer forward/backward, per-layer headroom and underflow
        >>> report.offending_layers()   # ["block_3/attention"]: candidates for float32
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    _check_batch(x, y)
    training = validation.check_bool("training", training)
    if tree is not None:
        model_graph.layer_tree(model, tree)  # checked here: the step is traced later
    if jit_compile is None:
        jit_compile = getattr(model, "jit_compile", False) is True
    jit_compile = validation.check_bool("jit_compile", jit_compile)
    scale = diag_step.current_loss_scale(model) if loss_scale is None else validation.check_float(
        "loss_scale", loss_scale, min_value=0.0, min_inclusive=False, float32=True)

    reducer = _Reducer()
    holder: dict = {}

    def reduce(trace, grads_by_layer, reference_by_layer, loss_value):
        return reducer(trace, grads_by_layer, reference_by_layer, loss_value, holder["step"].layers)

    step = diag_step.DiagnosticStep(model, x, y, loss, reduce, training=training,
                                    jit_compile=jit_compile, attribute=True, tree=tree)
    holder["step"] = step
    out = step.run(scale)
    trace = step.trace

    forward = _first_producer(trace, reducer.measured, out["finite"], 0, trace.backward_start, "forward")
    backward, note = None, ""
    if forward is not None or not np.isfinite(out["loss"]):
        note = "not located: the forward pass is already non-finite (fix that first)"
    else:
        backward = _first_producer(trace, reducer.measured, out["finite"], trace.backward_start,
                                   len(trace.ops), "backward")

    grads = {path: gradient_probe.from_counts(path, d, c) for (path, _, _), d, c
             in zip(step.layers, reducer.grad_dtypes, out["grads"])}
    out_max = dict(zip(reducer.layer_paths, out["layer_max"]))
    out_fin = dict(zip(reducer.layer_paths, out["layer_finite"]))
    layers = []
    for path in list(trace.layer_dtypes) + [p for p in grads if p not in trace.layer_dtypes]:
        outputs = trace.layer_outputs.get(path, [])
        if path not in out_max and path not in grads:
            continue
        out_dtype = outputs[0].dtype.name if outputs else None
        max_abs = float(out_max[path]) if path in out_max else None
        layers.append(LayerOverflowStats(
            path=path, compute_dtype=_float_dtype(trace.layer_dtypes.get(path, model.compute_dtype)),
            output_dtype=out_dtype, max_abs=max_abs,
            nonfinite_output=bool(path in out_fin and not out_fin[path]),
            headroom_bits=_headroom(max_abs, out_dtype) if out_dtype and out_fin.get(path, True) else None,
            gradients=grads.get(path)))
    return OverflowReport(model=model.name, loss=float(out["loss"]), loss_scale=scale,
                          forward=forward, backward=backward, backward_note=note, layers=tuple(layers),
                          data=non_finite_data(x, y))

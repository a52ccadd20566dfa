"""Saved activations: what a training step keeps from its forward pass for its backward pass.

Activation memory is what mixed precision is meant to halve, and where float32 islands can quietly
take the saving back: a 16-bit activation cast up for a float32 op is kept, in float32, until the
backward pass (stock Keras's batch and layer normalisation, its losses). `saved_activations`
traces one training step (the `find_overflow` step: forward, loss, backward, nothing applied) and
lists every tensor the backward pass reads from the forward pass, with the layer that made it
(`keras_amp.diagnostics.attribution`), its dtype and size, and whether it is a float32 upcast of a
16-bit tensor: memory a float32 island need not keep (keras_amp's op rules redo such upcasts in
the backward pass). A view (a reshape, an identity) is one buffer with the tensor it views: counted
once. Variable reads and the batch itself, and views of them, are not activations and are left out.

Sizes come from static shapes, which a traced batch has; tensors without one (an RNN loop's
accumulators, TensorLists of every step's intermediates) are counted in `unsized`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import keras
import tensorflow as tf

from keras_amp import validation
from keras_amp.diagnostics import traced_step as diag_step
from keras_amp.op_rules.upcast_recompute import source16

MIB = float(1 << 20)
# Not activations: the batch, constants, variable reads (the weights exist anyway).
_NOT_ACTIVATIONS = ("Placeholder", "Const", "ReadVariableOp", "VarHandleOp")
# Ops whose output i is input i's buffer under another shape (TensorFlow forwards it, no copy).
_VIEWS = ("Reshape", "Identity", "ExpandDims", "Squeeze", "IdentityN")


def _storage(t: tf.Tensor) -> tf.Tensor:
    """The tensor whose buffer `t` is: `t` itself, or what it is a view of (a reshape, an identity).
    Three Dense layers on one sequence each reshape it for their matmul: one buffer, kept once."""
    while t.op.type in _VIEWS:
        t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
    return t


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One forward tensor the backward pass reads.

    Args:
        layer: String. Path of the layer whose call created it ("(loss)" for the loss).
        op: String. Name of the graph op producing it.
        dtype: String.
        shape: Tuple of ints.
        bytes: Int.
        upcast: Bool. A float32 tensor that is an exact upcast of a 16-bit one.
        early: Bool. Made by a gradient op that needs no incoming gradient, so it runs in the
            forward pass and is kept until the backward pass.
    """

    layer: str
    op: str
    dtype: str
    shape: tuple
    bytes: int
    upcast: bool
    early: bool = False


@dataclasses.dataclass(frozen=True)
class SavedActivationsReport:
    """The tensors one training step keeps for its backward pass.

    Args:
        tensors: Tuple of `SavedTensor`, largest first.
        unsized: Int. Saved tensors without a static size (loop accumulators).
    """

    tensors: tuple[SavedTensor, ...]
    unsized: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def upcast_bytes(self) -> int:
        """Bytes of float32 upcasts of 16-bit tensors: what keeping the 16-bit tensor would halve."""
        return sum(t.bytes for t in self.tensors if t.upcast)

    def by_dtype(self) -> dict[str, int]:
        """dtype -> bytes."""
        found: dict[str, int] = collections.Counter()
        for t in self.tensors:
            found[t.dtype] += t.bytes
        return dict(found)

    def by_layer(self) -> dict[str, int]:
        """Layer path -> bytes, largest first."""
        found: dict[str, int] = collections.Counter()
        for t in self.tensors:
            found[t.layer] += t.bytes
        return dict(sorted(found.items(), key=lambda kv: -kv[1]))

    def __str__(self) -> str:
        dtypes = ", ".join(f"{d} {b / MIB:.1f}" for d, b in sorted(self.by_dtype().items()))
        lines = [
            f"saved for the backward pass: {self.total_bytes / MIB:.1f} MiB ({dtypes}); "
            f"float32 upcasts of 16-bit tensors: {self.upcast_bytes / MIB:.1f} MiB"
            + (f"; {self.unsized} tensor(s) without a static size" if self.unsized else ""),
        ]
        rows: dict[tuple[str, str, str], int] = collections.Counter()
        for t in self.tensors:
            note = "float32 upcast" if t.upcast else ""
            if t.early:
                note = ", ".join(filter(None, (note, "gradient computed in the forward pass")))
            rows[(t.layer, t.dtype, note)] += t.bytes
        for (layer, dtype, note), size in sorted(rows.items(), key=lambda kv: -kv[1])[:20]:
            lines.append(f"  {size / MIB:8.2f} MiB  {dtype:<9} {layer}" + (f"  ({note})" if note else ""))
        return "\n".join(lines)


def _late_backward_ops(trace) -> set:
    """The backward-pass ops that wait for the end of the forward pass.

    TensorFlow's executor runs an op once its inputs exist, and the gradient seed is a constant.
    A backward op waits for the forward pass only through a data or control edge from the
    model's outputs or the loss (the chain every incoming gradient comes down). One without such
    an edge (a derivative computed from forward tensors alone, without the incoming gradient)
    runs during the forward pass, and its result waits for the backward pass like any saved
    tensor: the saved tensors are the inputs of the late ops that come from the forward pass or
    from such early ops.
    """
    ops = trace.ops
    waits = set(ops[trace.model_end:trace.backward_start]) | {t.op for t in trace.model_outputs}
    late = set()
    for op in ops[trace.backward_start:]:
        if any(t.op in waits or t.op in late for t in op.inputs) or any(
                c in waits or c in late for c in op.control_inputs):
            late.add(op)
    return late


def _mean_square(y_true, y_pred):
    del y_true
    return keras.ops.sum(keras.ops.stack(
        [keras.ops.mean(keras.ops.square(keras.ops.cast(t, "float32"))) for t in keras.tree.flatten(y_pred)]))


def saved_activations(model: keras.Model, x: Any, y: Any = None, loss: Any = None, *,
                      training: bool = True) -> SavedActivationsReport:
    """Lists the forward tensors one training step of `model` keeps for its backward pass.

    Args:
        model: A `keras.Model`: Sequential, functional, nested or subclassed.
        x: One batch of inputs (its shape sizes the tensors).
        y: Its labels, or None (the mean square of the outputs stands in for the loss).
        loss: None (the compiled loss), a Keras loss name or a callable `loss(y_true, y_pred)`.
        training: Bool, default True: the forward pass runs as in a training step.

    Returns:
        A `SavedActivationsReport`.

    Example:
        >>> report = keras_amp.diagnostics.saved_activations(model, x_batch, y_batch)
        >>> print(report)          # MiB by layer and dtype, float32 upcasts marked
        >>> report.upcast_bytes    # 0 for float32 islands under keras_amp.enable()
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    if x is None:
        raise TypeError("`x` must be the model's input: an array, a tensor or the structure the model "
                        "takes. Received: x=None")
    training = validation.check_bool("training", training)
    if y is None and loss is None:
        # A loss linear in the outputs would need no forward tensor near them (its gradient is a
        # constant): the mean square of the outputs stands in, as a real loss reads them.
        y, loss = 0.0, _mean_square
    step = diag_step.DiagnosticStep(model, x, y, loss, lambda trace, g, r, loss_value: loss_value,
                                    training=training, attribute=True)
    trace = step.traced()
    index = {op: i for i, op in enumerate(trace.ops)}
    seen, tensors, unsized = set(), [], 0
    late = _late_backward_ops(trace)
    for op in (op for op in trace.ops[trace.backward_start:] if op in late):
        for t in op.inputs:
            i = index.get(t.op)
            storage = _storage(t)
            if i is None or t.op in late or storage.op.type in _NOT_ACTIVATIONS or storage.ref() in seen:
                continue
            seen.add(storage.ref())
            if t.dtype == tf.variant or not t.shape.is_fully_defined():
                # Loop accumulators (variant TensorLists) and unshaped float tensors; unshaped
                # integer ones are shape arithmetic of the gradient (broadcast axes).
                unsized += t.dtype == tf.variant or t.dtype.is_floating
                continue
            tensors.append(SavedTensor(
                layer=trace.owners[i], op=t.op.name, dtype=t.dtype.name, shape=tuple(t.shape.as_list()),
                bytes=t.shape.num_elements() * t.dtype.size,
                upcast=t.dtype == tf.float32 and source16(t) is not None,
                early=i >= trace.backward_start,
            ))
    tensors.sort(key=lambda t: -t.bytes)
    return SavedActivationsReport(tensors=tuple(tensors), unsized=unsized)

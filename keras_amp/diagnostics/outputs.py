"""check_model's output findings: a model output's dtype now, and what its loss computes from it.

A 16-bit model output is a hazard when the loss computes on its rounded values: probabilities near
1 round to 1 (bfloat16 keeps 8 significant bits), small ones flush to 0 in float16, and a
regression output cannot resolve residuals below its own rounding. It is a deliberate, safe
choice when the loss reads it only as logits of a float32 log-softmax: each logit is rounded once,
and the loss's exp, sum and log run in float32, so nothing overflows or flushes to zero (the
"transformer" and "rnn" recipes keep the vocabulary head in the compute dtype for its speed).

Which one it is follows from what the loss computes, never from its name: the loss is traced on a
16-bit tensor shaped like the output, and every op that reads the output's values (through casts
and shape ops) must be a softmax cross-entropy with logits (`SparseSoftmaxCrossEntropyWithLogits`,
`SoftmaxCrossEntropyWithLogits`, keras_amp's XLA one, `numerics.cross_entropy`) or a `LogSoftmax`,
computing in float32. Sigmoid cross-entropy from logits is composite in TensorFlow (selects, exp,
log1p) and is not recognised.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_amp import losses as amp_losses
from keras_amp import model_graph
from keras_amp.diagnostics.finding import Finding
from keras_amp.numerics import cross_entropy

_LOG_SOFTMAX = ("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits", "LogSoftmax")
_PASS_ON = ("Cast", "Identity", "Reshape", "ExpandDims", "Squeeze", "Transpose", "StopGradient")
_SHAPE_ONLY = ("Shape", "ShapeN", "Rank", "Size")
_PROBE_BATCH, _PROBE_DIM = 2, 8


def current_dtype(tensor) -> str:
    """The dtype the next run gives a model's symbolic output `tensor`, under the policies set now.

    A layer's policy may have been set in place after the graph was built (`apply_recipe`), so the
    recorded dtype can be stale: the producing layer's own output spec is asked again (`Logits`
    reports float32 under a 16-bit policy), and a nested model's output is followed inside it.
    """
    op, node_index, index = tensor._keras_history
    if not keras.backend.is_float_dtype(tensor.dtype):
        return tensor.dtype
    if isinstance(op, keras.Model):
        try:
            return current_dtype(keras.tree.flatten(op.outputs)[index])
        except (AttributeError, ValueError):  # subclassed: no recorded graph inside
            return op.compute_dtype
    if not isinstance(op, keras.layers.Layer):
        return tensor.dtype  # an operator node (x + y): Keras's promotion of its inputs
    node = op._inbound_nodes[node_index]
    try:
        spec = keras.tree.flatten(op.compute_output_spec(*node.arguments.args, **node.arguments.kwargs))[index]
    except Exception:  # noqa: BLE001 - a layer whose spec needs more than its recorded call; its policy decides
        return op.compute_dtype
    return spec.dtype


def _losses_by_output(model, loss) -> list:
    """One loss (or None) per flattened model output, as `compile` would pair them."""
    outputs = keras.tree.flatten(model.outputs)
    if loss is None:
        return [None] * len(outputs)
    if isinstance(loss, dict):
        return [loss.get(name) for name in model.output_names]
    if isinstance(loss, (list, tuple)):
        return list(loss) + [None] * (len(outputs) - len(loss))
    return [loss] * len(outputs)


def _traced_graph(loss, shape, dtype):
    """`loss` traced on a `dtype` y_pred of `shape`, with integer labels or one-hot-shaped targets."""
    spec = tf.TensorSpec(shape, dtype)
    error = None
    for y_true in (np.zeros(shape[:-1], np.int32), np.zeros(shape, np.float32)):
        try:
            traced = tf.function(lambda y_pred, y=y_true: loss(y, y_pred), autograph=False)
            return traced.get_concrete_function(spec).graph, None
        except Exception as e:  # noqa: BLE001 - the other kind of target may fit; the last error is reported
            error = e
    return None, error


def _reads(graph) -> list[tuple[str, str]]:
    """(op type, its input dtype) for each op that computes on y_pred's values, through casts and reshapes."""
    placeholder = next(op for op in graph.get_operations() if op.type == "Placeholder")
    stack, seen, reads = [placeholder.outputs[0]], set(), []
    while stack:
        tensor = stack.pop()
        for consumer in tensor.consumers():
            if id(consumer) in seen or consumer.type in _SHAPE_ONLY:
                continue
            seen.add(id(consumer))
            if consumer.type == "IdentityN":  # output k is input k (custom gradients wrap results and inputs)
                stack.extend(consumer.outputs[k] for k, t in enumerate(consumer.inputs) if t.name == tensor.name)
            elif consumer.type in _PASS_ON:
                stack.extend(consumer.outputs)
            elif cross_entropy.is_cross_entropy_call(consumer):  # upcasts inside, computes in float32
                reads.append(("SparseSoftmaxCrossEntropyWithLogits", "float32"))
            else:
                reads.append((consumer.type, tensor.dtype.name))
    return reads


def _resolved(loss, compiled: bool):
    if compiled:
        return amp_losses.as_compiled(loss)
    return keras.losses.get(loss) if isinstance(loss, str) else loss


def _loss_verdict(loss, compiled: bool, shape, dtype) -> tuple[bool, str]:
    """(whether `loss` reads a `dtype` output only as float32 log-softmax logits, what it computes)."""
    try:
        loss = _resolved(loss, compiled)
    except ValueError as e:
        return False, f"its loss could not be resolved ({e})"
    graph, error = _traced_graph(loss, shape, dtype)
    if graph is None:
        return False, f"its loss could not be traced on a {dtype} output ({type(error).__name__})"
    reads = _reads(graph)
    logits = [r for r in reads if r[0] in _LOG_SOFTMAX and r[1] == "float32"]
    others = [r for r in reads if r not in logits]
    if logits and not others:
        return True, f"its loss reads it only as logits of a float32 {logits[0][0]}"
    what = ", ".join(sorted({f"{op} in {d}" for op, d in others})) or "nothing"
    return False, f"its loss computes {what} on it"


def _check_loss(loss) -> None:
    allowed = "None, a keras.losses.Loss, a loss function or name, or a list/dict of them per output"
    for item in loss.values() if isinstance(loss, dict) else loss if isinstance(loss, (list, tuple)) else [loss]:
        if isinstance(item, str):
            try:
                keras.losses.get(item)
            except ValueError:
                raise ValueError(f"Unknown `loss` name. Received: loss={loss!r}. Allowed: {allowed}") from None
        elif not (item is None or callable(item)):
            raise TypeError(f"`loss` must be {allowed}. Received: loss={loss!r} (an item of type "
                            f"{type(item).__name__})")


def output_findings(model, loss: Any = None, ran: tuple[str, ...] | None = None,
                    ran_layers: tuple[str, ...] | None = None) -> tuple[list[Finding], list[str]]:
    """`output_not_float32` findings, and notes for 16-bit outputs that a float32 log-softmax loss reads.

    `loss`: the loss (or structure of losses) the outputs feed; None: the compiled one, if any.
    `ran`: the outputs' dtypes in a traced call of the model (flattened), where one ran: they are
    what the loss reads, where a layer's output spec can differ (keras-hub's ReversibleEmbedding
    reports its compute dtype for the float32 logits it returns). None: the specs (`current_dtype`).
    `ran_layers`: the innermost layer producing each output in that call (`AuditReport.output_layers`):
    where the model's graph names a block, the fix names the block's last layer, not the whole block.
    """
    _check_loss(loss)
    try:
        outputs = keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError):  # subclassed or unbuilt: output dtypes unknown statically
        return [], []
    compiled = loss is None and getattr(model, "compiled", False)
    losses = _losses_by_output(model, getattr(model, "loss", None) if compiled else loss)
    findings, notes = [], []
    if ran is not None and len(ran) != len(outputs):
        ran = None  # outputs that are not tensors (None) dropped: positions unknown, read the specs
    if ran_layers is None or len(ran_layers) != len(outputs):
        ran_layers = ("",) * len(outputs)
    for i, (t, out_loss, inner) in enumerate(zip(outputs, losses, ran_layers)):
        dtype = ran[i] if ran is not None else current_dtype(t)
        if not keras.backend.is_float_dtype(dtype) or dtype == "float32":
            continue
        layer = t._keras_history.operation
        name = layer.name
        # A block's output: its last layer float32 is enough (the block's rule would take its whole subtree).
        if inner.startswith(name + "/"):
            name, how = inner, f"its last layer {inner!r}: "
            layer = next((sub for path, sub in model_graph.walk(model) if path == inner), layer)
        else:
            how = "dtype='float32', keras_amp.layers.OutputHead, or "
        if out_loss is None:
            why = "no loss is known for it (compile the model, or pass check_model(model, loss=...))"
        else:
            shape = [(_PROBE_BATCH if j == 0 else _PROBE_DIM) if d is None else d for j, d in enumerate(t.shape)]
            safe, why = _loss_verdict(out_loss, compiled, shape, dtype)
            if safe:
                notes.append(
                    f"output {i} ({name!r}) is {dtype} by choice and safe: {why}, so each logit is rounded once "
                    f"to {dtype} and the loss's exp, sum and log run in float32 (nothing overflows or flushes to "
                    "zero); keras_amp.layers.Logits gives unrounded float32 logits at the same matmul cost")
                continue
        as_float32 = f"({how}apply_recipe(..., rules={{{name!r}: 'float32'}}))"
        if _projects(layer):
            fix = ("for float32 logits at the 16-bit matmul's speed build the head as keras_amp.layers.Logits; or "
                   f"make it float32 {as_float32}; 16-bit logits are safe when the loss is a softmax "
                   "cross-entropy from logits")
        else:  # a normalisation, pooling or activation: features (a backbone's), not a head's logits
            as_float32 = as_float32.replace("keras_amp.layers.OutputHead, ", "")  # a Dense head: not this layer
            fix = (f"{name!r} ({type(layer).__name__}) is no projection: where this output is features that a "
                   "model built on it reads (a backbone's), check that model with its loss instead; for a loss "
                   f"on this output itself make the layer float32 {as_float32}")
        findings.append(Finding(
            "output_not_float32", name,
            f"model output {i} is {dtype} and {why}: the loss and metrics see {dtype}-rounded values", fix))
    return findings, notes


def _projects(layer) -> bool:
    """Whether `layer` multiplies by a weight matrix (a Dense, EinsumDense, convolution or reverse embedding
    head: it holds a weight of rank >= 2), so that its output can be logits; else it is features."""
    return any(len(v.shape) >= 2 for v in getattr(layer, "weights", ()))

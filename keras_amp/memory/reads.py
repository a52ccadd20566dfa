"""Which weights a model only ever reads in 16 bits, found in a trace of its forward pass.

A frozen weight may be stored in 16 bits without changing a single bit of training only if every
read of it is cast to that 16-bit dtype before anything computes with it. Autocasting does that
for most layers, but not all: keras-hub's `ReversibleEmbedding` multiplies by its untied reverse
embeddings in float32, and any layer may cast a weight to float32 itself. So the forward pass is
traced once (inference mode, from the model's own input signature) and each weight's reads are
followed through value-preserving selections (gather, slice, reshape, transpose, identity) to
their first computation: stored in 16 bits only when each one is a cast to a 16-bit dtype.

`reads_16bit(model)` returns None when the model has no input signature to trace (a subclassed
model called on data it has not seen symbolically); callers then decide by compute dtype.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_amp.dtypes import LOW_PRECISION

# Ops that select or rearrange values without computing with them (the bits go through as they are).
_SELECTIONS = {"GatherV2", "ResourceGather", "Identity", "Reshape", "Transpose", "StridedSlice", "Slice",
               "ExpandDims", "Squeeze", "ConcatV2", "Pack", "Unpack", "Split", "SplitV", "GatherNd",
               "ResourceGatherNd"}
_READS = {"ReadVariableOp", "ResourceGather", "ResourceGatherNd"}


def _ends_in_16bit_casts(tensor, dtype: str, depth: int = 0) -> bool:
    consumers = tensor.consumers()
    for op in consumers:
        if op.type == "Cast":
            if op.get_attr("DstT").name != dtype:
                return False
        elif op.type in _SELECTIONS and depth < 8:
            if not all(_ends_in_16bit_casts(out, dtype, depth + 1) for out in op.outputs):
                return False
        else:
            return False
    return True


def _signature(model):
    """The model's input structure as TensorSpecs (functional models, keras-hub backbones), or None."""
    inputs = None
    for attr in ("input", "inputs"):  # the nested structure (a dict for keras-hub backbones), or a list
        try:
            inputs = getattr(model, attr, None)
        except (AttributeError, ValueError):
            continue
        if inputs is not None:
            break
    if inputs is None or (isinstance(inputs, (list, tuple, dict)) and not inputs):
        return None
    if isinstance(inputs, list) and len(inputs) == 1:
        inputs = inputs[0]
    return keras.tree.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), inputs)


def _handles(tf_variable):
    """The resource handles a trace may capture: each replica's copy for a distributed variable."""
    if isinstance(tf_variable, tf.distribute.DistributedValues):
        return [component.handle for component in tf_variable.values]
    return [tf_variable.handle]


def reads_16bit(model, variables, dtypes) -> dict[int, bool] | None:
    """{id(variable): whether every forward read of it is a cast to its `dtypes[i]`}, or None.

    A variable the trace never reads at the top level (inside a loop or condition body, or not at
    all) counts as not only-16-bit: it stays as it is.
    """
    spec = _signature(model)
    if spec is None:
        return None
    graph = tf.function(lambda args: model(args, training=False), autograph=False).get_concrete_function(spec).graph
    placeholder = {id(internal): external for external, internal in graph.captures}
    wanted = {id(handle): (v, d) for v, d in zip(variables, dtypes) if d in LOW_PRECISION
              for handle in _handles(v._value)}
    verdict = {id(v): False for v in variables}
    seen: dict[int, bool] = {}
    for op in graph.get_operations():
        if op.type not in _READS:
            continue
        external = placeholder.get(id(op.inputs[0]))
        found = wanted.get(id(external)) if external is not None else None
        if found is None:
            continue
        variable, dtype = found
        if not any(out.consumers() for out in op.outputs):
            continue  # a read nothing uses
        ok = all(_ends_in_16bit_casts(out, dtype) for out in op.outputs)
        seen[id(variable)] = seen.get(id(variable), True) and ok
    verdict.update(seen)
    return verdict

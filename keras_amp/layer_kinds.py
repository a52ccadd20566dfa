"""What a layer computes that 16 bits make unsafe: `op_kind()`, from evidence, never from names.

A layer is "softmax", "exp", "normalization" or "loss" by its Keras type, its activation (by
identity) or its own traced ops (`normalization_dtype()`: a root of a mean of squares). recipes
(the deny list) and check_model stand on this module; it stands on `model_graph`.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_amp.model_graph import children, is_island, is_layer
from keras_amp.op_rules import dataflow

# Activations by the op type that makes them unsafe in 16 bits. Softmax-type: the normaliser is a
# long sum of exponentials that loses precision in 16 bits (and float16 inputs overflow exp).
# Exp/log-type: exp(x) overflows float16 for x > 11.09.
SOFTMAX_ACTIVATIONS = (keras.activations.softmax, keras.activations.log_softmax)
EXP_ACTIVATIONS = (keras.activations.exponential, keras.activations.softplus, keras.activations.log_sigmoid)
OP_KINDS = ("softmax", "exp", "normalization", "loss")
# Keras's own normalisation layers, by type. Any other layer normalises when its traced ops take a
# root of a mean of squares (`normalization_dtype`); its class name decides nothing.
NORMALIZATION_LAYERS = (
    keras.layers.BatchNormalization,
    keras.layers.GroupNormalization,
    keras.layers.LayerNormalization,
    keras.layers.Normalization,
    keras.layers.RMSNormalization,
    keras.layers.UnitNormalization,
)


def op_kind(layer: Any) -> str | None:
    """The deny-list op type `layer` computes ("softmax", "exp", "normalization", "loss"), or None.

    Decided by what the layer is or computes, never by its name: a Softmax layer or a
    softmax/log_softmax activation is "softmax", an exp/log-type activation "exp", a Keras
    normalisation layer (`NORMALIZATION_LAYERS`) or a layer whose own traced ops take a root of a
    mean of squares (`normalization_dtype`) "normalization", a layer with an activity regularizer,
    whose penalty (e.g. sum of squares) is computed in the layer's compute dtype, "loss". A wrapper
    has its inner layer's kind (TimeDistributed(Dense(activation="softmax")) is a softmax), except
    an island, which already computes it in float32.
    """
    if not is_layer(layer):
        return None
    if isinstance(layer, keras.layers.Wrapper) and not is_island(layer):
        return op_kind(layer.layer)
    activation = getattr(layer, "activation", None)
    if isinstance(layer, keras.layers.Softmax) or any(activation is f for f in SOFTMAX_ACTIVATIONS):
        return "softmax"
    if any(activation is f for f in EXP_ACTIVATIONS):
        return "exp"
    if isinstance(layer, NORMALIZATION_LAYERS) or normalization_dtype(layer) is not None:
        return "normalization"
    if getattr(layer, "activity_regularizer", None) is not None:
        return "loss"
    return None


_ROOTS = ("Rsqrt", "Sqrt")

# Keras's own layers whose call takes no root: tracing one shows none (tests/test_layer_kinds.py traces every
# class here), so `normalization_dtype` answers without a trace, which took most of `apply_recipe`'s time on
# a large model (InceptionResNetV2's 781 layers). Exact types only: a subclass's call may be anything, and so
# may an activation that is not one of Keras's own.
KNOWN_ROOTLESS = tuple(getattr(keras.layers, name) for name in (
    "Activation", "AveragePooling1D", "AveragePooling2D", "AveragePooling3D", "Conv1D", "Conv1DTranspose",
    "Conv2D", "Conv2DTranspose", "Conv3D", "Conv3DTranspose", "Cropping1D", "Cropping2D", "Cropping3D", "Dense",
    "DepthwiseConv1D", "DepthwiseConv2D", "Dropout", "ELU", "EinsumDense", "Flatten", "GlobalAveragePooling1D",
    "GlobalAveragePooling2D", "GlobalAveragePooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D",
    "GlobalMaxPooling3D", "Identity", "LeakyReLU", "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "PReLU",
    "Permute", "ReLU", "Rescaling", "Reshape", "SeparableConv1D", "SeparableConv2D", "SpatialDropout1D",
    "SpatialDropout2D", "SpatialDropout3D", "UpSampling1D", "UpSampling2D", "UpSampling3D", "ZeroPadding1D",
    "ZeroPadding2D", "ZeroPadding3D"))


def _known_rootless(layer: Any) -> bool:
    if type(layer) not in KNOWN_ROOTLESS:
        return False
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", None)
    return activation is None or (name is not None and getattr(keras.activations, name, None) is activation)


def _float_dtype(op: Any) -> str | None:
    """The floating-point dtype `op` computes in: its first float input's."""
    return next((t.dtype.name for t in op.inputs if t.dtype.is_floating), None)


def _root_of_mean_of_squares_dtype(ops: list) -> str | None:
    """The least precise dtype a normalisation statistic's root among `ops` computes in, or None.

    Both halves count: the chain from the values to the statistic (squares overflow float16 past
    256 and keep 8 bits in bfloat16) and the root. The statistic is the op rules' definition
    (`op_rules.dataflow.statistic_dtype`: a mean or sum of squares or deviations, through `+ eps`
    and a scale), so what the rules rebuild and what this module calls a normalisation agree.
    """
    dtypes = []
    for root in (op for op in ops if op.type in _ROOTS):
        chain = dataflow.statistic_dtype(root.inputs[0])
        if chain is not None:
            dtypes += [chain, _float_dtype(root)]
    return min((d for d in dtypes if d is not None), key=lambda d: tf.as_dtype(d).size, default=None)


def normalization_dtype(layer: Any) -> str | None:
    """The dtype in which `layer`'s own call takes a root of a mean of squares, or None.

    The evidence is the layer's ops: its call is traced (not run) once on its first recorded
    input in a graph model, under its current policy. Only layers of a Sequential/functional graph
    with one input tensor and no sublayers are traced (their ops are their own); None for the
    others, whose ops only a traced model step attributes (`keras_amp.diagnostics`).
    """
    if not is_layer(layer) or isinstance(layer, keras.Model) or children(layer) or _known_rootless(layer):
        return None
    return _traced_root_dtype(layer)


def _traced_root_dtype(layer: Any) -> str | None:
    """`normalization_dtype` from the trace of `layer`'s call alone, for any layer (no shortcut)."""
    try:
        spec = layer.input  # the KerasTensor of its first call in a graph
    except (AttributeError, ValueError):
        return None  # never called on symbolic inputs (a subclassed model's or a composite's sublayer)
    if not isinstance(spec, keras.KerasTensor) or not keras.backend.is_float_dtype(spec.dtype):
        return None
    # Without AutoGraph: half the tracing time (apply_recipe traces every such layer), and Keras's own
    # symbolic call, which gave the layer its `input`, runs without it too.
    signature = tf.TensorSpec(spec.shape, spec.dtype)
    try:
        graph = tf.function(layer, autograph=False).get_concrete_function(signature).graph
    except Exception:  # noqa: BLE001 - a layer that cannot be traced alone gives no evidence
        return None
    return _root_of_mean_of_squares_dtype(graph.get_operations())

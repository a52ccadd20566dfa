"""The bias rule: a bfloat16 bias add whose gradient is summed with float32 accumulation.

Keras's TensorFlow `add` turns `x + bias` into `tf.nn.bias_add` when the second operand is a
vector along the first's last (or second) axis: every Dense, EinsumDense and convolution bias.
The gradient of that op, TensorFlow's CPU `BiasAddGrad` kernel, sums bfloat16 in bfloat16 (its
float16 sum accumulates in float32): a channel's bias gradient over 16,384 rows of 1.0 comes out
256, where the running sum stops growing, so stock mixed_bfloat16 trains every bias on a wrong
gradient once a batch (times the spatial positions of a convolution) has a few hundred rows. It is
also slower than the sums below.

The rule keeps the forward op (`tf.nn.bias_add`, the same numbers and the same fusion candidates)
and replaces its gradient: the input's gradient passes through, and the bias's is the upstream
gradient summed over every axis but the channel's with float32 accumulation, rounded once to
bfloat16, by the fastest kernel that accumulates in float32 on the device (`gradient_method`):

    "matmul":  ones[1, rows] @ dy[rows, channels], oneDNN's bfloat16 matmul (float32
               accumulation), where it runs natively (AVX512-BF16 or AMX, oneDNN on);
    "sum":     TensorFlow's CPU `Sum`, which accumulates bfloat16 in float32 (tested), on other CPUs;
    "float32": the sum of a float32 copy, on a GPU or TPU (their bfloat16 bias gradient is not
               measured: no such device was available).

A channels-first input (a bias along axis 1) takes "sum" where "matmul" was chosen.

Where the input is a 2-D matmul's (rows, channels) result reshaped so that the bias's axes are its
channels (Keras's Dense on a rank-3+ input, TensorFlow's `tensordot`: the last axis kept; an
EinsumDense splitting heads, `abc,cde->abde` with `bias_axes="de"`, once the einsum-rows rule has
made its einsum a 2-D matmul: the last axis split), the bias, flattened, is added to the matmul's
result and the sum reshaped: the same numbers (a reshape of row-major rows keeps each element's
place in the bias), but the bias add now follows its matmul, where oneDNN fuses them into one kernel
that adds the bias in float32 and rounds once (two roundings before, stock's too). The reshapes had
kept that fusion from every Transformer's projections and vocabulary head.

Only for bfloat16 operands: float16 keeps TensorFlow's kernel, which already accumulates in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import tensorflow as tf

from keras_amp import hardware
from keras_amp.custom_gradient import custom_gradient

METHODS = ("matmul", "sum", "float32")


def method_for(device: hardware.DeviceInfo) -> str:
    """The bias-gradient kernel for `device` (module doc)."""
    if device.gpus or device.tpu_count:
        return "float32"
    return "matmul" if device.cpu_fast_bfloat16 else "sum"


@functools.lru_cache(maxsize=None)
def gradient_method() -> str:
    """The bias-gradient kernel for this machine's devices, observed once."""
    return method_for(hardware.detect())


def bias_gradient(dy: tf.Tensor, channel_axis: int, method: str | None = None) -> tf.Tensor:
    """The sum of `dy` over every axis but `channel_axis` (-1 or 1), float32 accumulation, in
    `dy`'s dtype; `method` is one of `METHODS` (default: `gradient_method()`)."""
    method = gradient_method() if method is None else method
    if method not in METHODS:
        raise ValueError(f"Unknown `method`. Received: method={method!r}. Allowed: {', '.join(METHODS)}")
    rank = dy.shape.rank
    channel_axis %= rank
    channels = dy.shape[channel_axis]
    if method == "matmul" and channel_axis == rank - 1:
        rows = tf.reshape(dy, [-1, channels])
        ones = tf.ones(tf.stack([1, tf.shape(rows)[0]]), dy.dtype)
        return tf.reshape(tf.matmul(ones, rows), [channels])
    axes = [axis for axis in range(rank) if axis != channel_axis]
    if method != "float32":
        return tf.reduce_sum(dy, axes)
    return tf.cast(tf.reduce_sum(tf.cast(dy, tf.float32), axes), dy.dtype)


def dense_dtype(x: Any) -> str | None:
    """`x`'s dtype name; None for a sparse, ragged or IndexedSlices value (Keras's ops handle those themselves)."""
    if isinstance(x, (tf.SparseTensor, tf.IndexedSlices, tf.RaggedTensor)):
        return None
    dtype = getattr(x, "dtype", None)  # a Keras variable reports its autocast dtype (a string)
    return getattr(dtype, "name", dtype)


def channel_axis(x: tf.Tensor, bias: tf.Tensor) -> int | None:
    """-1 or 1 where Keras's `add(x, bias)` becomes `tf.nn.bias_add` (channels last or first), else None:
    `bias` squeezes to one statically known axis, the size of `x`'s last (else second) axis."""
    if bias.shape.rank is None or x.shape.rank is None or x.shape.rank < 2:
        return None
    kept = [d for d in bias.shape.as_list() if d is None or d > 1]
    if len(kept) != 1 or kept[0] is None:
        return None
    dims = x.shape.as_list()
    if dims[-1] == kept[0]:
        return -1
    return 1 if dims[1] == kept[0] else None


_MATMULS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3")


def reshaped_rows(x: tf.Tensor) -> tf.Tensor | None:
    """The 2-D (rows, channels) tensor that `x` is a reshape of, keeping its last axis (so each
    element keeps its channel), else None. In graph mode only."""
    if tf.executing_eagerly() or not hasattr(x, "op") or x.op.type != "Reshape":
        return None
    rows = x.op.inputs[0]
    last = rows.shape[-1] if rows.shape.rank == 2 else None
    return rows if last is not None and last == x.shape[-1] and rows.dtype == x.dtype else None


def trailing_size(x: tf.Tensor, bias: tf.Tensor) -> int | None:
    """The number of elements of `bias` where it is `x`'s last axes (leading 1s aside; static
    shapes; fewer axes than `x`), else None: EinsumDense's `bias_axes="de"` on an `abde` result."""
    if bias.shape.rank is None or x.shape.rank is None:
        return None
    dims = bias.shape.as_list()
    while len(dims) > 1 and dims[0] == 1:
        dims = dims[1:]
    if not dims or len(dims) >= x.shape.rank or None in dims or x.shape.as_list()[-len(dims):] != dims:
        return None
    return math.prod(dims)


def bias_rows(x: tf.Tensor, size: int) -> tuple[tf.Tensor, tf.Tensor] | None:
    """(rows, shape): the 2-D matmul result that `x` reshapes, its last axis of `size` elements being
    `x`'s last axes flattened, and the shape that reshapes it into `x`; else None. In graph mode only."""
    if tf.executing_eagerly() or not hasattr(x, "op") or x.op.type != "Reshape":
        return None
    rows, shape = x.op.inputs
    if rows.op.type not in _MATMULS or rows.shape.rank != 2 or rows.shape[-1] != size or rows.dtype != x.dtype:
        return None
    return rows, shape


def _biased(x: tf.Tensor, bias: tf.Tensor, axis: int) -> tf.Tensor:
    """`tf.nn.bias_add` of the vector `bias` along `x`'s `axis` (-1 or 1), its bias gradient summed
    with float32 accumulation (`bias_gradient`)."""
    data_format = "NHWC" if axis == -1 else "NCHW"

    @custom_gradient(transparent=True)  # the dataflow walks may rebuild the bias add (scores + a key bias)
    def biased(x, bias):
        def grad(dy):
            return dy, bias_gradient(dy, axis)

        return tf.nn.bias_add(x, bias, data_format=data_format), grad

    return biased(x, bias)


def float32_bias_gradient(original: Callable) -> Callable:
    """Replaces the TF backend's `add` for a bfloat16 bias add (module doc); every other add is the original."""

    def add(x1, x2):
        if not (dense_dtype(x1) == dense_dtype(x2) == "bfloat16"):
            return original(x1, x2)
        x1, x2 = tf.convert_to_tensor(x1), tf.convert_to_tensor(x2)  # a Keras variable: its autocast read
        size = trailing_size(x1, x2)
        found = bias_rows(x1, size) if size is not None else None
        if found is not None:  # the bias added to the matmul's rows, then their reshape (module doc)
            rows, shape = found
            y = tf.reshape(_biased(rows, tf.reshape(x2, [size]), -1), shape)
            y.set_shape(x1.shape)
            return y
        axis = channel_axis(x1, x2)
        if axis is None:
            return original(x1, x2)
        return _biased(x1, tf.reshape(x2, [x1.shape[axis]]) if x2.shape.rank != 1 else x2, axis)

    add.__name__ = add.__qualname__ = original.__name__
    return add

"""The convolution-gradient rule: a 16-bit convolution's gradients from float32 kernels where the CPU
has no 16-bit convolution kernels of its own; and on a CPU, grouped convolutions with one input channel
per group run as depthwise ones (the last paragraph).

Without oneDNN's native bfloat16 (TensorFlow's default on AVX2-only CPUs such as AMD Zen 3, or oneDNN
off), TensorFlow's bfloat16 and float16 convolutions are Eigen's. Their forward kernel is as fast as
float32's, but the two backward kernels (`Conv2DBackpropInput`, `Conv2DBackpropFilter`) take many
times float32's time (BUILD_NOTES, "On a 2-core AMD Zen 3 itself"): in stock
mixed_bfloat16 they are most of a convolutional network's training step.

The rule keeps Keras's forward convolution (the same op, the same numbers) and computes both gradients
with TensorFlow's float32 kernels from exact float32 upcasts of the 16-bit input, kernel and incoming
gradient: float32 accumulation, each gradient rounded once to its 16-bit dtype. Keras's convolutions
(`backend.nn.conv`: Conv1D, Conv2D, Conv3D, grouped or not; `depthwise_conv`: DepthwiseConv1D/2D;
`separable_conv`: SeparableConv1D/2D; `conv_transpose`: Conv1D/2D/3DTranspose) are differentiated in
float32 as written, so strides, padding, dilation, data format and the XLA path for grouped
convolutions stay Keras's. (A transposed convolution's forward pass is itself an input-gradient
kernel: it stays Keras's, in the 16-bit dtype, and only its gradients are the rule's.)

Left to Keras: a GPU or TPU, a CPU whose oneDNN runs bfloat16 natively (for bfloat16; its float16
convolutions are Eigen's too, unless the CPU has float16 instructions, where oneDNN may run them and
nothing was measured), a step compiled with XLA (`jit_compile=True`: XLA's own kernels), a
SavedModel being written, and operands of two dtypes (Keras's error, as without keras_amp): the
decision is `numerics.islands.float32_kernels`, the RNN weight matmuls' too.

One exception where oneDNN runs bfloat16 natively (`islands.onednn_bfloat16_kernels`): its bfloat16
depthwise-convolution gradients are fast only for a 3x3 kernel at stride 1 (2-D, no dilation). With a
stride of 2 or a 5x5 kernel they took 2-20x float32's time (BUILD_NOTES), so the depthwise and separable
convolutions other than that one shape get the float32 gradients too.

Grouped convolutions with one input channel per group: Keras's `conv` runs every grouped convolution as
an XLA computation on a CPU (TensorFlow's CPU kernels have none), and XLA's CPU convolution took 5-40x
the time of TensorFlow's depthwise kernels, in float32 and bfloat16 alike (BUILD_NOTES). With one input
channel per group (`Conv2D(filters=channels * m, groups=channels)`: how keras.applications' ConvNeXt and
keras-hub's MobileNet write their depthwise convolutions) it is a depthwise convolution with multiplier m,
so on a CPU alone, outside XLA and outside a SavedModel being written, a 16-bit one runs as the TF
backend's `depthwise_conv` (1-D and 2-D, channels last; the kernel reshaped from (..., 1, channels * m) to
(..., channels, m), the same output order), with the depthwise gradients above. Where the 16-bit kernels
are Eigen's, its forward pass is from float32 kernels on exact upcasts, rounded once, as XLA's is (Eigen's
float16 depthwise kernel rounds its sums).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import keras
import tensorflow as tf

from keras_amp.custom_gradient import custom_gradient
from keras_amp.numerics.islands import cpu_kernels, float32_kernels, onednn_bfloat16_kernels
from keras_amp.op_rules.bias_add import dense_dtype


def _fast_onednn_depthwise(kernel: Any, rest: tuple, kwargs: dict) -> bool:
    """Whether oneDNN's bfloat16 gradients of this depthwise convolution are its fast ones: a 2-D 3x3
    `kernel` at stride 1 without dilation (`strides`, `dilation_rate` as Keras's ops pass them)."""
    strides = kwargs.get("strides", rest[0] if rest else 1)
    dilation = kwargs.get("dilation_rate", rest[3] if len(rest) > 3 else 1)
    ones = lambda v: all(int(d) == 1 for d in (v if isinstance(v, (tuple, list)) else (v,)))  # noqa: E731
    return tuple(kernel.shape[:-2]) == (3, 3) and ones(strides) and ones(dilation)


def _float32_gradients(original: Callable, operands: int, depthwise: bool = False,
                       float32_forward: bool = False) -> Callable:
    """`original` (a TF-backend convolution whose first `operands` positional arguments are its input and
    kernels, as Keras's ops pass them) with the gradients of the module doc; every other call is the
    original's. `depthwise`: its second operand is a depthwise kernel (the module doc's exception).
    `float32_forward`: where the 16-bit kernels are Eigen's, the forward convolution too is float32 kernels'
    on exact upcasts, rounded once (Eigen's float16 depthwise kernel rounds its sums)."""

    def conv(*args, **kwargs):
        tensors, rest = args[:operands], args[operands:]
        dtype = dense_dtype(tensors[0]) if tensors else None
        if (len(tensors) < operands or dtype not in ("bfloat16", "float16")
                or any(dense_dtype(k) != dtype for k in tensors[1:])):
            return original(*args, **kwargs)
        slow_onednn = (depthwise and onednn_bfloat16_kernels(dtype)
                       and not _fast_onednn_depthwise(tensors[1], rest, kwargs))
        if not (float32_kernels(dtype) or slow_onednn):
            return original(*args, **kwargs)

        def convolve(*operand_values):
            return original(*operand_values, *rest, **kwargs)

        @custom_gradient(transparent=True)  # the gradient of the same convolution, from float32 kernels
        def conv16(*operand_values):
            def grad(dy):
                with tf.control_dependencies([dy]):  # upcast in the backward pass: no float32 copy kept
                    upcasts = [tf.cast(t, tf.float32) for t in operand_values]
                with tf.GradientTape() as tape:
                    tape.watch(upcasts)
                    y32 = convolve(*upcasts)  # in a graph, only its gradient ops run: the rest is pruned
                grads = tape.gradient(y32, upcasts, output_gradients=tf.cast(dy, tf.float32))
                return tuple(tf.cast(g, t.dtype) for g, t in zip(grads, operand_values))

            if float32_forward and float32_kernels(dtype):
                return tf.cast(convolve(*[tf.cast(t, tf.float32) for t in operand_values]), dtype), grad
            return convolve(*operand_values), grad

        return conv16(*[tf.convert_to_tensor(t) for t in tensors])

    conv.__name__ = conv.__qualname__ = original.__name__
    return conv


def float32_conv_gradients(original: Callable) -> Callable:
    """Replaces a TF-backend convolution of an input and one kernel (`conv_transpose`; module doc)."""
    return _float32_gradients(original, 2)


def _as_depthwise(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict | None:
    """`conv`'s arguments for the TF backend's `depthwise_conv` (the same keywords, the kernel reshaped from
    (..., 1, groups * m) to (..., groups, m)) when `conv` is a 16-bit 1-D or 2-D channels-last convolution
    with one input channel per group, on TensorFlow's CPU kernels; else None."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None  # Keras's own error, from Keras's own call
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    x, kernel = arguments["inputs"], arguments["kernel"]
    dtype = dense_dtype(x)
    if dtype not in ("bfloat16", "float16") or dense_dtype(kernel) != dtype or not cpu_kernels(dtype):
        return None
    shape, x_shape = tuple(kernel.shape), tf.TensorShape(x.shape)
    channels = x_shape[-1] if x_shape.rank else None
    if (x_shape.rank not in (3, 4) or len(shape) != x_shape.rank or channels is None or channels < 2
            or shape[-2] != 1 or shape[-1] % channels
            or str(arguments["data_format"] or keras.config.image_data_format()).lower() != "channels_last"):
        return None
    arguments["kernel"] = tf.reshape(kernel, (*shape[:-2], channels, shape[-1] // channels))
    for name in ("strides", "dilation_rate"):  # Keras's depthwise_conv takes an int or a tuple; a Conv passes lists
        if isinstance(arguments[name], list):
            arguments[name] = tuple(arguments[name])
    return arguments


def conv_with_depthwise_groups(original: Callable, depthwise_original: Callable | None) -> Callable:
    """Replaces the TF backend's `conv`: the module doc's gradients; a 16-bit convolution with one input channel
    per group (a depthwise convolution written as `Conv(groups=channels)`) on TensorFlow's CPU kernels goes to
    `depthwise_original` (with the depthwise rule's gradients) instead of Keras's XLA grouped convolution."""
    plain = _float32_gradients(original, 2)
    if depthwise_original is None:
        return plain
    depthwise = _float32_gradients(depthwise_original, 2, depthwise=True, float32_forward=True)
    signature = inspect.signature(original)

    def conv(*args, **kwargs):
        arguments = _as_depthwise(signature, args, kwargs)
        if arguments is None:
            return plain(*args, **kwargs)
        return depthwise(arguments.pop("inputs"), arguments.pop("kernel"), **arguments)

    conv.__name__ = conv.__qualname__ = original.__name__
    return conv


def float32_depthwise_conv_gradients(original: Callable) -> Callable:
    """Replaces the TF backend's `depthwise_conv` (an input and a depthwise kernel; module doc)."""
    return _float32_gradients(original, 2, depthwise=True)


def float32_separable_conv_gradients(original: Callable) -> Callable:
    """Replaces the TF backend's `separable_conv` (an input, a depthwise and a pointwise kernel; module doc)."""
    return _float32_gradients(original, 3, depthwise=True)

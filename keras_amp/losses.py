"""Float32 losses for custom training loops.

Inside `fit`, Keras losses already cast `y_pred` to float32. A custom loop that
calls a loss (or raw ops) on float16 model outputs does not: `mean(square(y -
300))` in float16 overflows (300**2 * n sums past 65504) and returns inf.
`float32_loss` casts floating inputs to float32 before the loss runs and casts
the result to float32.

`as_compiled` gives a loss as `compile` runs it, for keras_amp's own measurements
(find_overflow, check_model, search_precision): they must compute the loss that
`fit` computes, not the bare function on 16-bit outputs.
"""

import functools
import re

import keras
from keras import ops

from keras_amp import validation


def _cast_float32(structure):
    def cast(x):
        if hasattr(x, "dtype") and keras.backend.is_float_dtype(
            keras.backend.standardize_dtype(x.dtype)
        ):
            return ops.cast(x, "float32")
        return x

    return keras.tree.map_structure(cast, structure)


def float32_loss(fn):
    """Wraps a loss callable so its floating inputs and its result are float32.

    Works with `keras.losses.Loss` objects, Keras loss functions and plain
    callables, and as a decorator. Every floating tensor among the positional
    and keyword arguments (`y_true`, `y_pred`, `sample_weight`, ...) is cast to
    float32 (integer labels are left alone); every floating tensor in the
    result is cast to float32.

    Args:
        fn: Callable. The loss, e.g. `keras.losses.MeanSquaredError()` or
            `lambda y, p: ops.mean(ops.square(y - p))`.

    Returns:
        A callable with the same signature.

    Example:

    >>> @keras_amp.losses.float32_loss
    ... def mse(y_true, y_pred):
    ...     return keras.ops.mean(keras.ops.square(y_true - y_pred))
    >>> mse(np.zeros(4), keras.ops.full((4,), 300.0, "float16"))  # 90000.0
    """
    validation.check_callable("fn", fn)

    @functools.wraps(fn, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
    def wrapped(*args, **kwargs):
        # Squares and sums of activations overflow float16 (max 65504) and lose
        # bits in bfloat16; the loss and everything the optimizer scales from it
        # are float32.
        result = fn(*_cast_float32(args), **_cast_float32(kwargs))
        return _cast_float32(result)

    wrapped.__wrapped__ = fn
    return wrapped


def as_compiled(loss):
    """`loss` (a Keras loss name, function or `keras.losses.Loss`) as `compile` runs it: a
    `keras.losses.Loss`. Keras wraps a function in its `LossFunctionWrapper` (not public), whose
    `Loss.__call__` casts `y_pred` and `y_true` to float32 before the function sees them (`mse` on
    its own casts 1e7 labels to a float16 `y_pred`'s dtype: inf), brings them to one rank, weighs
    the per-sample values by sample weights and reduces them ("sum_over_batch_size")."""
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    validation.check_callable("loss", fn)
    return fn if isinstance(fn, keras.losses.Loss) else _AsCompiled(fn)


class _AsCompiled(keras.losses.Loss):
    def __init__(self, fn):
        # The name becomes a TensorFlow name scope, which takes no "<lambda>" and no leading "_".
        name = getattr(fn, "__name__", "")
        super().__init__(name=name if re.fullmatch(r"[A-Za-z0-9.][\w.-]*", name) else "loss")
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(*_same_rank(y_true, y_pred))


def _same_rank(a, b):
    """Keras's rule: where ranks differ by one and the longer ends in an axis of size 1, that axis is
    dropped, or added to the other where it has rank 1."""
    if len(a.shape) == len(b.shape) + 1 and a.shape[-1] == 1:
        return (a, keras.ops.expand_dims(b, -1)) if len(b.shape) == 1 else (keras.ops.squeeze(a, -1), b)
    if len(b.shape) == len(a.shape) + 1 and b.shape[-1] == 1:
        return (keras.ops.expand_dims(a, -1), b) if len(a.shape) == 1 else (a, keras.ops.squeeze(b, -1))
    return a, b

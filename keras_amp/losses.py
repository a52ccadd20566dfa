"""Float32 losses for custom training loops.

Inside `fit`, Keras losses already cast `y_pred` to float32. A custom loop that
calls a loss (or raw ops) on float16 model outputs does not: `mean(square(y -
300))` in float16 overflows (300**2 * n sums past 65504) and returns inf.
`float32_loss` casts floating inputs to float32 before the loss runs and casts
the result to float32.
"""

import functools

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

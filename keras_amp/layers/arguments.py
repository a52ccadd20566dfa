"""Construction-time checks of layer arguments that stock Keras checks only at build or call.

`CheckedArguments` is a mixin for a subclass of a stock Keras layer: its `ARGUMENT_CHECKS`
maps argument names of the stock constructor to checks, applied when the layer is created
(positional or keyword, defaults included) before the stock constructor runs. Each check
composes `keras_amp.validation`: TypeError for a wrong type, ValueError for a wrong value,
the message naming the argument. What needs the input (an axis against the input's rank,
`groups` against the channels) stays with stock Keras at build time.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable

import keras

from keras_amp import validation


def check_axis(name: str, value: Any) -> int | list[int]:
    """An integer or a list/tuple of integers; as a Python int or list of ints."""
    validation.check_type(name, value, (numbers.Integral, list, tuple), "an int or a list/tuple of ints")
    if isinstance(value, (list, tuple)):
        return type(value)(validation.check_int(name, axis) for axis in value)
    return validation.check_int(name, value)


def check_axis_items(name: str, value: Any) -> Any:
    """Each item of a list/tuple axis an integer; anything else is left to the stock check."""
    if isinstance(value, (list, tuple)):
        return check_axis(name, value)
    return value


def check_optional_axis(name: str, value: Any) -> int | list[int] | None:
    """None, an integer or a list/tuple of integers."""
    return None if value is None else check_axis(name, value)


def check_rate(name: str, value: Any) -> float:
    """A dropout rate: a number in [0, 1] (stock RNN cells clip out-of-range rates silently)."""
    return validation.check_float(name, value, min_value=0.0, max_value=1.0)


def check_epsilon(name: str, value: Any) -> float:
    """A finite number >= 0: a negative epsilon makes the normaliser's sqrt NaN."""
    return validation.check_float(name, value, min_value=0.0)


def check_fraction(name: str, value: Any) -> float:
    """A number in [0, 1] (a moving-average momentum)."""
    return validation.check_float(name, value, min_value=0.0, max_value=1.0)


def check_positive_int(name: str, value: Any) -> int:
    return validation.check_int(name, value, min_value=1)


def check_activation(name: str, value: Any) -> Any:
    """None, a Keras activation name, or a callable (checked now, not at the first call)."""
    if isinstance(value, str):
        try:
            keras.activations.get(value)
        except ValueError:
            raise ValueError(f"Unknown `{name}`. Received: {name}={value!r}. "
                             "Allowed: a Keras activation name, a callable or None") from None
    elif value is not None:
        validation.check_callable(name, value)
    return value


class CheckedArguments:
    """Mixin: checks `ARGUMENT_CHECKS` against the stock constructor's arguments at creation.

    `STOCK` is the stock Keras class whose constructor signature names the arguments.
    A check returns the value in canonical form (a Python int for any integral number), which
    is what the stock constructor then receives.
    """

    STOCK: type
    ARGUMENT_CHECKS: dict[str, Callable[[str, Any], Any]] = {}

    def __init__(self, *args, **kwargs):
        signature = inspect.signature(self.STOCK.__init__)
        bound = signature.bind(self, *args, **kwargs)
        var_kw = next(
            (p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
        )
        extra = bound.arguments.get(var_kw, {}) if var_kw else {}
        for name, check in self.ARGUMENT_CHECKS.items():
            if name in bound.arguments:
                bound.arguments[name] = check(name, bound.arguments[name])
            elif name in extra:
                extra[name] = check(name, extra[name])
        super().__init__(*bound.args[1:], **bound.kwargs)

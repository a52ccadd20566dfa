"""One way to check a public argument: TypeError for a type, ValueError for a value.

Every message states the requirement, then what was received, then what is allowed:

    `min_scale` must be a finite number >= 1.1754943508222875e-38 (float32's smallest normal).
    Received: min_scale=1e-40

Each checker returns the value in its canonical Python form (an `int` for any integral
number, numpy's included; a `float` for any real number), so callers store plain values.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, Callable, Iterable

import numpy as np

# float32 range: a loss scale or bound outside it becomes 0 or inf in a float32 variable.
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # smallest positive normal
INT32_MAX = int(np.iinfo(np.int32).max)
INT64_MAX = int(np.iinfo(np.int64).max)


def _received(name: str, value: Any) -> str:
    return f"Received: {name}={value!r}"


def _typed(name: str, value: Any) -> str:
    return f"Received: {name}={value!r} of type {type(value).__name__}"


def check_type(name: str, value: Any, types: type | tuple[type, ...], allowed: str) -> Any:
    """`value` if it is an instance of `types`; TypeError naming `name` and `allowed` otherwise."""
    if not isinstance(value, types):
        raise TypeError(f"`{name}` must be {allowed}. {_typed(name, value)}")
    return value


def check_regexes(name: str, value: Any, names: Iterable[str]) -> list[re.Pattern]:
    """`value`, an iterable of regex strings, compiled; each must fully match one of `names` (layer
    paths). TypeError for one string or a non-string entry, ValueError for a bad regex or one that
    matches nothing."""
    if isinstance(value, str):
        raise TypeError(f"`{name}` must be an iterable of path regexes, not one string. {_received(name, value)}")
    names = list(names)
    patterns = []
    for i, entry in enumerate(value):
        check_type(f"{name}[{i}]", entry, str, "a path regex string")
        try:
            pattern = re.compile(entry)
        except re.error as e:
            raise ValueError(f"`{name}[{i}]` must be a valid regex ({e}). {_received(f'{name}[{i}]', entry)}") from None
        if not any(pattern.fullmatch(n) for n in names):
            raise ValueError(f"`{name}[{i}]` must match a layer path. {_received(f'{name}[{i}]', entry)}. "
                             f"Allowed: regexes over the paths, e.g. {names[:5]}")
        patterns.append(pattern)
    return patterns


def check_bool(name: str, value: Any) -> bool:
    """A bool (numpy's included); strings such as "no" and numbers are refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"`{name}` must be True or False. {_typed(name, value)}")


def _bounds_text(min_value, max_value, min_inclusive: bool, max_inclusive: bool) -> str:
    parts = []
    if min_value is not None:
        parts.append(f"{'>=' if min_inclusive else '>'} {min_value}")
    if max_value is not None:
        parts.append(f"{'<=' if max_inclusive else '<'} {max_value}")
    return " and ".join(parts)


def _check_bounds(name, value, shown, min_value, max_value, min_inclusive, max_inclusive, what, extra=""):
    low_bad = min_value is not None and (value < min_value if min_inclusive else value <= min_value)
    high_bad = max_value is not None and (value > max_value if max_inclusive else value >= max_value)
    if low_bad or high_bad:
        bounds = _bounds_text(min_value, max_value, min_inclusive, max_inclusive)
        raise ValueError(f"`{name}` must be {what} {bounds}{extra}. {_received(name, shown)}")


def check_int(
    name: str,
    value: Any,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    int64: bool = True,
) -> int:
    """An integral number (int or numpy integer, not bool) within bounds, as a Python int.

    `int64=True` (default) also requires |value| <= int64's maximum: a larger count cannot
    live in a TF variable.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an integer. {_typed(name, value)}")
    value = int(value)
    if int64 and abs(value) > INT64_MAX:
        raise ValueError(f"`{name}` must fit in int64 (|value| <= {INT64_MAX}). {_received(name, value)}")
    _check_bounds(name, value, value, min_value, max_value, min_inclusive, max_inclusive, "an integer")
    return value


def check_float(
    name: str,
    value: Any,
    *,
    min_value: float | None = None,
    max_value: float | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    finite: bool = True,
    float32: bool = False,
) -> float:
    """A real number (int, float, numpy scalar; not bool) within bounds, as a Python float.

    `finite=True` refuses NaN and +/-inf. `float32=True` also requires the value to survive
    storage in a float32 variable: |value| <= float32's max and, if non-zero, >= its smallest
    normal (a smaller value becomes a subnormal or 0.0 there).
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a number. {_typed(name, value)}")
    number = float(value)
    if math.isnan(number) or (finite and math.isinf(number)):
        raise ValueError(f"`{name}` must be a finite number. {_received(name, value)}")
    _check_bounds(name, number, value, min_value, max_value, min_inclusive, max_inclusive, "a number")
    if float32:
        if abs(number) > FLOAT32_MAX:
            raise ValueError(
                f"`{name}` must fit in float32 (|value| <= {FLOAT32_MAX:.6g}). {_received(name, value)}"
            )
        if number != 0.0 and abs(number) < FLOAT32_TINY:
            # Say "0 or" only where the bounds accept 0 (a loss scale must be > 0).
            zero_ok = ((min_value is None or 0.0 > min_value or (0.0 == min_value and min_inclusive))
                       and (max_value is None or 0.0 < max_value or (0.0 == max_value and max_inclusive)))
            magnitude = "" if min_value is not None and min_value >= 0.0 else " in magnitude"
            raise ValueError(
                f"`{name}` must be {'0 or ' if zero_ok else ''}at least float32's smallest normal number "
                f"({FLOAT32_TINY!r}){magnitude}: smaller values lose precision or become 0.0 in a float32 "
                f"variable. {_received(name, value)}"
            )
    return number


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """One of the strings in `choices`; TypeError for a non-string (lists included), ValueError otherwise."""
    choices = tuple(choices)
    allowed = ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a string. {_typed(name, value)}. Allowed: {allowed}")
    if value not in choices:
        raise ValueError(f"Unknown `{name}`. {_received(name, value)}. Allowed: {allowed}")
    return value


def check_callable(name: str, value: Any) -> Callable:
    """A callable."""
    if not callable(value):
        raise TypeError(f"`{name}` must be callable. {_typed(name, value)}")
    return value


def check_pairs(name: str, value: Any, types: tuple[type, type], allowed: str) -> list[tuple[Any, Any]]:
    """An iterable (not a string) of 2-tuples whose items have `types`; returned as a list."""
    def refuse(what):
        raise TypeError(f"`{name}` must be an iterable of {allowed}, or None. {what}")

    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or hasattr(value, "dtype_policy"):
        refuse(_typed(name, value))  # a layer is iterable in no useful way: say so, not "bad element"
    pairs = list(value)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(p, t) for p, t in zip(pair, types))):
            refuse(f"Received an element: {pair!r}")
    return pairs


def check_no_extra_kwargs(where: str, kwargs: dict[str, Any], allowed: Iterable[str] = ()) -> None:
    """TypeError naming every keyword argument `where` does not take."""
    allowed = tuple(allowed)
    unknown = sorted(k for k in kwargs if k not in allowed)
    if unknown:
        hint = f" Allowed: {', '.join(allowed)}" if allowed else ""
        raise TypeError(f"{where} got unexpected keyword argument(s): {', '.join(unknown)}.{hint}")

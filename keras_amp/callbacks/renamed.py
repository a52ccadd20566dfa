"""Callback arguments renamed to Keras's vocabulary (`update_freq`, as in `keras.callbacks.TensorBoard`).

The old names keep working for one release: each use warns with a `DeprecationWarning` that
names the new one.
"""

from __future__ import annotations

import warnings
from typing import Any


def _warn(old: str, new: str, where: str, stacklevel: int) -> None:
    warnings.warn(f"{where}: `{old}` is deprecated and will be removed in the next release; "
                  f"use `{new}` instead.", DeprecationWarning, stacklevel=stacklevel + 1)


def resolve(where: str, new: str, value: Any, default: Any, **old: Any) -> tuple[str, Any]:
    """(name, value) of argument `new`, or of the one old name passed instead (with a warning,
    pointing at the caller's caller: the line constructing the callback). The caller validates
    the value under the name returned, so an error names the argument that was written.

    Raises ValueError when an old name is passed together with a non-default `new`, or two old
    names together: which one is meant cannot be known.
    """
    given = {name: v for name, v in old.items() if v is not None}
    if not given:
        return new, value
    if len(given) > 1 or value != default:
        names = ([f"{new}={value!r}"] if value != default else []) + [f"{k}={v!r}" for k, v in given.items()]
        raise ValueError(f"{where}: pass only `{new}` ({', '.join(f'`{k}`' for k in given)} "
                         f"{'is its old name' if len(given) == 1 else 'are its old names'}). "
                         f"Received: {', '.join(names)}")
    (name, v), = given.items()
    _warn(name, new, where, stacklevel=3)
    return name, v


def alias(old: str, new: str, where: str) -> property:
    """A read-only attribute `old` that returns attribute `new`, with a warning."""

    def get(self):
        _warn(old, new, where, stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated: the old name of `{new}`.")

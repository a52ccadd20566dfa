"""What the user sees of keras_amp's diagnostics: warnings at their own call, errors in one line.

Where in the user's code a keras_amp warning belongs: the first frame outside the libraries.

`warnings.warn(stacklevel=...)` counts frames of the thread that warns; a callback's batch end
may run on another thread (Keras dispatches async-safe callbacks to a pool), whose stack holds no
user frame at all. So the site is found where the user's call is on the stack (`fit` calling
`on_train_begin`), kept, and the warning issued there with `warnings.warn_explicit`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings

import absl
import keras
import tensorflow as tf

import keras_amp

# Frames in these directories are library code, not the user's.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                      for m in (keras_amp, keras, tf, absl, os))


@dataclasses.dataclass(frozen=True)
class Site:
    """A source line: `filename`, `lineno`, and the module's globals (for `__warningregistry__`)."""

    filename: str
    lineno: int
    module_globals: dict


def find() -> Site | None:
    """The innermost frame of the calling thread outside keras_amp, Keras, TensorFlow, absl and
    the standard library; None when there is none (a worker thread)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRS) and not path.startswith("<frozen"):
            return Site(path, frame.f_lineno, frame.f_globals)
        frame = frame.f_back
    return None


def warn(message: str, category: type[Warning], site: Site | None = None) -> None:
    """Issues `message` at `site` (else at the calling thread's innermost user frame)."""
    site = site or find()
    if site is None:
        warnings.warn(message, category, stacklevel=2)
        return
    registry = site.module_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, site.filename, site.lineno,
                           module=site.module_globals.get("__name__"), registry=registry,
                           module_globals=site.module_globals)


_ERROR_PREFIX = re.compile(r"^[A-Za-z_.]*(Error|Exception): ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Lines of TensorFlow's and Keras's error texts that are frames or framing, not the error.
_NOISE = ("Graph execution error", "Detected at node", "in user code", "[[", "Exception encountered when calling")


def one_line(e: BaseException) -> str:
    """`e` as one line, its type and what went wrong, without the stack frames TensorFlow and
    Keras put in their messages ("defined at (most recent call last): File ...", "in user
    code:", "Arguments received by ...")."""
    text = e.message if isinstance(getattr(e, "message", None), str) else str(e)
    text = _ANSI.sub("", text)  # Keras emboldens the line that matters
    text = text.split("Arguments received by")[0]
    kept, after_frame = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith('File "'):
            after_frame = True
            continue
        if after_frame and line[:1].isspace() and not _ERROR_PREFIX.match(stripped):
            after_frame = False  # the source line printed under a frame
            continue
        after_frame = False
        if not stripped.startswith(_NOISE):
            kept.append(stripped)
    nested = [_ERROR_PREFIX.sub("", line) for line in kept if _ERROR_PREFIX.match(line)]
    if nested:  # a traced error re-raised with the original's "ValueError: ..." at its end
        message = nested[-1]
    elif kept:
        # TensorFlow states the error after the frames; everyone else first.
        message = kept[-1] if type(e).__module__.startswith("tensorflow") else kept[0]
    else:
        message = ""
    return f"{type(e).__name__}: {message}"[:400]

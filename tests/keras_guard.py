"""Shared by the guard tests: a short, stable digest of a Keras/TF function's source."""

import hashlib
import inspect


def source_digest(fn) -> str:
    """sha256 of `inspect.getsource(fn)`, first 16 hex digits (pinned per Keras version)."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]

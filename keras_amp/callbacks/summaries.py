"""TensorBoard event files for the callbacks' `log_dir`, written with `tf.summary`.

Scalars go through `tf.summary.scalar`, as in `keras.callbacks.TensorBoard`. Both need the
`tensorboard` package (TensorFlow 2.21 no longer installs it), which is also what reads the files:
`require_tensorboard` says so when a callback is given a `log_dir`, before training starts.
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf


def require_tensorboard(log_dir: Any) -> str:
    """`log_dir` as a string; ImportError naming the package when `tensorboard` is not installed."""
    try:
        import tensorboard  # noqa: F401  (tf.summary.scalar imports it when called)
    except ImportError as error:
        raise ImportError(
            "`log_dir` writes TensorBoard summaries with tf.summary, which needs the tensorboard "
            f"package: pip install tensorboard. Received: log_dir={log_dir!r}. Allowed: log_dir=None "
            "without it") from error
    return os.fspath(log_dir)


class Writer:
    """A TensorBoard event-file writer for `log_dir` (created on first use)."""

    def __init__(self, log_dir: str):
        self.log_dir = require_tensorboard(log_dir)
        self._writer = None

    def _get(self):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        return self._writer

    def scalars(self, values: dict, step: int, prefix: str = "") -> None:
        """One `tf.summary.scalar` per key of `values`, tagged `prefix + key`."""
        with self._get().as_default():
            for key, value in values.items():
                tf.summary.scalar(f"{prefix}{key}", float(value), step=step)

    def histogram(self, tag: str, buckets: list[tuple[float, float, float]], step: int) -> None:
        """A histogram already bucketed: rows (left edge, right edge, count).

        `tf.summary.histogram` buckets raw values itself; the gradient probe keeps counts per
        exponent, not the elements, so the rows are written in the format `tf.summary.histogram`
        produces, with TensorBoard's own histogram metadata.
        """
        from tensorboard.plugins.histogram import metadata

        data = tf.constant(buckets if buckets else [[0.0, 0.0, 0.0]], tf.float64)
        with self._get().as_default():
            tf.summary.write(tag, data, step=step,
                             metadata=metadata.create_summary_metadata(display_name=None, description=None))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

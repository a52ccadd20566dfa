"""TensorBoard scalars and histograms written with TensorFlow alone.

`tf.summary.scalar` / `histogram` need the `tensorboard` package installed; `tf.summary.write`
with the plugin metadata TensorBoard reads does not. The callbacks write through here, so their
event files exist whether or not TensorBoard is installed where training runs.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import summary_pb2


def _metadata(plugin: str, data_class: int) -> summary_pb2.SummaryMetadata:
    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = plugin
    metadata.data_class = data_class
    return metadata


_SCALAR = _metadata("scalars", summary_pb2.DATA_CLASS_SCALAR)
_HISTOGRAM = _metadata("histograms", summary_pb2.DATA_CLASS_TENSOR)


class Writer:
    """A TensorBoard event-file writer for `log_dir` (created on first use)."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self._writer = None

    def _get(self):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        return self._writer

    def scalars(self, values: dict, step: int, prefix: str = "") -> None:
        """One scalar per key of `values` (a float32 tensor, TensorBoard's scalar format)."""
        with self._get().as_default():
            for key, value in values.items():
                tf.summary.write(f"{prefix}{key}", tf.constant(float(value), tf.float32), step=step,
                                 metadata=_SCALAR)

    def histogram(self, tag: str, buckets: list[tuple[float, float, float]], step: int) -> None:
        """A pre-bucketed histogram: rows (left edge, right edge, count), TensorBoard's v2 format."""
        data = tf.constant(buckets if buckets else [[0.0, 0.0, 0.0]], tf.float64)
        with self._get().as_default():
            tf.summary.write(tag, data, step=step, metadata=_HISTOGRAM)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

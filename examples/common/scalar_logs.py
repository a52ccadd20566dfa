"""TensorBoard scalar logs without the tensorboard package.

`keras.callbacks.TensorBoard` needs the `tensorboard` package for `tf.summary.scalar`, and
keras_amp does not depend on it. TensorFlow's own `tf.summary.write` with the scalars plugin's
metadata writes the same event files; `pip install tensorboard; tensorboard --logdir DIR`
shows them.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

_SCALAR = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
    data_class=summary_pb2.DATA_CLASS_SCALAR,
)


def write_scalars(writer, values: dict, step: int, prefix: str = "") -> None:
    """Writes each finite number in `values` as a TensorBoard scalar at `step`."""
    with writer.as_default():
        for key, value in values.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            tf.summary.write(prefix + key, tf.constant(number, tf.float32), step=step, metadata=_SCALAR)
    writer.flush()


class ScalarLogs(keras.callbacks.Callback):
    """Writes every `fit` epoch's logs (loss, accuracy, loss scale, ...) as `epoch_<name>` scalars."""

    def __init__(self, log_dir: str):
        super().__init__()
        self.log_dir = log_dir
        self._writer = None

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        write_scalars(self._writer, logs or {}, epoch, prefix="epoch_")

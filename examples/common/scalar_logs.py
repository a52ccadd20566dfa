"""TensorBoard logs of the examples: Keras's TensorBoard callback, and `tf.summary` for the custom loop.

Both need the `tensorboard` package (TensorFlow 2.21 no longer installs it; `make` installs it
with the test extra). Without it the examples train as usual and say once that they write no
TensorBoard logs, and how to get them.
"""

from __future__ import annotations

import importlib.util

_SAID = []


def available() -> bool:
    """Whether TensorBoard logs can be written; the first time it is False, says so on stdout."""
    if importlib.util.find_spec("tensorboard") is not None:
        return True
    if not _SAID:
        _SAID.append(True)
        print("TensorBoard logs: not written (the tensorboard package is not installed: pip install tensorboard)",
              flush=True)
    return False


def callbacks(log_dir: str) -> list:
    """[keras.callbacks.TensorBoard] writing each epoch's logs under `log_dir`, or [] without tensorboard."""
    import keras

    if not available():
        return []
    return [keras.callbacks.TensorBoard(log_dir, write_graph=False)]


def write_scalars(writer, values: dict, step: int, prefix: str = "") -> None:
    """Writes each number in `values` as a TensorBoard scalar at `step` (nothing without tensorboard)."""
    import tensorflow as tf

    if not available():
        return
    with writer.as_default():
        for key, value in values.items():
            tf.summary.scalar(prefix + key, float(value), step=step)
    writer.flush()

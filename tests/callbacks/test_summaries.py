"""keras_amp.callbacks.summaries: TensorBoard event files written with tf.summary, and the tensorboard check."""

import glob
import os
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

from keras_amp.callbacks import summaries
from keras_amp.callbacks.loss_scale import LossScaleMonitor


def _read(log_dir):
    """tag -> [(step, value array, plugin name)] over every event file under `log_dir`."""
    found = {}
    for path in sorted(glob.glob(os.path.join(str(log_dir), "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                found.setdefault(v.tag, []).append(
                    (event.step, tf.make_ndarray(v.tensor), v.metadata.plugin_data.plugin_name))
    return found


def test_log_dir_without_tensorboard_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    with pytest.raises(ImportError, match=r"needs the tensorboard package: pip install tensorboard\. "
                                          r"Received: log_dir='.*logs'"):
        LossScaleMonitor(log_dir=str(tmp_path / "logs"))
    assert LossScaleMonitor().log_dir is None  # no log_dir, no tensorboard needed


def test_require_tensorboard_gives_the_path_as_a_string(tmp_path):
    pytest.importorskip("tensorboard")
    path = pathlib.Path(tmp_path) / "logs"
    assert summaries.require_tensorboard(path) == str(path)
    assert summaries.require_tensorboard("relative/dir") == "relative/dir"


def test_scalars_are_written_on_first_use_under_their_prefixed_tags(tmp_path):
    pytest.importorskip("tensorboard")
    writer = summaries.Writer(tmp_path)
    writer.flush()  # nothing written yet: no file is created before the first summary
    assert glob.glob(os.path.join(str(tmp_path), "events.out.tfevents.*")) == []
    writer.scalars({"loss_scale": 256.0, "overflow_count": np.int64(3)}, step=4, prefix="batch_")
    writer.scalars({"loss_scale": 128.0}, step=8, prefix="batch_")
    writer.close()
    events = _read(tmp_path)
    assert sorted(events) == ["batch_loss_scale", "batch_overflow_count"]
    assert [(step, float(v), plugin) for step, v, plugin in events["batch_loss_scale"]] == [
        (4, 256.0, "scalars"), (8, 128.0, "scalars")]
    assert [(step, float(v)) for step, v, _ in events["batch_overflow_count"]] == [(4, 3.0)]
    assert writer._writer is None  # closed; a later write opens a new file


def test_histogram_rows_are_written_as_given_with_histogram_metadata(tmp_path):
    pytest.importorskip("tensorboard")
    writer = summaries.Writer(str(tmp_path))
    buckets = [(-3.0, -2.0, 5.0), (-2.0, -1.0, 0.0), (4.0, 5.0, 2.0)]
    writer.histogram("gradients/k/exponent", buckets, step=2)
    writer.histogram("gradients/empty/exponent", [], step=2)
    writer.close()
    events = _read(tmp_path)
    ((step, rows, plugin),) = events["gradients/k/exponent"]
    assert step == 2 and plugin == "histograms"
    np.testing.assert_array_equal(rows, np.asarray(buckets, np.float64))  # exact: no re-bucketing
    assert rows.dtype == np.float64
    # An empty histogram is one empty bucket, the shape TensorBoard reads.
    np.testing.assert_array_equal(events["gradients/empty/exponent"][0][1], [[0.0, 0.0, 0.0]])

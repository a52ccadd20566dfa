"""`jit_compile=True` + MirroredStrategy + loss scaling (keras-team/keras#21366), one process per case.

Stock Keras crashes there with several GPUs (a merge_call inside the XLA-compiled step). The
several-replica case needs two GPUs: on CPUs, XLA cannot read a MirroredVariable's copy on a
second logical device, so even plain SGD fails there ("Trying to access resource ... located in
device CPU:1 from device CPU:0"); it is skipped without two GPUs. With one replica both train.
"""

import pytest
import tensorflow as tf

from tests.distribute.harness import single

pytestmark = pytest.mark.distributed


def test_one_replica_trains_under_xla_like_stock():
    stock = single("jit_mirrored", "stock", "cpu1")
    ours = single("jit_mirrored", "ours", "cpu1")
    for r in (stock, ours):
        assert "error" not in r, r.get("traceback")
        assert r["replicas"] == 1 and r["finite"], r
    assert ours["optimizer"].startswith("keras_amp.") and stock["optimizer"].startswith("keras.")
    assert ours["losses"][-1] < ours["losses"][0]  # it trains


@pytest.mark.skipif(len(tf.config.list_physical_devices("GPU")) < 2, reason="needs two GPUs (see the module docstring)")
def test_two_gpus_ours_trains_where_stock_crashes():
    stock = single("jit_mirrored", "stock", "gpu2")
    ours = single("jit_mirrored", "ours", "gpu2")
    assert "error" in stock, stock  # keras-team/keras#21366
    assert "error" not in ours, ours.get("traceback")
    assert ours["replicas"] == 2 and ours["finite"], ours

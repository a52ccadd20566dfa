"""Replica consistency of keras_amp's LossScaleOptimizer under MirroredStrategy (2 logical CPUs)."""

import pytest

from tests.distribute.harness import single

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def result():
    out = single("mirrored_overflow")
    assert "error" not in out, out.get("traceback")
    assert out["num_replicas"] == 2
    return out


@pytest.mark.parametrize("poisoned", [1, 0], ids=["replica1", "replica0"])
def test_ours_skips_on_every_replica(result, poisoned):
    r = result[f"ours_replica{poisoned}"]
    # Guard: only the poisoned replica saw non-finite local gradients.
    assert r["local_finite"] == [i != poisoned for i in range(2)]
    assert r["weights_finite"] and r["replicas_identical"] and r["weights_unchanged"]
    assert r["scale_after"] == r["scale_before"] / 2  # halved exactly once
    assert r["overflow_count"] == 1 and r["iterations"] == 1 and r["total_steps"] == 2


def test_stock_writes_non_finite_weights_when_only_replica1_overflows(result):
    r = result["stock_replica1"]
    assert r["local_finite"] == [True, False]
    assert not r["weights_finite"]  # stock defect: replica 0's flag decided, NaN was applied
    assert r["scale_after"] == r["scale_before"]  # and the scale never backed off


def test_stock_handles_replica0_overflow(result):
    r = result["stock_replica0"]
    assert r["local_finite"] == [False, True]
    assert r["weights_finite"] and r["weights_unchanged"]
    assert r["scale_after"] == r["scale_before"] / 2

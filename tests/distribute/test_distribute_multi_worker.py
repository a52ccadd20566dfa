"""MultiWorkerMirroredStrategy with 2 worker processes on 127.0.0.1 (see harness.py for timeouts)."""

import math

import pytest

from keras_amp.distribute import local_cluster
from tests.distribute.harness import COLLECTIVE_TIMEOUT, ENV, argv, cluster, tagged

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "policy, atol",
    [
        pytest.param("mixed_bfloat16", 6e-3, id="mixed_bfloat16"),
        pytest.param("float32", 1e-5, id="float32"),
    ],
)
def test_fit_identical_on_both_workers_and_matches_reference(policy, atol):
    workers, (r0, r1) = cluster("mwms_fit", policy, "full", COLLECTIVE_TIMEOUT)
    assert all(w.returncode == 0 for w in workers), [w.tail() for w in workers]
    assert r0["fix_installed"] and r0["replicas"] == 2
    # VerifyPrecision ran at fit start on both workers and compared the model and optimizer too.
    assert {"layer_policies", "loss_scale", "policy"} <= set(r0["verified_fields"])
    assert r0["verified_fields"] == r1["verified_fields"]
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 2
    assert r0["digest"] == r1["digest"] and r0["finite"]
    assert r0["iterations"] == r1["iterations"] == 8
    assert r0["ref_max_abs_diff"] <= atol, r0  # float64 NumPy SGD over the same global batches


def test_overflow_on_worker_1_only_both_skip():
    workers, (r0, r1) = cluster("mwms_overflow", "amp", COLLECTIVE_TIMEOUT)
    assert all(w.returncode == 0 for w in workers), [w.tail() for w in workers]
    for r in (r0, r1):
        # Guard: worker 1's step 2 of each epoch overflowed, so exactly 2 global steps were skipped.
        assert r["overflow_count"] == 2 and r["total_steps"] == 8 and r["iterations"] == 6
        assert r["scale"] == 2.0**8 / 4  # halved once per overflow (hysteresis=1)
        assert r["finite"]
        assert r["ref_max_abs_diff"] <= 5e-4, r  # float16 compute vs float64 SGD skipping steps 2, 6
    assert r0["digest"] == r1["digest"] and r0["consecutive_overflows"] == r1["consecutive_overflows"] == 0
    # The epoch's mean loss includes the poisoned batch's inf on both workers alike.
    assert [math.isnan(v) for v in r0["losses"]] == [math.isnan(v) for v in r1["losses"]]


def test_stock_optimizer_deadlocks_on_one_worker_overflow():
    """Stock Keras decides on local gradients: worker 0 all-reduces gradients, worker 1 skips to the
    next collective; both wait until the (short) collective timeout fires."""
    timeout = 20
    workers = local_cluster.launch(argv("mwms_overflow", "stock", timeout), 2, timeout=240, env=ENV)
    assert not any(w.timed_out for w in workers), [w.tail() for w in workers]
    assert all(w.returncode != 0 for w in workers), [w.tail() for w in workers]
    # Each worker dies of the collective timeout (status 3 with its error), or TensorFlow tears the
    # process down once the peer's collective was cancelled: SIGABRT, or SIGSEGV in its teardown
    # (seen once in a clean-clone CI run on a Zen 3, after the timeout had been reported).
    errors = [tagged(w.stdout, "RESULT") for w in workers]
    timed_out = [e for found in errors for e in found if "Collective has timed out" in e.get("message", "")]
    assert timed_out, [w.tail() for w in workers]
    assert all(w.returncode in (3, -6, -11) for w in workers), [w.tail() for w in workers]


@pytest.mark.parametrize(
    "field, stage, expected",
    [
        pytest.param("policy", "multi_worker", {"policy", "compute_dtype", "loss_scaling"}, id="policy"),
        pytest.param("tf32", "multi_worker", {"tf32"}, id="tf32"),
        # VerifyPrecision: at fit start (on_train_begin) and at evaluate start (on_test_begin).
        pytest.param("tier", "fit", {"loss_scale"}, id="loss_scale_tier-fit"),
        pytest.param("layer_policies", "evaluate", {"layer_policies"}, id="layer_policy-evaluate"),
    ],
)
def test_mismatch_raises_on_every_worker_naming_the_field(field, stage, expected):
    workers, results = cluster("mismatch", field, COLLECTIVE_TIMEOUT)
    assert all(w.returncode == 0 for w in workers), [w.tail() for w in workers]
    for r in results:
        assert r["stage"] == stage and set(r["fields"]) == expected, r
        for name in expected:
            assert name in r["message"]
        assert "worker 0" in r["message"] and "worker 1" in r["message"]
        assert r["seconds"] < 30, r  # seconds, not a collective timeout (90 s)
    assert results[0]["message"] == results[1]["message"]

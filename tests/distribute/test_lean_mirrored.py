"""LeanAdam and 16-bit frozen weights under MirroredStrategy: the update is the same on every replica."""

import math

import pytest

from tests.distribute.harness import single

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("policy,compensation,stored,update", [
    ("mixed_bfloat16", "stochastic", "bfloat16", "kernel"),
    ("mixed_float16", "kahan", "float16", "in_place"),
])
def test_lean_tier_and_frozen_weights_are_identical_on_every_replica(policy, compensation, stored, update):
    """`update`: the single compiled kernel, or (every weight counted as large) the in-place calls
    (the same first / second / put calls as "split")."""
    r = single("mirrored_lean", policy, compensation, *(["in_place"] if update == "in_place" else []))
    assert "error" not in r, r.get("traceback")
    assert r["replicas"] == 2 and r["mirrored"] > 0
    assert r["replicas_identical"], r
    assert set(r["storage"]) == {stored}  # frozen first layer and lean second layer alike
    assert compensation in r["lean"]
    assert (r["in_place_configurations"] > 0) == (update == "in_place"), r
    assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0], r

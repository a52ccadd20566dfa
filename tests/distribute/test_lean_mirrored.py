"""LeanAdam and 16-bit frozen weights under MirroredStrategy: the update is the same on every replica."""

import math

import pytest

from tests.distribute.harness import single

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("policy,compensation,stored", [
    ("mixed_bfloat16", "stochastic", "bfloat16"),
    ("mixed_float16", "kahan", "float16"),
])
def test_lean_tier_and_frozen_weights_are_identical_on_every_replica(policy, compensation, stored):
    r = single("mirrored_lean", policy, compensation)
    assert "error" not in r, r.get("traceback")
    assert r["replicas"] == 2 and r["mirrored"] > 0
    assert r["replicas_identical"], r
    assert set(r["storage"]) == {stored}  # frozen first layer and lean second layer alike
    assert compensation in r["lean"]
    assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0], r

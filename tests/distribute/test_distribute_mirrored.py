"""MirroredStrategy over 2 logical CPUs (one subprocess per case): fit under both mixed policies."""

import pytest

from tests.distribute.harness import single

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "policy, optimizer, atol",
    [
        # bfloat16 keeps 8 mantissa bits: compute rounding accumulates to ~1.5e-3 over 8 steps.
        pytest.param("mixed_bfloat16", "sgd", 6e-3, id="mixed_bfloat16-sgd"),
        # float16 keeps 11 bits; measured ~5.5e-5 against the float64 reference.
        pytest.param("mixed_float16", "amp_lso", 5e-4, id="mixed_float16-keras_amp_lso"),
    ],
)
def test_mirrored_fit_matches_float64_reference(policy, optimizer, atol):
    r = single("mirrored_fit", policy, optimizer)
    assert "error" not in r, r.get("traceback")
    assert r["replicas"] == 2
    assert r["compute_dtype"] == policy.split("_")[1] and r["variable_dtype"] == "float32"
    assert r["finite"] and r["replicas_identical"]
    assert r["ref_max_abs_diff"] <= atol, r
    assert r["iterations"] == 8 - len(r["skipped_steps"])
    if optimizer == "amp_lso":
        # Guard: the overflow edge case was reached (2**15 overflows float16 gradients at least once),
        # and each skipped step halved the scale exactly once.
        assert r["skipped_steps"], r
        assert r["scale"] == 2.0**15 / 2 ** len(r["skipped_steps"])


def test_mirrored_fit_float16_stock_optimizer_diverges_ours_holds():
    """Stock Keras 3.15 takes replica 0's finite flag only: the other replica's inf reaches the weights."""
    stock = single("mirrored_fit", "mixed_float16", "stock_lso")
    assert "error" not in stock, stock.get("traceback")
    assert not stock["finite"], stock
    ours = single("mirrored_fit", "mixed_float16", "amp_lso")
    assert ours["finite"] and ours["replicas_identical"], ours

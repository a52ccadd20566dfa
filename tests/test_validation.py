"""keras_amp.validation: the one way public arguments are checked."""

import math

import numpy as np
import pytest

from keras_amp import validation as v


class TestCheckInt:
    @pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3)], ids=["int", "int64", "int32", "uint8"])
    def test_integral_numbers_become_python_int(self, value):
        out = v.check_int("steps", value, min_value=1)
        assert out == 3 and type(out) is int

    @pytest.mark.parametrize("value", [True, np.bool_(True), 3.0, "3", None, [3]], ids=str)
    def test_non_integers_are_type_errors_naming_the_argument(self, value):
        with pytest.raises(TypeError, match=r"`steps` must be an integer\. Received: steps="):
            v.check_int("steps", value)

    def test_bounds(self):
        with pytest.raises(ValueError, match=r"`steps` must be an integer >= 1\. Received: steps=0"):
            v.check_int("steps", 0, min_value=1)
        with pytest.raises(ValueError, match=r"`steps` must fit in int64"):
            v.check_int("steps", 10**20)  # does not fit an int64 variable
        assert v.check_int("steps", 10**20, int64=False) == 10**20
        with pytest.raises(ValueError, match=r"`steps` must be an integer <= 2147483647\. Received: steps=2147483648"):
            v.check_int("steps", 2**31, max_value=v.INT32_MAX)
        with pytest.raises(ValueError, match=r"> 0"):
            v.check_int("n", 0, min_value=0, min_inclusive=False)


class TestCheckFloat:
    def test_real_numbers_become_python_float(self):
        for value in (2, 2.0, np.float16(2.0), np.float64(2.0), np.int64(2)):
            out = v.check_float("scale", value)
            assert out == 2.0 and type(out) is float

    @pytest.mark.parametrize("value", [True, "1.0", None, [1.0], 1j], ids=str)
    def test_non_numbers_are_type_errors(self, value):
        with pytest.raises(TypeError, match=r"`scale` must be a number\. Received: scale="):
            v.check_float("scale", value)

    @pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan")], ids=str)
    def test_non_finite_values_are_value_errors(self, value):
        with pytest.raises(ValueError, match=r"`scale` must be a finite number"):
            v.check_float("scale", value)

    def test_float32_range(self):
        # The edge: 1e-40 is a float32 subnormal, 1e-46 rounds to 0.0, 1e39 to inf.
        with np.errstate(over="ignore"):
            assert np.float32(1e-46) == 0.0 and np.isinf(np.float32(1e39)) and 0 < np.float32(1e-40) < v.FLOAT32_TINY
        for bad in (1e-40, 1e-46, 1e39, -1e39):
            with pytest.raises(ValueError, match=r"`min_scale` must .*float32"):
                v.check_float("min_scale", bad, float32=True)
        assert v.check_float("min_scale", v.FLOAT32_TINY, float32=True) == v.FLOAT32_TINY
        assert v.check_float("min_scale", 0.0, float32=True) == 0.0
        assert v.check_float("x", 1e39) == 1e39  # without float32=True only finiteness is checked

    @pytest.mark.parametrize("value, bounds, expected", [
        (-1e-40, dict(), r"must be 0 or at least float32's smallest normal number \(1\.17.*\) in magnitude"),
        (1e-40, dict(min_value=0.0), r"must be 0 or at least float32's smallest normal number \(1\.17.*\): smaller"),
        (1e-40, dict(min_value=0.0, min_inclusive=False), r"must be at least float32's smallest normal number "
                                                          r"\(1\.17.*\): smaller"),
        (-1e-40, dict(min_value=-1.0, max_value=0.0, max_inclusive=False),
         r"must be at least float32's .* in magnitude"),
    ], ids=["unbounded", "zero_allowed", "positive", "negative"])
    def test_subnormal_message_offers_zero_only_where_the_bounds_accept_it(self, value, bounds, expected):
        # A loss scale must be > 0: its message must not offer 0, which the bound refuses.
        with pytest.raises(ValueError, match=expected):
            v.check_float("min_scale", value, float32=True, **bounds)

    def test_bounds_and_infinity_when_allowed(self):
        with pytest.raises(ValueError, match=r"`rate` must be a number >= 0 and < 1\. Received: rate=1"):
            v.check_float("rate", 1, min_value=0, max_value=1, max_inclusive=False)
        assert v.check_float("limit", math.inf, finite=False, min_value=0) == math.inf
        with pytest.raises(ValueError, match="finite"):
            v.check_float("limit", math.nan, finite=False)


class TestOthers:
    def test_bool(self):
        assert v.check_bool("force", np.bool_(False)) is False
        for bad in ("no", 0, 1, None):
            with pytest.raises(TypeError, match=r"`force` must be True or False\. Received: force="):
                v.check_bool("force", bad)

    def test_choice(self):
        assert v.check_choice("tier", "small", ("small", "large")) == "small"
        with pytest.raises(ValueError, match=r"Unknown `tier`\. Received: tier='bogus'\. Allowed: 'small', 'large'"):
            v.check_choice("tier", "bogus", ("small", "large"))
        with pytest.raises(TypeError, match=r"`tier` must be a string\. .*list"):
            v.check_choice("tier", ["small"], ("small", "large"))  # unhashable: still a clear TypeError

    def test_type_callable_and_kwargs(self):
        with pytest.raises(TypeError, match=r"`model` must be a keras\.Model\. Received: model='x' of type str"):
            v.check_type("model", "x", (int,), "a keras.Model")
        assert v.check_type("n", 3, int, "an int") == 3
        with pytest.raises(TypeError, match=r"`fn` must be callable"):
            v.check_callable("fn", 3)
        with pytest.raises(TypeError, match=r"wrap\(\) got unexpected keyword argument\(s\): foo\. Allowed: tier"):
            v.check_no_extra_kwargs("wrap()", {"foo": 1}, ("tier",))
        v.check_no_extra_kwargs("wrap()", {"tier": 1}, ("tier",))

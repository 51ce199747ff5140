"""fastattn.testing: the rule passes and fails where it should, names the worst element, handles NaN and inf."""
import re
import subprocess
import sys

import numpy as np
import pytest

from fastattn.testing import (RuleCheck, UlpCheck, abs_errors, assert_half_within_1ulp, assert_within_rule,
                              max_abs_error, ulp_distance, within_half_1ulp, within_rule)

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - only without ml_dtypes
    BF16 = None
needs_bf16 = pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")


def test_importing_fastattn_testing_loads_no_numba():
    code = "import sys, fastattn.testing; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------------------------------------------------------
# max_abs_error
def test_max_abs_error_is_the_largest_difference():
    assert max_abs_error(np.array([1.0, 2.0, 3.0]), np.array([1.5, 2.0, 2.0])) == 1.0
    assert max_abs_error(np.zeros(0), np.zeros(0)) == 0.0


def test_nan_in_both_and_the_same_inf_are_equal():
    a = np.array([np.nan, np.inf, -np.inf, 1.0])
    b = np.array([np.nan, np.inf, -np.inf, 1.25])
    assert max_abs_error(a, b) == 0.25
    np.testing.assert_array_equal(abs_errors(a, b), [0.0, 0.0, 0.0, 0.25])


@pytest.mark.parametrize("a, b", [(np.nan, 1.0), (1.0, np.nan), (np.inf, -np.inf), (np.inf, 1.0), (1.0, -np.inf)])
def test_nan_in_one_only_or_mismatched_inf_is_an_infinite_error(a, b):
    assert max_abs_error(np.array([0.0, a]), np.array([0.0, b])) == np.inf


def test_shapes_that_do_not_broadcast_are_a_value_error_naming_both():
    with pytest.raises(ValueError, match=r"actual has shape \(3,\) and reference \(2,\)"):
        max_abs_error(np.zeros(3), np.zeros(2))


def test_non_numeric_input_is_a_type_error():
    with pytest.raises(TypeError, match="actual must be an array of real numbers"):
        max_abs_error(np.array(["a"], dtype=object), np.zeros(1))


# ---------------------------------------------------------------------------------------------------------------
# within_rule / assert_within_rule
def test_rule_bound_is_twice_the_naive_error_plus_the_floor():
    ref = np.array([1.0, 2.0, 3.0])
    naive = ref + np.array([0.0, 1e-3, 0.0])
    check = within_rule(ref + 2e-3, ref, naive, floor=1e-6)
    assert isinstance(check, RuleCheck)
    assert check.error == pytest.approx(2e-3)
    assert check.bound == pytest.approx(2e-3 + 1e-6)
    assert check.ok
    assert not within_rule(ref + 2.01e-3, ref, naive, floor=1e-6).ok


def test_rule_with_an_exact_naive_needs_the_floor():
    ref = np.linspace(-1, 1, 7)
    assert within_rule(ref + 1e-7, ref, ref, floor=2e-7).ok
    assert not within_rule(ref + 1e-7, ref, ref, floor=0.0).ok


def test_assert_within_rule_names_the_worst_element():
    ref = np.zeros((3, 4))
    naive = ref + 1e-4
    fast = ref.copy()
    fast[1, 2] = 5e-3
    fast[2, 3] = 1e-3
    with pytest.raises(AssertionError) as info:
        assert_within_rule(fast.astype(np.float32), ref, naive.astype(np.float32), floor=1e-6, what="rms_norm")
    message = str(info.value)
    assert message.startswith("rms_norm: ")
    assert "index (1, 2)" in message
    assert re.search(r"actual 0\.00499999", message)  # the float32 value, shown in full
    assert "reference 0.0" in message and "naive 9.99" in message
    assert re.search(r"bound 0\.000201 = 2 x naive float32 error 0\.0001 \+ floor 1e-06", message)


def test_assert_within_rule_passes_silently():
    ref = np.ones(5)
    assert assert_within_rule(ref, ref, ref + 1e-3, floor=0.0) is None


def test_rule_nan_where_the_reference_is_nan_passes_and_elsewhere_fails():
    ref = np.array([np.nan, 1.0])
    assert within_rule(np.array([np.nan, 1.0], np.float32), ref, ref, floor=0.0).ok
    check = within_rule(np.array([np.nan, np.nan], np.float32), ref, ref, floor=1.0)
    assert check.error == np.inf and not check.ok
    with pytest.raises(AssertionError, match=r"index \(1,\): actual nan"):
        assert_within_rule(np.array([np.nan, np.nan]), ref, ref, floor=1.0)


@pytest.mark.parametrize("floor, error", [(-1e-6, ValueError), (float("nan"), ValueError), ("1e-6", TypeError),
                                          (True, TypeError)])
def test_a_bad_floor_is_rejected_by_name(floor, error):
    with pytest.raises(error, match="floor"):
        within_rule(np.zeros(2), np.zeros(2), np.zeros(2), floor=floor)


def test_naive_of_the_wrong_shape_is_named():
    with pytest.raises(ValueError, match="naive has shape"):
        within_rule(np.zeros(3), np.zeros(3), np.zeros(2), floor=0.0)


# ---------------------------------------------------------------------------------------------------------------
# ulp_distance
def test_ulp_distance_float16_across_zero():
    values = np.array([0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 1.0, np.nextafter(np.float16(1), np.float16(2))],
                      np.float16)
    zero = np.zeros_like(values)
    np.testing.assert_array_equal(ulp_distance(values, zero), [0, 0, 1, 1, 15360, 15361])
    smallest = np.array([2.0 ** -24], np.float16)
    assert ulp_distance(smallest, -smallest)[0] == 2  # the two smallest subnormals: +0/-0 between them count once


def test_ulp_distance_float16_across_a_binade():
    below_two = np.nextafter(np.float16(2), np.float16(0))
    assert ulp_distance(np.array([below_two]), np.array([np.float16(2)]))[0] == 1
    assert ulp_distance(np.array([np.float16(2)]), np.array([np.nextafter(np.float16(2), np.float16(3))]))[0] == 1


@needs_bf16
def test_ulp_distance_bfloat16():
    one = np.array([1.0], BF16)
    up = np.array([1.0 + 2.0 ** -7], BF16)  # bfloat16 has 7 stored mantissa bits
    assert ulp_distance(one, up)[0] == 1
    assert ulp_distance(np.array([-1.0], BF16), one)[0] == 2 * 0x3F80
    assert ulp_distance(np.array([0.0], BF16), np.array([-0.0], BF16))[0] == 0


def test_ulp_distance_float32():
    x = np.array([1.0], np.float32)
    assert ulp_distance(x, np.nextafter(x, np.float32(2)))[0] == 1
    assert ulp_distance(np.array([-0.0], np.float32), np.array([0.0], np.float32))[0] == 0


def test_ulp_distance_rejects_mixed_or_wide_dtypes():
    with pytest.raises(TypeError, match="same dtype"):
        ulp_distance(np.zeros(1, np.float16), np.zeros(1, np.float32))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        ulp_distance(np.zeros(1), np.zeros(1))
    with pytest.raises(TypeError, match="numpy.ndarray"):
        ulp_distance([0.0], [0.0])


# ---------------------------------------------------------------------------------------------------------------
# float16 / bfloat16: 1 ulp of the correctly rounded value
def test_half_one_ulp_passes_and_two_fail():
    ref = np.array([1.0, 0.3, -2.5])
    rounded = ref.astype(np.float16)
    one_up = np.nextafter(rounded, np.float16(np.inf))
    check = within_half_1ulp(one_up, ref)
    assert isinstance(check, UlpCheck) and check.ok and check.ulps == 1
    two_up = np.nextafter(one_up, np.float16(np.inf))
    assert not within_half_1ulp(two_up, ref).ok
    with pytest.raises(AssertionError) as info:
        assert_half_within_1ulp(two_up, ref, what="rope_set_rows")
    message = str(info.value)
    assert message.startswith("rope_set_rows: 3 element(s)")
    assert "worst 2 ulp at index (0,)" in message and "reference 1.0" in message and "rounded 1.0" in message


def test_half_names_the_worst_element():
    ref = np.zeros((2, 3))
    fast = ref.astype(np.float16)
    fast[1, 1] = np.float16(2.0 ** -20)  # 16 ulps of subnormal float16 above zero
    fast[0, 2] = np.float16(2.0 ** -23)  # 2 ulps
    with pytest.raises(AssertionError, match=r"2 element\(s\).*worst 16 ulp at index \(1, 1\)"):
        assert_half_within_1ulp(fast, ref)


def test_half_nan_in_both_is_equal_and_in_one_fails():
    ref = np.array([np.nan, 1.0])
    assert within_half_1ulp(np.array([np.nan, 1.0], np.float16), ref).ok
    assert not within_half_1ulp(np.array([np.nan, np.nan], np.float16), ref).ok
    assert not within_half_1ulp(np.array([1.0, 1.0], np.float16), ref).ok


def test_half_overflow_to_inf_matches_an_inf_reference():
    ref = np.array([1e6, -1e6])  # beyond float16's range: rounds to +-inf
    assert within_half_1ulp(np.array([np.inf, -np.inf], np.float16), ref).ok
    assert not within_half_1ulp(np.array([np.inf, np.inf], np.float16), ref).ok


def test_half_floor_lets_near_zero_results_pass():
    ref = np.array([1e-7, 1.0])
    fast = np.array([3e-7, 1.0], np.float16)  # far in ulps near zero, 2e-7 in absolute terms
    assert not within_half_1ulp(fast, ref).ok
    assert within_half_1ulp(fast, ref, floor=4e-7).ok
    assert not within_half_1ulp(fast, ref, floor=1e-7).ok


@needs_bf16
def test_bfloat16_one_ulp():
    ref = np.array([1.0, 3.14159, -0.001])
    rounded = ref.astype(np.float32).astype(BF16)
    up = (rounded.view(np.uint16) + 1).view(BF16)  # one ulp further from zero for each
    assert within_half_1ulp(up, ref).ok
    two = (rounded.view(np.uint16) + 2).view(BF16)
    with pytest.raises(AssertionError, match="bfloat16 reference, worst 2 ulp"):
        assert_half_within_1ulp(two, ref)


def test_half_rejects_float32_actual():
    with pytest.raises(TypeError, match="actual must have dtype float16"):
        within_half_1ulp(np.zeros(2, np.float32), np.zeros(2))

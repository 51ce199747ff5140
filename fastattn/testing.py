"""The project's correctness rule, for checking a fast result against a float64 reference (NumPy only).

Like ``numpy.testing``: plain functions on arrays, usable from any test framework, and importable without
loading Numba or compiling anything.

The rule. A float32 fast result passes when its largest error against the float64 reference is at most twice the
largest error that a straightforward float32 NumPy evaluation of the same formula ("naive") makes, plus a small
absolute floor::

    max |actual - reference|  <=  2 * max |naive - reference|  +  floor

This is the rule of FlashAttention's test suite: the naive evaluation calibrates what float32 arithmetic can be
expected to get right for these inputs, so the bound tightens on easy inputs and widens only where float32
itself struggles; the floor covers outputs the naive evaluation happens to get exactly right. A test may state
an explicit per-op bound instead. float16 and bfloat16 results must be within 1 ulp of the correctly rounded
reference (``assert_half_within_1ulp``).

Non-finite values: an element that is NaN in both arrays, or the same infinity in both, counts as equal; NaN in
one only, or an infinity against anything else, counts as an infinite error (``max_abs_error``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from ._core.validate import is_bfloat16 as _is_bfloat16
from ._core.validate import FLOAT16 as _FLOAT16
from ._core.validate import FLOAT32 as _FLOAT32

__all__ = ["RuleCheck", "UlpCheck", "max_abs_error", "abs_errors", "ulp_distance", "within_rule",
           "assert_within_rule", "within_half_1ulp", "assert_half_within_1ulp", "parallel_min_bytes"]


class RuleCheck(NamedTuple):
    """What ``within_rule`` found: ``error`` = max |actual - reference|, ``bound`` = 2 * naive error + floor."""

    error: float
    bound: float
    ok: bool


class UlpCheck(NamedTuple):
    """What ``within_half_1ulp`` found: the worst distance in ulps (NaN in both counts 0), the largest absolute
    error (``max_abs_error``), and whether every element is within 1 ulp (or within the floor)."""

    ulps: int
    error: float
    ok: bool


# ---------------------------------------------------------------------------------------------------------------
# Argument checks.
def _as_float64(name: str, a: ArrayLike) -> np.ndarray:
    try:
        return np.asarray(a, np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be an array of real numbers, got {type(a).__name__}: {error}") from None


def _pair(names: tuple[str, str], a: ArrayLike, b: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64 arrays broadcast to one shape (as ``numpy.testing`` does)."""
    a64, b64 = _as_float64(names[0], a), _as_float64(names[1], b)
    if a64.shape != b64.shape:
        try:
            shape = np.broadcast_shapes(a64.shape, b64.shape)
        except ValueError:
            raise ValueError(f"{names[0]} has shape {a64.shape} and {names[1]} {b64.shape}: they must have the "
                             f"same shape (or broadcast to one)") from None
        a64, b64 = np.broadcast_to(a64, shape), np.broadcast_to(b64, shape)
    return a64, b64


def _floor(floor: float) -> float:
    if isinstance(floor, bool) or not isinstance(floor, (int, float, np.floating, np.integer)):
        raise TypeError(f"floor must be a real number, got {type(floor).__name__}")
    floor = float(floor)
    if not (math.isfinite(floor) and floor >= 0.0):
        raise ValueError(f"floor must be finite and >= 0, got {floor}")
    return floor


def _half_dtype(name: str, a: np.ndarray) -> np.dtype:
    if a.dtype != _FLOAT16 and not _is_bfloat16(a.dtype):
        raise TypeError(f"{name} must have dtype float16 or bfloat16, got {a.dtype}")
    return a.dtype


# ---------------------------------------------------------------------------------------------------------------
# Errors.
def abs_errors(actual: ArrayLike, reference: ArrayLike) -> np.ndarray:
    """Elementwise |actual - reference| in float64, shape of the two (broadcast): 0 where both are NaN or both
    the same infinity, ``inf`` where only one is NaN."""
    a64, b64 = _pair(("actual", "reference"), actual, reference)
    both_nan = np.isnan(a64) & np.isnan(b64)
    same_inf = np.isinf(a64) & (a64 == b64)
    with np.errstate(invalid="ignore"):  # inf - inf of opposite signs is inf; of equal signs is masked above
        diff = np.where(both_nan | same_inf, 0.0, np.abs(a64 - b64))
    return np.where(np.isnan(diff), np.inf, diff)


def max_abs_error(actual: ArrayLike, reference: ArrayLike) -> float:
    """max |actual - reference| over all elements (0.0 for empty arrays), NaN-aware as ``abs_errors``.

    actual, reference: arrays of one shape (or shapes that broadcast), any real dtype (bfloat16 included).
    """
    diff = abs_errors(actual, reference)
    return float(diff.max()) if diff.size else 0.0


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise distance in units in the last place between ``a`` and ``b`` (int64 array of their shape).

    a, b: arrays of the same dtype, float16, bfloat16 or float32. The count is the number of representable
    values between the two, so it is exact across zero (+0 and -0 are 0 apart; the smallest subnormals on either
    side of zero are 2 apart) and across binades. NaN operands give meaningless counts: mask them first
    (``within_half_1ulp`` does).
    """
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        raise TypeError(f"a and b must be numpy.ndarray, got {type(a).__name__} and {type(b).__name__}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.dtype == _FLOAT16 or _is_bfloat16(a.dtype):
        bits, sign = np.uint16, 0x8000
    elif a.dtype == _FLOAT32:
        bits, sign = np.uint32, 0x80000000
    else:
        raise TypeError(f"a and b must be float16, bfloat16 or float32, got {a.dtype}")
    ia = np.ascontiguousarray(a).view(bits).astype(np.int64)
    ib = np.ascontiguousarray(b).view(bits).astype(np.int64)
    # sign-magnitude -> two's complement ordering; +0 and -0 both map to 0
    oa = np.where(ia & sign, -(ia & (sign - 1)), ia)
    ob = np.where(ib & sign, -(ib & (sign - 1)), ib)
    return np.abs(oa - ob)


# ---------------------------------------------------------------------------------------------------------------
# The rule for float32 results.
def within_rule(actual: ArrayLike, reference: ArrayLike, naive: ArrayLike, *, floor: float) -> RuleCheck:
    """Whether ``actual`` meets the rule: ``max_abs_error(actual, reference) <= 2 * max_abs_error(naive,
    reference) + floor``. Returns ``RuleCheck(error, bound, ok)``.

    actual: the fast result, any shape (...). reference: the float64 reference, same shape. naive: the same
    formula evaluated straightforwardly in float32 NumPy, same shape. floor: the absolute floor (finite, >= 0),
    a few float32 roundings of the output's magnitude.
    """
    floor = _floor(floor)
    error = max_abs_error(actual, reference)
    bound = 2 * _naive_error(naive, reference) + floor
    return RuleCheck(error, bound, bool(error <= bound))


def _naive_error(naive: ArrayLike, reference: ArrayLike) -> float:
    try:
        return max_abs_error(naive, reference)
    except ValueError as error:
        raise ValueError(str(error).replace("actual", "naive")) from None


def assert_within_rule(actual: ArrayLike, reference: ArrayLike, naive: ArrayLike, *, floor: float,
                       what: str = "") -> None:
    """Raise ``AssertionError`` unless ``within_rule(actual, reference, naive, floor=floor).ok``.

    The message names the worst element: its index, the actual, reference and naive values there, the error
    and the bound. Shapes and arguments as in ``within_rule``; ``what`` prefixes the message.
    """
    error, bound, ok = within_rule(actual, reference, naive, floor=floor)
    if ok:
        return
    diff = abs_errors(actual, reference)
    a64, r64 = _pair(("actual", "reference"), actual, reference)
    n64 = np.broadcast_to(_as_float64("naive", naive), diff.shape)
    at = _worst_index(diff)
    floor = float(floor)
    raise AssertionError(
        f"{_prefix(what)}error {error:.3g} > bound {bound:.3g} = 2 x naive float32 error "
        f"{_naive_error(naive, reference):.3g} + floor {floor:.3g}; worst element at index {at}: "
        f"actual {float(a64[at])!r}, reference {float(r64[at])!r}, naive {float(n64[at])!r}")


def _worst_index(diff: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))


def _prefix(what: str) -> str:
    return f"{what}: " if what else ""


# ---------------------------------------------------------------------------------------------------------------
# float16 / bfloat16 results: 1 ulp of the correctly rounded value.
def _rounded(reference64: ArrayLike, dtype: np.dtype) -> np.ndarray:
    """The reference rounded to ``dtype`` (bfloat16 through float32, as the kernels narrow from float32)."""
    ref = _as_float64("reference64", reference64)
    with np.errstate(over="ignore"):  # beyond the format's range: +-inf, the correctly rounded value
        return ref.astype(np.float32 if _is_bfloat16(dtype) else np.float64).astype(dtype)


def _ulps_and_nan(actual: np.ndarray, reference64: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dtype = _half_dtype("actual", actual)
    rounded = _rounded(reference64, dtype)
    if rounded.shape != actual.shape:
        try:
            rounded = np.broadcast_to(rounded, actual.shape)
        except ValueError:
            raise ValueError(f"actual has shape {actual.shape} and reference64 {rounded.shape}: they must have "
                             f"the same shape") from None
    d = ulp_distance(np.ascontiguousarray(actual), np.ascontiguousarray(rounded))
    nan = np.isnan(np.asarray(actual, np.float32)) & np.isnan(np.asarray(rounded, np.float32))
    return np.where(nan, 0, d), rounded, nan


def within_half_1ulp(actual: np.ndarray, reference64: ArrayLike, *, floor: float = 0.0) -> UlpCheck:
    """Whether every element of ``actual`` (float16 or bfloat16, any shape) is within 1 ulp of ``reference64``
    (float64, same shape) rounded to ``actual``'s dtype; NaN in both counts as equal. Returns
    ``UlpCheck(ulps, error, ok)``.

    floor (default 0): elements whose absolute error is at most ``floor`` pass as well. For results that cancel
    to near zero, where the float32 computation's own error exceeds a half-precision ulp and no float32
    evaluation can promise 1 ulp; give the float32 rule's floor there, and 0 otherwise.
    """
    if not isinstance(actual, np.ndarray):
        raise TypeError(f"actual must be a numpy.ndarray of float16 or bfloat16, got {type(actual).__name__}")
    floor = _floor(floor)
    ulps, _, _ = _ulps_and_nan(actual, reference64)
    error = max_abs_error(actual, reference64)
    bad = ulps > 1
    if floor > 0.0 and bad.any():
        bad &= ~(abs_errors(actual, reference64) <= floor)
    worst = int(ulps.max()) if ulps.size else 0
    return UlpCheck(worst, error, not bool(bad.any()))


def assert_half_within_1ulp(actual: np.ndarray, reference64: ArrayLike, what: str = "", *,
                            floor: float = 0.0) -> None:
    """Raise ``AssertionError`` unless ``within_half_1ulp(actual, reference64, floor=floor).ok``.

    The message names the worst element (index, actual, reference, correctly rounded reference, ulps).
    """
    worst, _, ok = within_half_1ulp(actual, reference64, floor=floor)
    if ok:
        return
    ulps, rounded, _ = _ulps_and_nan(actual, reference64)
    if floor > 0.0:
        ulps = np.where(abs_errors(actual, reference64) <= floor, 0, ulps)
    at = _worst_index(ulps)
    ref = np.broadcast_to(_as_float64("reference64", reference64), actual.shape)
    count = int(np.count_nonzero(ulps > 1))
    raise AssertionError(
        f"{_prefix(what)}{count} element(s) more than 1 ulp from the correctly rounded {actual.dtype} reference, "
        f"worst {int(ulps[at])} ulp at index {at}: actual {float(actual[at])!r}, reference {float(ref[at])!r}, "
        f"rounded {float(rounded[at])!r}" + (f" (floor {floor:.3g})" if floor else ""))


# ---------------------------------------------------------------------------------------------------------------
# Knobs for tests; they load Numba when called.
def parallel_min_bytes(nbytes: int):
    """``with parallel_min_bytes(0):`` ops run their parallel kernels from ``nbytes`` moved, on every thread of
    the count (the parallel code on small test shapes; no measured choice). Process-wide: not while other
    threads run ops."""
    from ._core import threads as _threads

    return _threads.parallel_min_bytes(nbytes)

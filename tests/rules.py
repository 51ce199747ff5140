"""The SPEC's correctness rule, in one place.

A fast result passes when its max error against the float64 reference is at most twice the max error of a
straightforward float32 NumPy evaluation of the same formula, plus a small absolute floor (FlashAttention's
rule); float16 outputs must be within 1 ulp of the correctly rounded reference.
"""
from __future__ import annotations

import numpy as np

from fastattn._validate import BFLOAT16, FLOAT16


def max_abs_error(a: np.ndarray, b: np.ndarray) -> float:
    a64 = np.asarray(a, np.float64)
    b64 = np.asarray(b, np.float64)
    both_nan = np.isnan(a64) & np.isnan(b64)
    same_inf = np.isinf(a64) & (a64 == b64)
    diff = np.where(both_nan | same_inf, 0.0, np.abs(a64 - b64))
    return float(np.nanmax(np.where(np.isnan(diff), np.inf, diff))) if diff.size else 0.0


def assert_within_rule(fast: np.ndarray, reference: np.ndarray, naive_f32: np.ndarray, *, floor: float,
                       what: str = "") -> None:
    """max|fast - ref| <= 2 * max|naive_f32 - ref| + floor."""
    err = max_abs_error(fast, reference)
    naive = max_abs_error(naive_f32, reference)
    assert err <= 2 * naive + floor, f"{what}: error {err:.3g} > 2 x naive float32 error {naive:.3g} + {floor:.1g}"


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in ulps between two float16 (or bfloat16) arrays of the same dtype."""
    assert a.dtype == b.dtype and a.dtype.itemsize == 2
    ia = a.view(np.uint16).astype(np.int32)
    ib = b.view(np.uint16).astype(np.int32)
    # sign-magnitude -> two's complement ordering; +0 and -0 both map to 0
    oa = np.where(ia & 0x8000, -(ia & 0x7FFF), ia)
    ob = np.where(ib & 0x8000, -(ib & 0x7FFF), ib)
    return np.abs(oa - ob)


def assert_half_within_1ulp(fast: np.ndarray, reference64: np.ndarray, what: str = "") -> None:
    """A float16/bfloat16 result is within 1 ulp of the correctly rounded float64 reference."""
    assert fast.dtype in (FLOAT16, BFLOAT16)
    rounded = np.asarray(reference64, np.float64).astype(np.float32 if fast.dtype == BFLOAT16 else np.float64)
    rounded = rounded.astype(fast.dtype)
    d = ulp_distance(np.ascontiguousarray(fast), np.ascontiguousarray(rounded))
    nan = np.isnan(np.asarray(fast, np.float32)) & np.isnan(np.asarray(rounded, np.float32))
    worst = int(np.max(np.where(nan, 0, d))) if d.size else 0
    assert worst <= 1, f"{what}: {worst} ulp from the correctly rounded reference"

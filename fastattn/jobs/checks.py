"""How the main job compares a case's fast result with the float64 reference: ``fastattn.testing``'s rule.

Each factory returns a ``Check``: called with (fast result, reference result) it gives ``(error, bound, ok)``;
its ``tolerance`` says in words what ``ok`` was checked against (the table's legend and the JSON report).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import testing


@dataclass(frozen=True)
class Verdict:
    """``error``: max |fast - reference|; ``bound``: what it was held to (None when the bound is not an absolute
    error: ulps, bit equality); ``ok``: within the tolerance."""

    error: float
    bound: float | None
    ok: bool


@dataclass(frozen=True)
class Check:
    tolerance: str
    compare: Callable[[Any, Any], Verdict]

    def __call__(self, fast, reference) -> Verdict:
        return self.compare(fast, reference)


def _one_shape(*arrays) -> bool:
    """Whether the arrays have one shape: ``fastattn.testing`` broadcasts, and a result of another shape (a case
    bound to the wrong inputs) must fail here rather than be compared element by element against a broadcast."""
    return len({np.shape(a) for a in arrays}) == 1


def float32_rule(naive: np.ndarray, floor: float) -> Check:
    """The rule: max error <= 2 x the error of ``naive`` (the straightforward float32 evaluation) + ``floor``."""
    def compare(fast, reference) -> Verdict:
        if not _one_shape(fast, reference, naive):
            return Verdict(float("inf"), None, False)
        error, bound, ok = testing.within_rule(fast, reference, naive, floor=floor)
        return Verdict(error, bound, ok)
    return Check(f"<= 2x naive float32 error + {floor:.2g}", compare)


def half_1ulp(floor: float = 0.0) -> Check:
    """float16 / bfloat16 results: within 1 ulp of the correctly rounded reference (or within ``floor``)."""
    def compare(fast, reference) -> Verdict:
        if not _one_shape(fast, reference):
            return Verdict(float("inf"), None, False)
        ulps, error, ok = testing.within_half_1ulp(np.asarray(fast), reference, floor=floor)
        return Verdict(error, None, ok)
    return Check("<= 1 ulp of the rounded reference" + (f" or <= {floor:.2g}" if floor else ""), compare)


def bit_exact() -> Check:
    """Identical bytes: for ops whose result is exactly defined (a copy with one rounding)."""
    def compare(fast, reference) -> Verdict:
        if not _one_shape(fast, reference):
            return Verdict(float("inf"), 0.0, False)
        error = testing.max_abs_error(fast, reference)
        return Verdict(error, 0.0, np.asarray(fast).tobytes() == np.asarray(reference).astype(fast.dtype).tobytes())
    return Check("bit-exact", compare)


def both(first: Check, second: Check, what: str) -> Check:
    """For ops with two results: ``first`` on result 0, ``second`` on result 1 (``what`` names them); the error
    and bound reported are ``second``'s."""
    def compare(fast, reference) -> Verdict:
        a = first(fast[0], reference[0])
        b = second(fast[1], reference[1])
        return Verdict(b.error, b.bound, a.ok and b.ok)
    return Check(what.format(first.tolerance, second.tolerance), compare)

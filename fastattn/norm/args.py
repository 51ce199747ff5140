"""Arguments of ``rms_norm``, ``rms_norm_mul`` and ``add_rms_norm_mul``, shared by the fast path and the reference.

The checks are written as one cheap test per argument on the common path (a decode-sized call must stay within a
few microseconds); only when that test fails does the slower ``_core.validate`` helper run, to raise its standard
message naming the argument.
"""
from __future__ import annotations

import numpy as np

from .._core import validate as _validate
from .._core.validate import FLOAT64, STORAGE_FLOATS

_FLOATS = _validate.STORAGE_FLOAT_SET  # bfloat16 misses it and takes the full check
_MAX_FLOAT = float(np.finfo(np.float64).max)


def x_array(x, name: str = "x") -> np.ndarray:
    """A float32 / float16 / bfloat16 array with at least one axis (the normalised one is the last)."""
    if not (isinstance(x, np.ndarray) and x.dtype in _FLOATS and x.ndim >= 1):
        _validate.array(name, x, dtypes=STORAGE_FLOATS, min_ndim=1)
    return x


def eps_value(eps) -> float:
    """A finite float >= 0."""
    if eps.__class__ is float and 0.0 <= eps <= _MAX_FLOAT:  # NaN fails both comparisons
        return eps
    return _validate.real("eps", eps, minimum=0.0)


def weight(w, x: np.ndarray) -> np.ndarray:
    """``w`` repeats to ``x``'s shape: at most ``x.ndim`` axes, each length dividing ``x``'s (0 only against 0)."""
    if isinstance(w, np.ndarray) and w.dtype in _FLOATS and w.ndim == 1 and w.shape[0] == x.shape[-1]:
        return w  # the common (D,) weight
    x_array(w, "w")
    if w.ndim > x.ndim or any(m % n if n else m for n, m in zip(reversed(w.shape), reversed(x.shape))):
        raise ValueError(f"w must repeat to x's shape {x.shape} (at most {x.ndim} axes, each length dividing "
                         f"x's, aligned from the right; 0 only against 0), got shape {w.shape}")
    return w


def output(name: str, out, x: np.ndarray, reference: bool) -> np.ndarray | None:
    """``out=``: None, or a writeable array of ``x``'s shape and dtype (the reference also takes float64)."""
    if out is None:
        return None
    if not (isinstance(out, np.ndarray) and out.shape == x.shape and out.flags.writeable
            and (out.dtype == x.dtype or (reference and out.dtype == FLOAT64))):
        _validate.out_array(name, out, shape=x.shape, dtypes=(x.dtype, FLOAT64) if reference else (x.dtype,))
    return out


def _disjoint(name: str, out: np.ndarray, input_name: str, a: np.ndarray) -> None:
    """``w`` is read by many rows (it repeats), so an output may not share any memory with it."""
    if np.may_share_memory(out, a):
        raise ValueError(f"{name} overlaps {input_name}; {input_name} is read for every row, pass a separate array")


def rms_norm(x, eps, out, *, reference: bool = False):
    x = x_array(x)
    eps = eps_value(eps)
    out = output("out", out, x, reference)
    if out is not None and out is not x:
        _validate.may_share_write("out", out, ("x", x))
    return x, eps, out


def rms_norm_mul(x, w, eps, out, *, reference: bool = False):
    x = x_array(x)
    w = weight(w, x)
    eps = eps_value(eps)
    out = output("out", out, x, reference)
    if out is not None:
        _validate.may_share_write("out", out, ("x", x))
        _disjoint("out", out, "w", w)
    return x, w, eps, out


def add_rms_norm_mul(x, residual, w, eps, out, sum_out, *, reference: bool = False):
    """``residual`` has ``x``'s shape and dtype; ``out`` and ``sum_out`` may each be ``x``, ``residual``, each
    other, or separate arrays, but may not partly overlap any of them, nor overlap ``w`` at all."""
    x = x_array(x)
    residual = x_array(residual, "residual")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must have x's shape {x.shape} and dtype {x.dtype}, "
                         f"got {residual.shape} {residual.dtype}")
    w = weight(w, x)
    eps = eps_value(eps)
    out = output("out", out, x, reference)
    sum_out = output("sum_out", sum_out, x, reference)
    if sum_out is not None:
        _validate.may_share_write("sum_out", sum_out, ("x", x), ("residual", residual))
        _disjoint("sum_out", sum_out, "w", w)
    if out is not None:
        _validate.may_share_write("out", out, ("x", x), ("residual", residual), ("sum_out", sum_out))
        _disjoint("out", out, "w", w)
    return x, residual, w, eps, out, sum_out

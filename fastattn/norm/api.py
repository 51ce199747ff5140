"""RMSNorm, fused RMSNorm * weight, and residual add + RMSNorm * weight: Numba kernels.

Algorithm (per row of the last axis, length D), two passes over a row that stays in L1/L2:

1. ``total = sum(float64(x_j)**2)``: every square of a float32 (or widened float16/bfloat16) value is exact in
   float64, and the float64 accumulation is ggml's; LLVM vectorises it (``vcvtps2pd`` + 4-wide adds).
2. ``scale = float32(1 / sqrt(total / D + eps))``; ``y_j = x_j * scale * w_j`` in float32, rounded once to the
   output dtype (``from_f32``: round to nearest even).

``add_rms_norm_mul`` first writes ``s_j = x_j + residual_j`` (rounded to x's dtype: for float16/bfloat16 the
float32 sum of two half values rounds correctly, since 24 >= 2*11 + 2) and then normalises ``s`` as stored.

Layout: the leading axes are merged into one (``_core.layout.merge_leading``, never a copy), so each kernel sees 2-D
``(rows, D)`` arrays of any strides plus a 2-D weight ``(W, Dw)``: row ``r`` uses weight row ``r % W`` and column
``j`` uses weight column ``j % Dw`` (ggml's repeat). Half-precision arrays enter as 16-bit integer views
(``kernel_view``). The drivers are compiled for any-layout arrays; when every row's elements are adjacent
(``_core.kernel.adjacent_rows``, checked in Python) the rows are retyped contiguous (``_core.kernel.rows_if``), so both
passes vectorise, else they are read through their strides: at most two compiled drivers per dtype combination.

In place (``out`` is ``x``) the scaling loop reads and writes ``out``'s row alone: with two arrays pointing at the
same row, LLVM's runtime overlap check would send it down its scalar version.

Threads: below ``PARALLEL_MIN_BYTES`` moved a call runs ``*_serial`` on the calling thread; above, ``*_parallel``
spreads rows over threads with ``prange`` (rows are independent, so in-place use is safe).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from .._core import layout as _layout
from .._core import threads as _threads
from . import args as _args
from .._core.kernel import (adjacent_rows, argument_positions, call_any_layout, from_f32, kernel, kernel_view, rows_if,
                            to_f32)
from .._core.validate import FLOAT32_MAX


@kernel
def _norm_vec_wide(xr, wr, yr, inverse):
    """``yr = xr * inverse * wr`` with the product taken in float64 (``inverse`` beyond float32's range)."""
    for j in range(xr.shape[0]):
        y = np.float64(to_f32(xr[j])) * inverse
        if wr is not None:
            y *= to_f32(wr[j % wr.shape[0]])
        yr[j] = from_f32(np.float32(y), yr)


@kernel
def _norm_vec(xr, wr, yr, eps):
    """``yr = xr / sqrt(mean(xr**2) + eps) * wr`` on 1-D rows (no weight when ``wr`` is None; a shorter ``wr``
    repeats along the row). ``yr`` is ``xr`` (in place) or overlaps it nowhere: the callers validated that."""
    d = xr.shape[0]
    if d == 0:  # nothing to write (and no 0 / 0)
        return
    total = 0.0
    for j in range(d):
        v = np.float64(to_f32(xr[j]))
        total += v * v
    inverse = 1.0 / np.sqrt(total / d + eps)
    if inverse > FLOAT32_MAX:  # a row of float32 subnormals: its float32 scale would overflow, scale in float64
        _norm_vec_wide(xr, wr, yr, inverse)
        return
    scale = np.float32(inverse)
    # In place, the loops read yr itself: with two names for one row LLVM's runtime overlap check would take its
    # scalar loop (2.5x slower).
    in_place = xr.ctypes.data == yr.ctypes.data
    if wr is None:
        if in_place:
            for j in range(d):
                yr[j] = from_f32(to_f32(yr[j]) * scale, yr)
        else:
            for j in range(d):
                yr[j] = from_f32(to_f32(xr[j]) * scale, yr)
    elif wr.shape[0] == d:  # the case that matters
        if in_place:
            for j in range(d):
                yr[j] = from_f32(to_f32(yr[j]) * scale * to_f32(wr[j]), yr)
        else:
            for j in range(d):
                yr[j] = from_f32(to_f32(xr[j]) * scale * to_f32(wr[j]), yr)
    else:
        period = wr.shape[0]
        for start in range(0, d, period):
            xb = xr[start:start + period]
            yb = yr[start:start + period]
            for j in range(period):
                yb[j] = from_f32(to_f32(xb[j]) * scale * to_f32(wr[j]), yb)


@kernel
def _norm_row(x, w, out, eps, r, adjacent):
    """``out[r] = x[r] / sqrt(mean(x[r]**2) + eps) * w[r % W]`` (no weight when ``w`` is None). ``adjacent``
    True: every row's elements are adjacent, and the rows go to ``_norm_vec`` typed contiguous (its loops
    vectorise); None: as they are."""
    if w is None:
        _norm_vec(rows_if(x[r], adjacent), None, rows_if(out[r], adjacent), eps)
    else:
        _norm_vec(rows_if(x[r], adjacent), rows_if(w[r % w.shape[0]], adjacent), rows_if(out[r], adjacent), eps)


@kernel
def _add_row(x, residual, s, r, adjacent):
    xr = rows_if(x[r], adjacent)
    rr = rows_if(residual[r], adjacent)
    sr = rows_if(s[r], adjacent)
    for j in range(xr.shape[0]):
        sr[j] = from_f32(to_f32(xr[j]) + to_f32(rr[j]), sr)


# The drivers take any-layout arrays and ``adjacent`` (``_core.kernel.adjacent_rows``): at most two compiled drivers
# per dtype combination, whatever the strides. Rows are int64 in both (a prange index is unsigned, and would
# compile the row functions again).
@kernel
def _norm_serial(x, w, out, eps, adjacent):
    for r in range(x.shape[0]):
        _norm_row(x, w, out, eps, r, adjacent)


@kernel(parallel=True)
def _norm_parallel(x, w, out, eps, adjacent):
    for r in prange(x.shape[0]):
        _norm_row(x, w, out, eps, np.int64(r), adjacent)


@kernel
def _add_norm_serial(x, residual, w, s, out, eps, adjacent):
    for r in range(x.shape[0]):
        _add_row(x, residual, s, r, adjacent)
        _norm_row(s, w, out, eps, r, adjacent)


@kernel(parallel=True)
def _add_norm_parallel(x, residual, w, s, out, eps, adjacent):
    for r in prange(x.shape[0]):
        i = np.int64(r)
        _add_row(x, residual, s, i, adjacent)
        _norm_row(s, w, out, eps, i, adjacent)


#: The drivers' array arguments, typed any layout (``call_any_layout``).
_NORM_ARRAYS = argument_positions(_norm_serial, "x", "w", "out")
_ADD_NORM_ARRAYS = argument_positions(_add_norm_serial, "x", "residual", "w", "s", "out")


def _blocks(full: list[np.ndarray], w: np.ndarray | None) -> list[_layout.Block]:
    """Kernel views of the operands, the leading axes merged into one (``_core.layout.merge_leading``)."""
    full = [kernel_view(a) for a in full]
    tiled = [] if w is None else [kernel_view(w)[(None,) * (full[0].ndim - w.ndim)]]
    return _layout.merge_leading(full, tiled, full[0].ndim - 1)


def rms_norm(x: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps)``.

    x: (..., D) float32, float16 or bfloat16, any strides. out: like ``x`` (may be ``x`` itself, for in place).
    Returns ``out``, in ``x``'s dtype.
    """
    x, eps, out = _args.rms_norm(x, eps, out)
    if out is None:
        out = np.empty(x.shape, x.dtype)
    _norm_rows("rms_norm", x, None, out, eps)
    return out


def rms_norm_mul(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """Fused ``rms_norm(x, eps) * w`` in one pass.

    x: (..., D) float32, float16 or bfloat16, any strides. w: any of those dtypes, repeated along every axis to
    ``x``'s shape (each axis length divides ``x``'s; a (D,) weight is the common case). out: like ``x`` (may be
    ``x``; may not overlap ``w``). Returns ``out``, in ``x``'s dtype.
    """
    x, w, eps, out = _args.rms_norm_mul(x, w, eps, out)
    if out is None:
        out = np.empty(x.shape, x.dtype)
    _norm_rows("rms_norm_mul", x, w, out, eps)
    return out


def _norm_rows(op: str, x: np.ndarray, w: np.ndarray | None, out: np.ndarray, eps: float) -> None:
    """The norm of x's rows into out, w (None for none) repeated along x's leading axes: serially below the
    threading rule's size, else on the call site's measured team (``_core.threads``)."""
    with _threads.team(op, 2 * x.nbytes, _threads.threads_for(2 * x.nbytes)) as launch:
        _norm_rows_with(_norm_parallel if launch.n > 1 else _norm_serial, x, w, out, eps)


def _norm_rows_with(run, x: np.ndarray, w: np.ndarray | None, out: np.ndarray, eps: float) -> None:
    """``run`` (a norm kernel) over x's rows into out."""
    if x.ndim == 2 and (w is None or w.ndim == 1):  # the common case directly: the generic merge costs a fifth
        call_any_layout(run, _NORM_ARRAYS, kernel_view(x), None if w is None else kernel_view(w)[None],
                        kernel_view(out), eps, adjacent_rows(x, w, out))
        return
    for (xk, ok), weights in _blocks([x, out], w):
        wk = None if w is None else weights[0]
        call_any_layout(run, _NORM_ARRAYS, xk, wk, ok, eps, adjacent_rows(xk, wk, ok))


def add_rms_norm_mul(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float,
                     out: np.ndarray | None = None, sum_out: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Residual add fused in front of ``rms_norm_mul``: ``s = x + residual``, ``y = rms_norm(s, eps) * w``.

    x, residual: (..., D), same shape and dtype (float32, float16 or bfloat16), any strides. ``s`` is rounded to
    that dtype and ``y`` computed from ``s`` as stored. w: as in ``rms_norm_mul``. sum_out, out: like ``x``;
    either may be ``x`` or ``residual`` (in place); if both are the same array it ends up holding ``y``.
    Returns ``(s, y)``.
    """
    x, residual, w, eps, out, sum_out = _args.add_rms_norm_mul(x, residual, w, eps, out, sum_out)
    if sum_out is None:
        sum_out = np.empty(x.shape, x.dtype)
    if out is None:
        out = np.empty(x.shape, x.dtype)
    with _threads.team("add_rms_norm_mul", 4 * x.nbytes, _threads.threads_for(4 * x.nbytes)) as launch:
        run = _add_norm_parallel if launch.n > 1 else _add_norm_serial
        for (xk, rk, sk, ok), (wk,) in _blocks([x, residual, sum_out, out], w):
            call_any_layout(run, _ADD_NORM_ARRAYS, xk, rk, wk, sk, ok, eps, adjacent_rows(xk, rk, wk, sk, ok))
    return sum_out, out

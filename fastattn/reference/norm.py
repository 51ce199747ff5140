"""RMSNorm, the definition: ``y = x / sqrt(mean(x**2, last axis) + eps)`` (times ``w``), in float64.

``w`` repeats along every axis to ``x``'s shape (index ``i`` reads ``w[i % len]``), as ggml's MUL repeats its
second operand. Results are rounded once to ``x``'s dtype, or written unrounded into a float64 ``out=``.
"""
from __future__ import annotations

import numpy as np

from ..norm import args as _args


def _normalise(x64: np.ndarray, eps: float) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):  # a zero row with eps = 0 gives 0/0 = NaN, as in ggml
        return x64 / np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True) / x64.shape[-1] + eps)


def _tiled(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``w`` repeated to ``shape``: element ``(i, j, ..)`` is ``w[i % w_0, j % w_1, ..]`` (left-padded with 1s)."""
    padded = w.reshape((1,) * (len(shape) - w.ndim) + w.shape).astype(np.float64)
    return padded[np.ix_(*[np.arange(n) % m if n else np.arange(0) for n, m in zip(shape, padded.shape)])]


def _store(values: np.ndarray, out: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    if out is None:
        return values.astype(dtype)
    out[...] = values
    return out


def rms_norm(x: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm over the last axis of ``x`` (..., D); float32/float16/bfloat16; returns ``x``'s dtype."""
    x, eps, out = _args.rms_norm(x, eps, out, reference=True)
    return _store(_normalise(x.astype(np.float64), eps), out, x.dtype)


def rms_norm_mul(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """``rms_norm(x, eps) * w`` with ``w`` repeated to ``x``'s shape (a (D,) weight is the common case)."""
    x, w, eps, out = _args.rms_norm_mul(x, w, eps, out, reference=True)
    y = _normalise(x.astype(np.float64), eps) * _tiled(w, x.shape)
    return _store(y, out, x.dtype)


def add_rms_norm_mul(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float,
                     out: np.ndarray | None = None, sum_out: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``s = x + residual`` (rounded to ``x``'s dtype), ``y = rms_norm(s) * w`` computed from ``s`` as rounded.

    Returns ``(s, y)``. ``sum_out`` and ``out`` may be ``x`` or ``residual`` (in place); when both are the same
    array it ends up holding ``y``.
    """
    x, residual, w, eps, out, sum_out = _args.add_rms_norm_mul(x, residual, w, eps, out, sum_out, reference=True)
    s64 = x.astype(np.float64) + residual.astype(np.float64)
    s_stored = s64.astype(x.dtype)
    y = _normalise(s_stored.astype(np.float64), eps) * _tiled(w, x.shape)
    s = _store(s64, sum_out, x.dtype)
    return s, _store(y, out, x.dtype)

"""RoPE's per-pair tables: which position stream each rotated pair reads and its float64 angle factor (NumPy only).

For pair p: theta = pos[stream(p), n] · w[p], where

    w[p] = freq_base^(-2·k(p)/n_dims) / freq_factors[p] · (freq_scale·(1 - mix(p)) + mix(p))
    mix(p) = ext_factor · ramp(p)     (YaRN, ggml's ``rope_yarn``; 0 without it)

k(p) is the pair index (VISION: counted from 0 again in each section) and stream(p) follows ggml's
``ggml_mrope_cache_init`` section logic (always t outside the multi-position modes). The magnitude scale is
``attn_factor``, times ``1 + 0.1·ln(1/freq_scale)`` when ``ext_factor != 0``; backward negates sin.
``step_cos``/``step_sin`` are cos(w)/sin(w), correctly rounded: one position step of the cache build's
recurrence (``rope.cache``). The tables depend on the parameters only, so a parameter set computes them once
(``_args.rope.RopeParams.table``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .modes import RopeMode


def _c_max(a, b):
    return a if a > b else b  # C's MAX macro, as ggml uses it (NaN-propagation included)


def _c_min(a, b):
    return a if a < b else b


def yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims in float32 (its floor/ceil decide integer boundaries, so follow ggml's rounding)."""
    f32 = np.float32
    log_base = f32(2) * np.log(f32(freq_base))
    with np.errstate(divide="ignore", invalid="ignore"):  # n_ctx_orig = 0: log(0) = -inf, as in C
        start = np.floor(f32(n_dims) * np.log(f32(n_ctx_orig) / (f32(beta_fast) * f32(2) * f32(np.pi))) / log_base)
        end = np.ceil(f32(n_dims) * np.log(f32(n_ctx_orig) / (f32(beta_slow) * f32(2) * f32(np.pi))) / log_base)
    return float(_c_max(f32(0), start)), float(_c_min(f32(n_dims - 1), end))


class PairTable(NamedTuple):
    """The per-pair tables of one parameter set: a named tuple, so kernels take it whole as one argument."""

    streams: np.ndarray  # int64 (n_pairs,): 0..3 = t, h, w, e
    w: np.ndarray  # float64 (n_pairs,): theta = pos * w
    step_cos: np.ndarray  # float64 (n_pairs,): cos(w), sin(w), correctly rounded (libm): one position step
    step_sin: np.ndarray
    cos_scale: float  # mscale
    sin_scale: float  # mscale, negated for backward


def _pair_streams(mode: RopeMode, sections, n_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """Stream and frequency exponent of every pair (ggml_mrope_cache_init's section logic, vectorised)."""
    pairs = np.arange(n_pairs)
    if sections is None:
        return np.zeros(n_pairs, np.int64), pairs
    s0, s1, s2, _ = sections
    sector = pairs % sum(sections)
    if mode == RopeMode.IMROPE:
        streams = np.select([(sector % 3 == 1) & (sector < 3 * s1), (sector % 3 == 2) & (sector < 3 * s2),
                             (sector % 3 == 0) & (sector < 3 * s0)], [1, 2, 0], 3)
    else:
        streams = np.select([sector < s0, sector < s0 + s1, sector < s0 + s1 + s2], [0, 1, 2], 3)
    exponents = pairs
    if mode == RopeMode.VISION:
        # Each stream's exponent restarts at its section's first sector; ggml tests t, h, w, e in order, so a
        # stream whose start coincides with an earlier one's (an empty section before it) never restarts.
        starts = [0, s0, s0 + s1, s0 + s1 + s2]
        since_restart = np.empty((4, n_pairs), np.int64)
        for s, start in enumerate(starts):
            restarts = (sector == start) & (starts.index(start) == s)
            since_restart[s] = pairs - np.maximum.accumulate(np.where(restarts, pairs, 0))
        exponents = since_restart[streams, pairs]
    return streams.astype(np.int64), exponents


def pair_table(n_dims: int, mode: RopeMode, freq_base: float, freq_scale: float, n_ctx_orig: int,
               ext_factor: float, attn_factor: float, beta_fast: float, beta_slow: float,
               freq_factors: np.ndarray | None, sections, backward: bool) -> PairTable:
    """The tables of one validated parameter set (``_args.rope.RopeParams`` calls this once)."""
    n_pairs = n_dims if mode == RopeMode.VISION else n_dims // 2
    streams, exponents = _pair_streams(mode, sections, n_pairs)
    inv_freq = freq_base ** (-2.0 * exponents / n_dims)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    scale = np.full(n_pairs, freq_scale)
    mscale = attn_factor
    if ext_factor != 0:
        low, high = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        ramp = np.array([1.0 - _c_min(1.0, _c_max(0.0, (p - low) / _c_max(0.001, high - low)))
                         for p in range(n_pairs)])
        mix = ramp * ext_factor
        scale = freq_scale * (1 - mix) + mix  # theta = extrap·(freq_scale·(1 - mix) + mix)
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    w = np.ascontiguousarray(inv_freq * scale, np.float64)
    step_cos = np.array([math.cos(a) for a in w])
    step_sin = np.array([math.sin(a) for a in w])
    for a in (streams, w, step_cos, step_sin):
        a.flags.writeable = False
    return PairTable(streams, w, step_cos, step_sin, mscale, -mscale if backward else mscale)

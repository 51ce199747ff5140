"""RoPE, the definition: ggml's ``rope_ext`` (every mode, YaRN, freq_factors, backward) in float64 NumPy.

For token n, pair p of a head (pairs: NORMAL (2p, 2p+1); NEOX/MROPE/IMROPE (p, p + n_dims/2); VISION
(p, p + n_dims)) and the position stream s(p) that pair reads (always t except in the multi-position modes):

    theta_extrap = pos[s(p), n] * freq_base ** (-2 k(p) / n_dims) / freq_factors[p]
    theta_interp = freq_scale * theta_extrap
    mix          = ramp(p) * ext_factor                       (ggml's rope_yarn; 0 without YaRN)
    theta        = theta_interp * (1 - mix) + theta_extrap * mix
    mscale       = attn_factor * (1 + 0.1 ln(1 / freq_scale) if ext_factor != 0 else 1)
    (a, b)      -> (a cos theta - b sin theta, a sin theta + b cos theta) * mscale   (sin negated if backward)

k(p) is the pair index, except in VISION where each section counts from 0. Everything is float64 straight from
the formula (ggml runs a float32 recurrence ``theta *= theta_scale``); only the YaRN correction dims are computed
in float32, as ggml does, because they are floored/ceiled to integers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..rope import args as _args
from ..rope.modes import RopeMode
from ..quant.blocks import Quantized
from .._core.validate import STORAGE_FLOATS

from .quant import quantize

def _c_max(a, b):
    return a if a > b else b  # C's MAX macro: with a NaN it returns b


def _c_min(a, b):
    return a if a < b else b


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float
                   ) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims, in float32 as ggml computes it: the pair range YaRN ramps over."""
    f32 = np.float32
    with np.errstate(divide="ignore", invalid="ignore"):  # n_ctx_orig = 0: log(0) = -inf, as in C
        def corr_dim(n_rot):
            return f32(n_dims) * np.log(f32(n_ctx_orig) / (f32(n_rot) * f32(2) * f32(np.pi))) / (
                f32(2) * np.log(f32(freq_base)))
        start = np.floor(corr_dim(beta_fast))
        end = np.ceil(corr_dim(beta_slow))
    return float(_c_max(f32(0), start)), float(_c_min(f32(n_dims - 1), end))


def _yarn_ramp(pair: int, low: float, high: float) -> float:
    y = (pair - low) / _c_max(0.001, high - low)
    return 1.0 - _c_min(1.0, _c_max(0.0, y))


def pair_streams_and_exponents(params: _args.RopeParams) -> tuple[list[int], list[int]]:
    """For each rotated pair: which position stream (0..3 = t, h, w, e) it reads and its frequency exponent k."""
    streams, exponents = [], []
    if params.sections is None:
        return [0] * params.n_pairs, list(range(params.n_pairs))
    s0, s1, s2, s3 = params.sections
    period = s0 + s1 + s2 + s3
    count = [0, 0, 0, 0]  # VISION: pairs since the stream's exponent last restarted
    for p in range(params.n_pairs):
        sector = p % period
        if params.mode == RopeMode.IMROPE:
            if sector % 3 == 1 and sector < 3 * s1:
                stream = 1
            elif sector % 3 == 2 and sector < 3 * s2:
                stream = 2
            elif sector % 3 == 0 and sector < 3 * s0:
                stream = 0
            else:
                stream = 3
        else:
            stream = 0 if sector < s0 else 1 if sector < s0 + s1 else 2 if sector < s0 + s1 + s2 else 3
        if params.mode == RopeMode.VISION:
            # ggml restarts one stream's exponent where a section starts, checking t, h, w, e in that order
            # (so with an empty section only the first stream starting at that sector restarts).
            for s, start in enumerate((0, s0, s0 + s1, s0 + s1 + s2)):
                if sector == start:
                    count[s] = 0
                    break
            exponents.append(count[stream])
            count = [c + 1 for c in count]
        else:
            exponents.append(p)
        streams.append(stream)
    return streams, exponents


def rope_angles(pos: np.ndarray, params: _args.RopeParams) -> tuple[np.ndarray, np.ndarray, float]:
    """theta (N, n_pairs) float64 from ``pos`` (streams, N), and the magnitude scale mscale."""
    streams, exponents = pair_streams_and_exponents(params)
    low, high = yarn_corr_dims(params.n_dims, params.n_ctx_orig, params.freq_base, params.beta_fast,
                               params.beta_slow)
    ff = params.freq_factors if params.freq_factors is not None else np.ones(params.n_pairs)
    theta = np.empty((pos.shape[1], params.n_pairs))
    for p in range(params.n_pairs):
        extrap = pos[streams[p]].astype(np.float64) * params.freq_base ** (-2.0 * exponents[p] / params.n_dims)
        extrap = extrap / ff[p]
        interp = params.freq_scale * extrap
        mix = _yarn_ramp(p, low, high) * params.ext_factor if params.ext_factor != 0 else 0.0
        theta[:, p] = interp * (1 - mix) + extrap * mix
    mscale = params.attn_factor
    if params.ext_factor != 0:
        mscale *= 1.0 + 0.1 * np.log(1.0 / params.freq_scale)
    return theta, mscale


@dataclass(frozen=True)
class RopeCache:
    """cos and sin (N, n_pairs) float64 of every token's pairs, already scaled by mscale (sin by -1 backward)."""

    cos: np.ndarray
    sin: np.ndarray
    params: _args.RopeParams


def rope_cache(pos: np.ndarray, *, n_dims: int, mode: int, freq_base: float = 10000.0, freq_scale: float = 1.0,
               n_ctx_orig: int = 0, ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
               beta_slow: float = 1.0, freq_factors: np.ndarray | None = None, sections=None,
               backward: bool = False) -> RopeCache:
    """The cos/sin table of ``rope_ext`` for positions ``pos``; apply it with ``apply_rope_cache``."""
    params = _args.parse_params(n_dims=n_dims, mode=mode, freq_base=freq_base, freq_scale=freq_scale,
                                n_ctx_orig=n_ctx_orig, ext_factor=ext_factor, attn_factor=attn_factor,
                                beta_fast=beta_fast, beta_slow=beta_slow, freq_factors=freq_factors,
                                sections=sections, backward=backward)
    pos = _args.parse_pos(pos, params)
    theta, mscale = rope_angles(pos, params)
    sign = -1.0 if params.backward else 1.0
    return RopeCache(np.cos(theta) * mscale, np.sin(theta) * mscale * sign, params)


def apply_rope_cache(x: np.ndarray, cache: RopeCache, *, out: np.ndarray | None = None) -> np.ndarray:
    """Rotate ``x`` (..., N, H, D) by a prebuilt ``cache``; returns ``x``'s dtype (or writes float64 ``out``)."""
    if not isinstance(cache, RopeCache):
        raise _args.cache_error(cache, "fastattn.reference.rope_cache")
    params = cache.params
    _args.parse_x(x)
    params.check_head_dim("x", x.shape[-1])
    if x.shape[-3] != cache.cos.shape[0]:
        raise ValueError(f"x must have one token per cached position: {cache.cos.shape[0]}, got {x.shape[-3]}")
    out = _args.parse_out(out, x, dtypes=(x.dtype, np.float64), reads=(("cache", cache.cos), ("cache", cache.sin)))
    result = _rotate(x.astype(np.float64), cache.cos, cache.sin, params)
    if out is None:
        return result.astype(x.dtype)
    out[...] = result if out.dtype == np.float64 else result.astype(x.dtype)
    return out


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, params: _args.RopeParams) -> np.ndarray:
    n_pairs = params.n_pairs
    if params.mode == RopeMode.NORMAL:
        first, second = np.arange(0, 2 * n_pairs, 2), np.arange(1, 2 * n_pairs, 2)
    else:
        first, second = np.arange(n_pairs), np.arange(n_pairs, 2 * n_pairs)
    c = cos[:, None, :]  # (N, 1, pairs): the same angles for every head
    s = sin[:, None, :]
    a, b = x[..., first], x[..., second]
    result = x.copy()  # dims past the rotated ones pass through
    result[..., first] = a * c - b * s
    result[..., second] = a * s + b * c
    return result


def rope_ext(x: np.ndarray, pos: np.ndarray, *, n_dims: int, mode: int, freq_base: float = 10000.0,
             freq_scale: float = 1.0, n_ctx_orig: int = 0, ext_factor: float = 0.0, attn_factor: float = 1.0,
             beta_fast: float = 32.0, beta_slow: float = 1.0, freq_factors: np.ndarray | None = None,
             sections=None, backward: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """Rotary position embedding of ``x`` (..., N, H, D) at positions ``pos`` ((N,), or (4, N) for
    MROPE/IMROPE/VISION). Returns ``x``'s dtype, or writes ``out`` (``x`` itself, or float64 for the unrounded
    values)."""
    params = _args.parse_params(n_dims=n_dims, mode=mode, freq_base=freq_base, freq_scale=freq_scale,
                                n_ctx_orig=n_ctx_orig, ext_factor=ext_factor, attn_factor=attn_factor,
                                beta_fast=beta_fast, beta_slow=beta_slow, freq_factors=freq_factors,
                                sections=sections, backward=backward)
    _args.parse_x(x)
    params.check_head_dim("x", x.shape[-1])
    pos = _args.parse_pos(pos, params, x.shape[-3])
    _args.parse_out(out, x, dtypes=(x.dtype, np.float64), reads=(("pos", pos), ("freq_factors", freq_factors)))
    theta, mscale = rope_angles(pos, params)
    sign = -1.0 if params.backward else 1.0
    cache = RopeCache(np.cos(theta) * mscale, np.sin(theta) * mscale * sign, params)
    return apply_rope_cache(x, cache, out=out)


def rope_set_rows(dst: np.ndarray, x: np.ndarray, pos: np.ndarray, idx: np.ndarray, *, n_dims: int, mode: int,
                  freq_base: float = 10000.0, freq_scale: float = 1.0, n_ctx_orig: int = 0,
                  ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, freq_factors: np.ndarray | None = None, sections=None,
                  backward: bool = False) -> np.ndarray:
    """``rope_ext(x)`` (x: (N, H, D)) written into rows ``idx`` of the cache ``dst`` ((R, H, D) or (R, H·D)),
    converted to ``dst``'s dtype (a ``Quantized`` dst: quantized from float32, D a multiple of 32); duplicate
    indices: the last row wins. Returns ``dst``."""
    rope = dict(n_dims=n_dims, mode=mode, freq_base=freq_base, freq_scale=freq_scale, n_ctx_orig=n_ctx_orig,
                ext_factor=ext_factor, attn_factor=attn_factor, beta_fast=beta_fast, beta_slow=beta_slow,
                freq_factors=freq_factors, sections=sections, backward=backward)
    params = _args.parse_params(**rope)
    dst3, idx = _args.parse_set_rows(dst, x, idx, params, dst_dtypes=STORAGE_FLOATS,
                                     reads=(("pos", pos), ("freq_factors", freq_factors)))
    _args.parse_pos(pos, params, x.shape[0])
    rotated = rope_ext(x, pos, out=np.empty(x.shape), **rope)
    _write(dst, dst3, rotated, idx)
    return dst


def _write(dst, dst3: np.ndarray, rotated: np.ndarray, idx: np.ndarray) -> None:
    """dst3[idx[i]] = rotated[i] in order (the last of duplicate indices wins), rounded once from float64 to
    dst's dtype; a ``Quantized`` dst (dst3 its bytes) gets each head row quantized from its float32 values, as
    ``set_rows`` would write ``rope_ext``'s float32 output."""
    if isinstance(dst, Quantized):
        rotated = quantize(rotated.astype(np.float32), dst.qtype).data
    for i, row in enumerate(idx):
        dst3[row] = rotated[i]


def apply_rope_cache_set_rows(dst: np.ndarray, x: np.ndarray, cache: RopeCache, idx: np.ndarray) -> np.ndarray:
    """``rope_set_rows`` with a prebuilt ``cache``: rows ``idx`` of ``dst`` receive ``apply_rope_cache(x, cache)``."""
    if not isinstance(cache, RopeCache):
        raise _args.cache_error(cache, "fastattn.reference.rope_cache")
    dst3, idx = _args.parse_set_rows(dst, x, idx, cache.params, dst_dtypes=STORAGE_FLOATS,
                                     reads=(("cache", cache.cos), ("cache", cache.sin)))
    if x.shape[0] != cache.cos.shape[0]:
        raise ValueError(f"x must have one token per cached position: {cache.cos.shape[0]}, got {x.shape[0]}")
    rotated = apply_rope_cache(x, cache, out=np.empty(x.shape))
    _write(dst, dst3, rotated, idx)
    return dst

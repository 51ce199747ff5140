"""RoPE: ``rope_ext`` (every ggml mode, YaRN, freq_factors, backward), a reusable cos/sin table, and the fused
``rope_set_rows`` that rotates K rows straight into a KV cache.

Algorithm, in two passes (one module each):

1. **The table** (``rope.cache``, from ``rope.pairs``' per-pair factors): cos and sin of every token's pairs,
   computed in float64 (a vectorised polynomial after an exact reduction, and a one-step recurrence along
   consecutive positions), scaled by mscale and stored as float32, row n = token n's cos then sin. Once per
   (position, stream), shared by every head, and by Q and K when the caller keeps it (``rope_cache``).
2. **The rotation** (``rope.rotate``, driven by ``rope.drivers``): every (batch, token, head) row's pairs
   (a, b) become (a·cos − b·sin, a·sin + b·cos) in float32, every product rounded on its own (no FMA
   contraction), so results are identical across layouts, thread counts and builds. Pairing: NORMAL (2p, 2p+1);
   NEOX/MROPE/IMROPE (p, p + n_dims/2); VISION (p, p + n_dims), covering the whole head. Out of place the dims
   past the rotated span are copied; in place they are left alone. A prefill on threads makes each block of
   tokens' cos/sin in the same pass, in the thread's scratch (``drive_fused``): the values ``rope_cache`` stores.

Layout: ``x`` (..., N, H, D) with any strides (Q = ``qkv[:, :H*D].reshape(N, H, D)`` of a fused projection
output, a no-copy view) is read through its strides; leading axes are merged without a copy when NumPy can,
otherwise looped over. float16 travels as uint16 bits (``_core.kernel.kernel_view``). Work runs serially below
``_core.threads.PARALLEL_MIN_BYTES`` and on ``prange`` threads above it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._core import threads as _threads
from . import args as _args
from .._core.kernel import argument_positions, call_any_layout, kernel_view
from ..quant.blocks import QTYPE_CODES, Quantized
from .cache import CACHE_BLOCK, build_cs
from .drivers import CACHED_UNIT, FUSED_UNIT, drive_fused, drive_parallel, drive_serial
from .quantized import FUSED_UNIT as FUSED_QUANTIZED_UNIT
from .quantized import UNIT as QUANTIZED_UNIT
from .quantized import rope_quantize_fused, rope_quantize_parallel, rope_quantize_serial
from .rotate import token_layout
from .._core import validate as _validate
from .._core.validate import STORAGE_FLOATS
from .modes import ROPE_NEOX, ROPE_NORMAL

__all__ = ["RopeCache", "rope_cache", "rope_cache_from_tables", "apply_rope_cache", "rope_ext", "rope_set_rows",
           "apply_rope_cache_set_rows"]

#: ``drive_fused``'s array arguments typed as any layout (x, out, idx, pos and the pair table's arrays): one
#: compiled ``_fused_tasks`` for contiguous and strided calls; the other drivers' calls mark theirs the same way.
_FUSED_ARRAYS = argument_positions(drive_fused, "x", "out", "idx", "pos", "table")
#: The cached drivers' arrays typed any layout: x, out and the cos/sin table, and idx when there is one.
_CACHED_ARRAYS = argument_positions(drive_serial, "x", "out", "cs")
_CACHED_INDEXED_ARRAYS = argument_positions(drive_serial, "x", "out", "idx", "cs")


@dataclass(frozen=True, eq=False)
class RopeCache:
    """cos and sin of N tokens' pairs, float32, scaled by mscale (sin negated for backward), stored side by side
    in ``cs`` (N, 2·n_pairs); ``cos`` and ``sin`` are (N, n_pairs) views.

    Build with ``rope_cache`` once per step; ``apply_rope_cache(q, cache)`` and ``apply_rope_cache(k, cache)``
    then skip all angle work."""

    cs: np.ndarray
    params: _args.RopeParams
    #: how the table applies to a head (``rope.args.Pairing``)
    pairing: _args.Pairing

    @property
    def n_tokens(self) -> int:
        return self.cs.shape[0]

    @property
    def cos(self) -> np.ndarray:
        return self.cs[:, :self.pairing.n_pairs]

    @property
    def sin(self) -> np.ndarray:
        return self.cs[:, self.pairing.n_pairs:]


def _params(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow,
            freq_factors, sections, backward) -> _args.RopeParams:
    return _args.parse_params(n_dims=n_dims, mode=mode, freq_base=freq_base, freq_scale=freq_scale,
                              n_ctx_orig=n_ctx_orig, ext_factor=ext_factor, attn_factor=attn_factor,
                              beta_fast=beta_fast, beta_slow=beta_slow, freq_factors=freq_factors,
                              sections=sections, backward=backward)


def rope_cache(pos: np.ndarray, *, n_dims: int, mode: int, freq_base: float = 10000.0, freq_scale: float = 1.0,
               n_ctx_orig: int = 0, ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
               beta_slow: float = 1.0, freq_factors: np.ndarray | None = None, sections=None,
               backward: bool = False) -> RopeCache:
    """The cos/sin tables of ``rope_ext`` for positions ``pos`` ((N,), or (4, N) for MROPE/IMROPE/VISION).

    Parameters as ``rope_ext``. Apply to any number of tensors with the same positions (Q and K) with
    ``apply_rope_cache``."""
    params = _params(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast,
                     beta_slow, freq_factors, sections, backward)
    return RopeCache(build_cs(_args.parse_pos(pos, params), params), params, params.pairing)


def rope_cache_from_tables(cos: np.ndarray, sin: np.ndarray, *, interleaved: bool) -> RopeCache:
    """A ``RopeCache`` from explicit per-token tables (FlashAttention's ``rotary_cos``/``rotary_sin`` rows): cos
    and sin (N, n_pairs) float32, float16 or bfloat16, rotating the first 2·n_pairs dims of each head,
    adjacent dims (2p, 2p+1) when ``interleaved`` (ggml's NORMAL), else p and p + n_pairs (NEOX)."""
    for name, table in (("cos", cos), ("sin", sin)):
        _validate.array(name, table, dtypes=STORAGE_FLOATS, ndim=2)
    if sin.shape != cos.shape or cos.shape[1] < 1:
        raise ValueError(f"cos and sin must have one shape (N, n_pairs) with n_pairs >= 1, got {cos.shape} and "
                         f"{sin.shape}")
    params = _params(2 * cos.shape[1], ROPE_NORMAL if interleaved else ROPE_NEOX, 10000.0, 1.0, 0, 0.0, 1.0,
                     32.0, 1.0, None, None, False)
    cs = np.empty((cos.shape[0], 2 * cos.shape[1]), np.float32)
    cs[:, :cos.shape[1]] = cos
    cs[:, cos.shape[1]:] = sin
    return RopeCache(cs, params, params.pairing)


# ---------------------------------------------------------------------------------------------------------------
# The general paths' drivers, for calls already parsed.
def _as_4d(a: np.ndarray) -> np.ndarray | None:
    """(..., N, H, D) as (B, N, H, D) without a copy, or None when the leading axes cannot merge."""
    if a.ndim == 3:
        return a[None]
    if a.ndim == 4:
        return a
    try:
        return a.reshape((-1,) + a.shape[-3:], copy=False)
    except ValueError:
        return None


def _rotate(x: np.ndarray, out: np.ndarray, cs: np.ndarray, pairing: _args.Pairing) -> None:
    """out = the rotation of x (..., N, H, D) by the table cs (out may be x) (leading axes that do not merge: one
    call per leading index, no copy)."""
    x4, out4 = (x[None], out[None]) if x.ndim == 3 else (_as_4d(x), _as_4d(out))
    if x4 is None or out4 is None:
        for index in np.ndindex(*x.shape[:-4]):
            _rotate(x[index], out[index], cs, pairing)
        return
    xk = kernel_view(x4)
    ok = xk if out is x else kernel_view(out4)
    nbytes = 2 * x.nbytes
    n_threads = _threads.threads_for(nbytes) if nbytes >= _threads.PARALLEL_MIN_BYTES and xk.shape[1] > 1 else 1
    flags = (pairing.interleaved, out is x, token_layout(xk, ok))
    with _threads.team("apply_rope_cache", nbytes, n_threads) as launch:
        if launch.n > 1:
            call_any_layout(drive_parallel, _CACHED_ARRAYS, xk, ok, None, None, cs, pairing.n_pairs, *flags,
                            np.zeros(1, np.int64), launch.n, unit=CACHED_UNIT)
        else:
            call_any_layout(drive_serial, _CACHED_ARRAYS, xk, ok, None, None, cs, pairing.n_pairs, *flags)


def _last_of_duplicates(idx: np.ndarray) -> np.ndarray:
    """keep[i]: token i's row is the last write to idx[i] (what the parallel drivers write; the last row wins)."""
    n_tokens = idx.shape[0]
    keep = np.zeros(n_tokens, np.bool_)
    if np.all(idx[1:] > idx[:-1]):  # the usual consecutive cache slots: no duplicates, no sort needed
        keep[:] = True
    else:
        _, last_from_end = np.unique(idx[::-1], return_index=True)
        keep[n_tokens - 1 - last_from_end] = True
    return keep


def _write_rows(dst3: np.ndarray, x: np.ndarray, idx: np.ndarray, params: _args.RopeParams,
                cs: np.ndarray | None = None, pos: np.ndarray | None = None) -> None:
    """Rotate x's rows (N, H, D) into dst3[idx] (R, H, D): with the table ``cs``, or (cs None) with cos/sin made
    from ``pos`` (streams, N): on threads inside the same pass, serially by making the table first."""
    n_tokens = x.shape[0]
    xk, dk = kernel_view(x), kernel_view(dst3)
    nbytes = x.nbytes + x.size * dst3.itemsize
    n_threads = _threads.threads_for(nbytes) if n_tokens > 1 and nbytes >= _threads.PARALLEL_MIN_BYTES else 1
    n_pairs, interleaved = params.pairing.n_pairs, params.pairing.interleaved
    layout = token_layout(xk, dk)
    x1 = xk[None]  # (1, N, H, D): the drivers step through axis 1
    with _threads.team("rope_set_rows", nbytes, n_threads) as launch:
        if launch.n == 1:  # in order, every token writes: the last duplicate wins
            if cs is None:
                cs = build_cs(pos, params)
            call_any_layout(drive_serial, _CACHED_INDEXED_ARRAYS, x1, dk, idx, np.ones(n_tokens, np.bool_), cs,
                            n_pairs, interleaved, False, layout)
            return
        keep = _last_of_duplicates(idx)
        next_task = np.zeros(1, np.int64)
        if cs is not None:
            call_any_layout(drive_parallel, _CACHED_INDEXED_ARRAYS, x1, dk, idx, keep, cs, n_pairs, interleaved,
                            False, layout, next_task, launch.n, unit=CACHED_UNIT)
        else:
            call_any_layout(drive_fused, _FUSED_ARRAYS, x1, dk, idx, keep, pos, params.table, interleaved, False,
                            layout, next_task, launch.n, unit=FUSED_UNIT)


#: Positions of rope_quantize_fused's arguments typed any layout: x, the cache's bytes, idx, the positions and the
#: pair table's arrays (as ``build_cs`` and the float drivers pass them: they share ``cache_block``'s compilation).
_FUSED_QUANTIZED_ARRAYS = argument_positions(rope_quantize_fused, "x", "data", "idx", "pos", "table")
#: The quantized drivers' arrays typed any layout: x, the cache's bytes and idx.
_QUANTIZED_ARRAYS = argument_positions(rope_quantize_serial, "x", "data", "idx")


def _write_quantized(dst: Quantized, data3: np.ndarray, x: np.ndarray, idx: np.ndarray, params: _args.RopeParams, *,
                     streams: np.ndarray | None = None, cs: np.ndarray | None = None) -> None:
    """Rotate x's rows (N, H, D) and quantize them into rows idx of a quantized cache (``rope.quantized``);
    ``data3`` its bytes as (R, H, bytes per head row). The cos/sin: a prebuilt table ``cs``, or made from the
    positions ``streams`` (streams, N), on threads inside the parallel pass."""
    n_tokens = x.shape[0]
    nbytes = x.nbytes + x.size
    n_threads = _threads.threads_for(nbytes) if n_tokens > 1 else 1
    code = QTYPE_CODES[dst.qtype]
    n_pairs, interleaved = params.pairing.n_pairs, params.pairing.interleaved
    if cs is None and n_threads == 1:  # on threads the tasks make their own rows (rope_quantize_fused)
        cs = build_cs(streams, params)
    xk = kernel_view(x)
    layout = token_layout(xk, np.empty((1, x.shape[1], x.shape[2]), np.float32))  # into a C scratch
    with _threads.team("rope_set_rows_quantized", nbytes, n_threads) as launch:
        if launch.n == 1:  # in order, every token writes: the last duplicate wins
            if cs is None:
                cs = build_cs(streams, params)
            call_any_layout(rope_quantize_serial, _QUANTIZED_ARRAYS, xk, data3, idx, np.ones(n_tokens, np.bool_),
                            cs, n_pairs, interleaved, layout, code)
        elif cs is None:  # the tasks make their own cos/sin rows
            call_any_layout(rope_quantize_fused, _FUSED_QUANTIZED_ARRAYS, xk, data3, idx, _last_of_duplicates(idx),
                            streams, params.table, interleaved, layout, code, np.zeros(1, np.int64), launch.n,
                            unit=FUSED_QUANTIZED_UNIT)
        else:
            call_any_layout(rope_quantize_parallel, _QUANTIZED_ARRAYS, xk, data3, idx, _last_of_duplicates(idx),
                            cs, n_pairs, interleaved, layout, code, np.zeros(1, np.int64), launch.n,
                            unit=QUANTIZED_UNIT)


# ---------------------------------------------------------------------------------------------------------------
# Public API.
def apply_rope_cache(x: np.ndarray, cache: RopeCache, *, out: np.ndarray | None = None) -> np.ndarray:
    """Rotate ``x`` (..., N, H, D), float32 or float16, any strides, by a prebuilt ``cache`` of N tokens.

    ``out``: None (a new array of ``x``'s dtype), ``x`` itself (in place; dims past the rotated ones untouched),
    or an array of ``x``'s shape and dtype, possibly strided. Returns the array written."""
    if cache.__class__ is not RopeCache:
        raise _args.cache_error(cache, "fastattn.rope_cache")
    _args.parse_x(x)
    cache.params.check_head_dim("x", x.shape[-1])
    if x.shape[-3] != cache.n_tokens:
        raise ValueError(f"x must have one token per cached position: {cache.n_tokens}, got {x.shape[-3]}")
    _args.parse_out(out, x, dtypes=(x.dtype,), reads=(("cache", cache.cs),))
    y = np.empty(x.shape, x.dtype) if out is None else out
    _rotate(x, y, cache.cs, cache.pairing)
    return y


def rope_ext(x: np.ndarray, pos: np.ndarray, *, n_dims: int, mode: int, freq_base: float = 10000.0,
             freq_scale: float = 1.0, n_ctx_orig: int = 0, ext_factor: float = 0.0, attn_factor: float = 1.0,
             beta_fast: float = 32.0, beta_slow: float = 1.0, freq_factors: np.ndarray | None = None,
             sections=None, backward: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """Rotary position embedding with ggml's semantics.

    x: (..., N, H, D) float32 or float16, any strides. pos: int32 (N,), or (4, N) (streams t, h, w, e) for
    ROPE_MROPE / ROPE_IMROPE / ROPE_VISION. n_dims: rotated dims (even, <= D; VISION: D/2). mode: a ROPE_*
    constant. freq_factors: (n_pairs,) divisors of theta (llama3 scaling). sections: 4 ints for the
    multi-position modes. backward: the inverse rotation. out: None, ``x`` (in place) or an array like ``x``.
    Returns the rotated array, ``x``'s dtype."""
    params = _params(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast,
                     beta_slow, freq_factors, sections, backward)
    _args.parse_x(x)
    params.check_head_dim("x", x.shape[-1])
    streams = _args.parse_pos(pos, params, x.shape[-3])
    out = _args.parse_out(out, x, dtypes=(x.dtype,), reads=(("pos", pos), ("freq_factors", freq_factors)))
    y = np.empty(x.shape, x.dtype) if out is None else out
    nbytes = 2 * x.nbytes
    if nbytes >= _threads.PARALLEL_MIN_BYTES and x.shape[-3] >= 2 * CACHE_BLOCK:
        n_threads = _threads.threads_for(nbytes)
        x4, y4 = _as_4d(x), _as_4d(y)
        if n_threads > 1 and x4 is not None and y4 is not None:  # one pass: cos/sin made per block of tokens
            xk = kernel_view(x4)
            yk = xk if y is x else kernel_view(y4)
            with _threads.team("rope_ext", nbytes, n_threads) as launch:
                call_any_layout(drive_fused, _FUSED_ARRAYS, xk, yk, None, None, streams, params.table,
                                params.interleaved, y is x, token_layout(xk, yk), np.zeros(1, np.int64), launch.n,
                                unit=FUSED_UNIT)
            return y
    _rotate(x, y, build_cs(streams, params), params.pairing)
    return y


def rope_set_rows(dst: np.ndarray, x: np.ndarray, pos: np.ndarray, idx: np.ndarray, *, n_dims: int, mode: int,
                  freq_base: float = 10000.0, freq_scale: float = 1.0, n_ctx_orig: int = 0,
                  ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, freq_factors: np.ndarray | None = None, sections=None,
                  backward: bool = False) -> np.ndarray:
    """Fused ``set_rows(dst, rope_ext(x, pos, ...), idx)``: rotate K rows and write them into a KV cache.

    dst: (R, H, D) or (R, H·D) float32 / float16 / bfloat16 cache (token-major), or a ``Quantized`` one of that
    logical shape (Q8_0 / Q4_0, D a multiple of 32: each head row quantized as ``set_rows`` does). x: (N, H, D)
    float32 or float16, any strides. idx: int32/int64 (N,) rows of ``dst``, each in [0, R) (else ValueError,
    nothing written); duplicates: the last wins. Returns ``dst``."""
    params = _params(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast,
                     beta_slow, freq_factors, sections, backward)
    dst3, idx = _args.parse_set_rows(dst, x, idx, params, dst_dtypes=STORAGE_FLOATS,
                                     reads=(("pos", pos), ("freq_factors", freq_factors)))
    streams = _args.parse_pos(pos, params, x.shape[0])
    if x.shape[0] == 0:
        return dst
    if dst.__class__ is Quantized:
        _write_quantized(dst, dst3, x, idx, params, streams=streams)
        return dst
    _write_rows(dst3, x, idx, params, pos=streams)
    return dst


def apply_rope_cache_set_rows(dst: np.ndarray, x: np.ndarray, cache: RopeCache, idx: np.ndarray) -> np.ndarray:
    """``rope_set_rows`` with a prebuilt ``cache`` (the one a decode step builds once for Q and K): rotate K rows
    ``x`` (N, H, D) and write them into rows ``idx`` of ``dst`` ((R, H, D) or (R, H·D), an ndarray or a
    ``Quantized``). Returns ``dst``."""
    if cache.__class__ is not RopeCache:
        raise _args.cache_error(cache, "fastattn.rope_cache")
    dst3, idx = _args.parse_set_rows(dst, x, idx, cache.params, dst_dtypes=STORAGE_FLOATS,
                                     reads=(("cache", cache.cs),))
    if x.shape[0] != cache.n_tokens:
        raise ValueError(f"x must have one token per cached position: {cache.n_tokens}, got {x.shape[0]}")
    if dst.__class__ is Quantized:
        if x.shape[0]:
            _write_quantized(dst, dst3, x, idx, cache.params, cs=cache.cs)
        return dst
    if x.shape[0]:
        _write_rows(dst3, x, idx, cache.params, cs=cache.cs)
    return dst

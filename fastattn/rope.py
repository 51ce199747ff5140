"""RoPE: ``rope_ext`` (every ggml mode, YaRN, freq_factors, backward), a reusable cos/sin cache, and the fused
``rope_set_rows`` that rotates K rows straight into a KV cache.

Algorithm, in two passes:

1. **The cache** (``rope_cache``): for every token n and rotated pair p, theta = pos[stream(p), n] · w[p] in
   float64, where the per-pair factor w[p] = freq_base^(-2k/n_dims) / freq_factors[p] · (YaRN mix of freq_scale
   and 1) and the stream/exponent map (MROPE/IMROPE/VISION sections) are computed once per parameter set
   (``_pair_table``, memoised). cos/sin are taken in float64 by a vectorised polynomial after a three-part
   Cody-Waite reduction (exact for |theta| < 1e9; larger angles fall back to libm) for the first token of each
   block of ``CACHE_BLOCK`` tokens; a following token whose positions are the previous ones + 1 (a prompt, or
   the text tokens of every stream) takes one float64 angle-addition step instead, (cos, sin)(theta + w) from
   (cos, sin)(theta) and the correctly rounded (cos w, sin w): ~1e-14 off the direct values within a block,
   6x cheaper. Then they are scaled by mscale (and sin by -1 for backward) and stored as float32 tables. This
   is once per (position, stream), shared by all heads, and by Q and K when the caller keeps the cache for a decode step. cos and sin of a
   token sit side by side in one row of ``cs`` (N, 2·n_pairs).
2. **The rotation**: for every (batch, token, head) row, each pair (a, b) becomes (a·cos − b·sin, a·sin + b·cos)
   in float32, every product rounded on its own (no FMA contraction), so results are identical across layouts,
   thread counts and builds. Out of place it reads x and writes out directly and copies the dims past the
   rotated span; in place it rotates the row where it is and leaves those dims alone. Pairing: NORMAL
   (2p, 2p+1); NEOX/MROPE/IMROPE (p, p + n_dims/2); VISION (p, p + n_dims), covering the whole head. When a
   row's elements are adjacent (any row stride: contiguous x, Q or K of a fused QKV buffer, a slice of the head
   dim), a token's rows are rotated by explicit 8-wide vector code (``_rope_rotate``), 8 pairs a step, the few
   pairs past the last whole chunk by scalar code; rows with strided elements take strided scalar loops. One
   driver per (token step, serial/parallel); the pairing, in-place and layout flags are run-time arguments.
   The parallel drivers check once per call whether every token is rotated whole by the vector code (one batch,
   out of place, ``_whole_rows``) and then hand tokens straight to it, skipping the per-token choices.

Layout: ``x`` (..., N, H, D) with any strides, e.g. Q = ``qkv[:, :H*D].reshape(N, H, D)`` of a fused projection
output (a no-copy view), is read through its strides: leading axes are merged without a copy when NumPy can,
otherwise looped over. float16 travels as uint16 bits (``_kernel.kernel_view``). The kernels run serially below
``_threads.PARALLEL_MIN_BYTES`` and above it on ``prange`` threads that take tasks of
``TOKENS_PER_TASK`` tokens from a shared counter.

``rope_set_rows`` is the same rotation with the output row of token i being ``dst[idx[i]]`` in the cache's dtype
(float32, float16 or bfloat16, round to nearest even); on several threads, only the last of duplicate indices
is written, so the last row wins as in ggml.

Decode-sized calls with a prebuilt cache (``apply_rope_cache`` on 3-D x, ``apply_rope_cache_set_rows`` into a 2-D
cache) take the fast path of ``_dispatch``: ``_rope_fast``'s / ``_rope_set_rows_fast``'s entry point, with the
checks in the kernel, and the general path when it declines; a larger ``apply_rope_cache`` on 3-D x takes
``_rope_prefill_cached``'s (the parallel driver). So does a prefill ``rope_ext`` on 3-D x with int32
positions and no sections (``_rope_ext_prefill``, the one-pass driver on threads), and a prefill
``rope_set_rows`` into a C-contiguous cache at increasing rows (``_rope_set_rows_prefill``), once the general
path has accepted their scalar arguments and freq_factors.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from decimal import Decimal, getcontext

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from . import _threads
from ._dispatch import FastPath, aligned, array_type, c_contiguous, meta, overlaps, same_view, unit_rows
from ._args import rope as _args
from ._kernel import (KERNEL_OPTIONS, assume_contiguous, fetch_add, from_f32, kernel_view, prefetch, to_f32,
                      use_threads)
from ._modes import RopeMode
from ._rope_rotate import rotate_rows_adjacent, rotate_rows_split
from ._simd import LANES
from ._validate import FLOAT32, STORAGE_FLOATS

_ND = np.ndarray
_INT32 = np.dtype(np.int32)

# ---------------------------------------------------------------------------------------------------------------
# float64 sin/cos that vectorise: Cody-Waite reduction by pi/2 split in three parts. The first two parts carry
# 22 significant bits, so k·PIO2_1 and k·PIO2_2 are exact for |k| < 2**31 and the reduction is accurate to about
# 1e-16 absolute for |theta| < LARGE_ANGLE; beyond it the cache falls back to libm (rare: |pos·w| > 1e9).
getcontext().prec = 60
_PIO2 = Decimal("1.57079632679489661923132169163975144209858469968755291048747229615390820314310449931401741267")


def _leading_bits(value: Decimal, bits: int) -> float:
    mantissa, exponent = math.frexp(float(value))
    scale = Decimal(2) ** (bits - exponent)
    return float((value * scale).to_integral_value(rounding="ROUND_FLOOR") / scale)


_PIO2_1 = _leading_bits(_PIO2, 22)
_PIO2_2 = _leading_bits(_PIO2 - Decimal(_PIO2_1), 22)
_PIO2_3 = float(_PIO2 - Decimal(_PIO2_1) - Decimal(_PIO2_2))
_TWO_OVER_PI = float(1 / _PIO2)
LARGE_ANGLE = 1e9

# The cache kernels must not reassociate: ((theta - k·P1) - k·P2) - k·P3 is only exact in that order.
_ORDERED = dict(KERNEL_OPTIONS, fastmath={"contract", "nsz", "arcp"})


@numba.njit(**_ORDERED)
def _sincos(theta):
    """(sin, cos) of float64 ``theta`` with |theta| < LARGE_ANGLE, error < 1e-11. Branch-free."""
    k = np.floor(theta * _TWO_OVER_PI + 0.5)
    r = ((theta - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3
    r2 = r * r
    # Taylor series on [-pi/4, pi/4]: the first omitted terms are < 7e-12 (sin) and 4e-13 (cos), far below the
    # float32 rounding of the stored values.
    sin_r = r + r * r2 * (-1.0 / 6 + r2 * (1.0 / 120 + r2 * (-1.0 / 5040 + r2 * (
        1.0 / 362880 + r2 * (-1.0 / 39916800)))))
    cos_r = 1.0 + r2 * (-0.5 + r2 * (1.0 / 24 + r2 * (-1.0 / 720 + r2 * (1.0 / 40320 + r2 * (
        -1.0 / 3628800 + r2 * (1.0 / 479001600))))))
    # quadrant k mod 4 kept in floating point: AVX2 has no packed float64 -> int64 conversion
    quadrant = k - 4.0 * np.floor(k * 0.25)
    swap = (quadrant == 1.0) | (quadrant == 3.0)
    s = cos_r if swap else sin_r
    c = sin_r if swap else cos_r
    s = -s if quadrant >= 2.0 else s
    c = -c if (quadrant == 1.0) | (quadrant == 2.0) else c
    return s, c


#: Tokens per block of the cache build: a block's first token is computed directly, each next one whose positions
#: follow on (+1 in every stream) by one angle-addition step from the token before, in float64. The error of the
#: recurrence grows by ~2e-16 a step, so a block stays ~1e-14 off the direct values, far below the float32 the
#: cache stores; blocks are also the unit of the parallel build.
CACHE_BLOCK = 64
#: The recurrence adds w to the exact angle where the direct path rounds pos·w to float64 (0.5 ulp of the angle):
#: the two agree to ~1e-9 while |pos| stays below this (with |w| <= ~1), so larger positions are computed directly.
RECURRENCE_MAX_POS = 1 << 24


@numba.njit(**_ORDERED)
def _direct_row(pos, n, streams, w, theta, c64, s64):
    """cos/sin of token n's angles, from the angles (float64)."""
    if pos.shape[0] == 1:
        position = np.float64(pos[0, n])
        for p in range(w.shape[0]):
            theta[p] = position * w[p]
    else:
        for p in range(w.shape[0]):  # each pair's stream: a gather, kept apart so the next loop vectorises
            theta[p] = pos[streams[p], n] * w[p]
    for p in range(w.shape[0]):
        s64[p], c64[p] = _sincos(theta[p])
    large = 0  # an integer count: vectorises without fast-math, unlike a float max
    for p in range(w.shape[0]):
        large += abs(theta[p]) >= LARGE_ANGLE
    if large:  # rare: angles the reduction cannot take exactly
        for p in range(w.shape[0]):
            if abs(theta[p]) >= LARGE_ANGLE:
                c64[p] = math.cos(theta[p])
                s64[p] = math.sin(theta[p])


@numba.njit(**_ORDERED)
def _follows(pos, n):
    """Every stream's position of token n is the one of token n - 1 plus 1 (and small enough to step)."""
    for s in range(pos.shape[0]):
        if pos[s, n] != pos[s, n - 1] + 1 or abs(pos[s, n]) >= RECURRENCE_MAX_POS:
            return False
    return True


@numba.njit(**_ORDERED)
def _cache_block(pos, streams, w, step_cos, step_sin, cos_scale, sin_scale, cs, n0, n1):
    """cs[n - n0] = cos then sin (float32) of token n, for n0 <= n < n1 (float64 cos/sin kept in c64/s64)."""
    n_pairs = w.shape[0]
    theta = np.empty(n_pairs)
    c64 = np.empty(n_pairs)
    s64 = np.empty(n_pairs)
    for n in range(n0, n1):
        if n > n0 and _follows(pos, n):  # angle + w: rotate the previous token's (cos, sin) by (cos w, sin w)
            for p in range(n_pairs):
                c = c64[p]
                s = s64[p]
                c64[p] = c * step_cos[p] - s * step_sin[p]
                s64[p] = s * step_cos[p] + c * step_sin[p]
        else:
            _direct_row(pos, n, streams, w, theta, c64, s64)
        # Two loops, not one storing both halves: LLVM's overlap checks for the two stores into one row send the
        # joint loop to its scalar version (512 tokens x 64 pairs: 18 us as one loop, 4.5 us as two).
        row = cs[n - n0]
        cos_row = row[:n_pairs]
        for p in range(n_pairs):
            cos_row[p] = np.float32(c64[p] * cos_scale)
        sin_row = row[n_pairs:]
        for p in range(n_pairs):
            sin_row[p] = np.float32(s64[p] * sin_scale)


@numba.njit(**_ORDERED)
def _build_cache_serial(pos, streams, w, step_cos, step_sin, cos_scale, sin_scale, cs):
    """cs: (N, 2·n_pairs) float32, cos then sin of each token."""
    n_tokens = cs.shape[0]
    for n0 in range(0, n_tokens, CACHE_BLOCK):
        n1 = min(n_tokens, n0 + CACHE_BLOCK)
        _cache_block(pos, streams, w, step_cos, step_sin, cos_scale, sin_scale, cs[n0:n1], n0, n1)


@numba.njit(parallel=True, **_ORDERED)
def _build_cache_parallel(pos, streams, w, step_cos, step_sin, cos_scale, sin_scale, cs):
    n_tokens = cs.shape[0]
    for b in prange((n_tokens + CACHE_BLOCK - 1) // CACHE_BLOCK):
        n0 = b * CACHE_BLOCK
        n1 = min(n_tokens, n0 + CACHE_BLOCK)
        _cache_block(pos, streams, w, step_cos, step_sin, cos_scale, sin_scale, cs[n0:n1], n0, n1)


# ---------------------------------------------------------------------------------------------------------------
# Rotation kernels. Helpers are inlined into the drivers (a call per head row costs as much as its work).
# No FMA contraction or reassociation here: a*c - b*s could contract either way, differently in the vectorised
# body, the scalar remainder and the serial and parallel builds; with every product rounded on its own the
# result is bit-identical across layouts and thread counts (and the op stays memory-bound).
_EXACT = dict(KERNEL_OPTIONS, fastmath={"nsz", "arcp"})
_INLINE = dict(_EXACT, inline="always")


def _store(v, like):
    """Element ``v`` (float32, or float16/bfloat16 bits) as ``like``'s element type: raw when the types match."""
    raise NotImplementedError


@overload(_store, inline="always")
def _store_impl(v, like):
    if v == like.dtype:
        return lambda v, like: v
    return lambda v, like: from_f32(to_f32(v), like)


@numba.njit(**_INLINE)
def _rotate_in_place(row, cos, sin, n_pairs, interleaved):
    """Rotate the pairs of ``row`` (D,) in place with one token's cos/sin (each pair is read before written)."""
    if interleaved:
        for p in range(n_pairs):
            a = to_f32(row[2 * p])
            b = to_f32(row[2 * p + 1])
            row[2 * p] = from_f32(a * cos[p] - b * sin[p], row)
            row[2 * p + 1] = from_f32(a * sin[p] + b * cos[p], row)
    else:
        first = row[:n_pairs]
        second = row[n_pairs:2 * n_pairs]
        for p in range(n_pairs):
            a = to_f32(first[p])
            b = to_f32(second[p])
            first[p] = from_f32(a * cos[p] - b * sin[p], row)
            second[p] = from_f32(a * sin[p] + b * cos[p], row)


@numba.njit(**_INLINE)
def _rotate_into(src, dst, cos, sin, n_pairs, interleaved):
    """dst = rope(src) for separate rows of any element types: widened, rotated in float32, narrowed once."""
    if interleaved:
        for p in range(n_pairs):
            a = to_f32(src[2 * p])
            b = to_f32(src[2 * p + 1])
            dst[2 * p] = from_f32(a * cos[p] - b * sin[p], dst)
            dst[2 * p + 1] = from_f32(a * sin[p] + b * cos[p], dst)
    else:
        src_first = src[:n_pairs]
        src_second = src[n_pairs:2 * n_pairs]
        dst_first = dst[:n_pairs]
        dst_second = dst[n_pairs:2 * n_pairs]
        for p in range(n_pairs):
            a = to_f32(src_first[p])
            b = to_f32(src_second[p])
            dst_first[p] = from_f32(a * cos[p] - b * sin[p], dst)
            dst_second[p] = from_f32(a * sin[p] + b * cos[p], dst)


@numba.njit(**_INLINE)
def _copy_tail(src, dst, start):
    """dst[start:] = src[start:] (converted if the types differ): the dims past the rotated span."""
    src_tail = src[start:]
    dst_tail = dst[start:]
    for j in range(src_tail.shape[0]):
        dst_tail[j] = _store(src_tail[j], dst)


@numba.njit(**_INLINE)
def _rotate_rest(src, dst, cos, sin, done, n_pairs, interleaved, in_place):
    """Pairs done .. n_pairs of one row (at most 7: those past the vector code's whole chunks), then, out of place,
    the dims past the rotated span."""
    if done < n_pairs:
        rest = n_pairs - done
        if interleaved:
            if in_place:
                _rotate_in_place(dst[2 * done:2 * n_pairs], cos[done:], sin[done:], rest, True)
            else:
                _rotate_into(src[2 * done:2 * n_pairs], dst[2 * done:2 * n_pairs], cos[done:], sin[done:], rest,
                             True)
        else:
            for p in range(rest):  # the two halves of a split row are n_pairs apart: a few scalar pairs
                a = to_f32(src[done + p])
                b = to_f32(src[n_pairs + done + p])
                dst[done + p] = from_f32(a * cos[done + p] - b * sin[done + p], dst)
                dst[n_pairs + done + p] = from_f32(a * sin[done + p] + b * cos[done + p], dst)
    if not in_place:
        _copy_tail(src, dst, 2 * n_pairs)


#: Layouts of one token's (H, D) head rows (``token_layout``), a run-time argument of the drivers.
ROWS_STRIDED = 0  # elements of a row not adjacent: strided loops
ROWS_UNIT = 1  # rows of adjacent elements, heads apart (e.g. a partial-head view)
TOKEN_BLOCK = 2  # the H rows adjacent too (contiguous x, Q or K of a fused QKV buffer)


def token_layout(a: np.ndarray, b: np.ndarray) -> int:
    """The layout the (H, D) rows of ``a`` and ``b`` (..., H, D) share, from their last two strides."""
    item_a, item_b = a.itemsize, b.itemsize
    if a.strides[-1] != item_a or b.strides[-1] != item_b:
        return ROWS_STRIDED
    if a.strides[-2] == a.shape[-1] * item_a and b.strides[-2] == b.shape[-1] * item_b:
        return TOKEN_BLOCK
    return ROWS_UNIT


@numba.njit(**_INLINE)
def _rope_block(src, dst, cache_row, n_pairs, interleaved, in_place, layout, ahead):
    """One token's head rows src, dst (H, D) (the same memory in place) with its cache row (cos then sin).

    Rows of adjacent elements (any row stride) take the vector code (``_rope_rotate``) for the whole chunks of 8
    pairs of every row at once, then the scalar rest; rows with strided elements take strided scalar loops.
    ``ahead`` != 0: the vector code prefetches each row's D elements that far past it (``_rows_ahead``)."""
    cos = cache_row[:n_pairs]
    sin = cache_row[n_pairs:2 * n_pairs]
    if layout == ROWS_STRIDED:
        for h in range(src.shape[0]):
            if in_place:
                _rotate_in_place(dst[h], cos, sin, n_pairs, interleaved)
            else:
                _rotate_into(src[h], dst[h], cos, sin, n_pairs, interleaved)
                _copy_tail(src[h], dst[h], 2 * n_pairs)
        return
    if interleaved:
        rotate_rows_adjacent(src, dst, cos, sin, ahead)
    else:
        rotate_rows_split(src, dst, cos, sin, ahead)
    done = n_pairs // LANES * LANES
    if done < n_pairs or (2 * n_pairs < src.shape[1] and not in_place):
        for h in range(src.shape[0]):
            _rotate_rest(src[h], dst[h], cos, sin, done, n_pairs, interleaved, in_place)


#: Cache lines of the next token's x asked for (``prefetcht0``) before a token is rotated in place: 1 KiB.
PREFETCH_LINES = 16


@numba.njit(**_INLINE)
def _prefetch_next_token(tokens, n, layout):
    """In place, start fetching the first lines of token n + 1's (H, D) block of ``tokens`` (N, H, D) while token
    n is rotated (measured on the Zen 3 host of runs 1-8: Q of (512, 32, 128) in place in a fused QKV buffer took
    1.14-1.36x a contiguous x without, 1.00-1.15x with; out of place it did not help). Tokens that lie apart
    take ``_rows_ahead`` instead."""
    if layout == TOKEN_BLOCK and n + 1 < tokens.shape[0]:
        first_row = tokens[n + 1, 0]
        for line in range(PREFETCH_LINES):
            prefetch(first_row, line * (64 // tokens.itemsize))


@numba.njit(**_INLINE)
def _rows_ahead(tokens, n, layout):
    """In place on tokens that lie apart (Q or K of a fused QKV buffer: 16 KiB runs 24 KiB apart), the distance
    in elements from a row of token n to the same row of token n + 2, for the vector code to prefetch that token
    row by row while it rotates this one; 0 otherwise. Why: the hardware prefetchers start over at every run.
    On the znver4 host of runs 9-10 (whose caches hold less than the 20 MiB the paired benchmark moves) the QKV
    view of (512, 32, 128) took 1.24-1.45x the contiguous time in place with ``_prefetch_next_token``; row by
    row one token ahead 1.13-1.16x, two tokens ahead 1.02-1.07x (2 threads; 0.91x at 1), from DRAM (N = 2048)
    1.31x where it was 1.49x (docs/rope.md)."""
    if layout != TOKEN_BLOCK or n + 2 >= tokens.shape[0]:
        return 0
    token_stride = tokens.strides[0] // tokens.itemsize
    if token_stride == tokens.shape[1] * tokens.shape[2]:
        return 0
    return 2 * token_stride


# The token steps: what a driver does with token n of x (B, N, H, D) and its cache row. Each driver is made for
# one step (a closure constant), so it compiles only that step's loop; the pairing, in-place and layout flags are
# run-time arguments: they choose per token between loops that are each compiled once (the rotation is vector
# code, ``_rope_block``), so one driver serves every combination and compiles once per dtype combination.
@numba.njit(**_INLINE)
def _rotate_step(x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout):
    """rope_ext / apply_rope_cache: out[b, n] = rope(x[b, n]) for every b (out may be x); idx, keep unused."""
    for b in range(x.shape[0]):
        ahead = 0
        if in_place:
            ahead = _rows_ahead(x[b], n, layout)
            if ahead == 0:
                _prefetch_next_token(x[b], n, layout)
        _rope_block(x[b, n], out[b, n], cache_row, n_pairs, interleaved, in_place, layout, ahead)


@numba.njit(**_INLINE)
def _cache_write_step(x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout):
    """rope_set_rows: x (1, N, H, D) K rows, out (R, H, D) the cache; token n goes to out[idx[n]] when keep[n]."""
    if keep[n]:
        _rope_block(x[0, n], out[idx[n]], cache_row, n_pairs, interleaved, False, layout, 0)


def _step(x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout):
    """Token n: ``_rotate_step`` when idx is None, else ``_cache_write_step`` (chosen from idx's type when a
    driver compiles, so each compiled driver holds only one step's loop)."""


@overload(_step, inline="always")
def _step_impl(x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout):
    if isinstance(idx, types.NoneType):
        return lambda x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout: _rotate_step(
            x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout)
    return lambda x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout: _cache_write_step(
        x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout)


# The drivers are module-level functions, not closures made per step: Numba's cache key of a closure pickles its
# cell contents, and a pickled dispatcher differs from process to process, so a closure over a step was compiled
# again in every process (10-16 s per driver) instead of being loaded from the cache.
#: Tokens per task of the parallel drivers: threads take tasks from a shared counter (``_kernel.fetch_add``), so
#: a thread slowed down by another process runs fewer of them. 8 tokens x 32 heads x 128 dims is ~32 KiB of x.
TOKENS_PER_TASK = 8


@numba.njit(**_EXACT)
def _drive_serial(x, out, idx, keep, cs, n_pairs, interleaved, in_place, layout):
    """``_step`` on every token of x (B, N, H, D) with its row of cs (N, 2·n_pairs) float32 (cos then sin)."""
    for n in range(x.shape[1]):
        _step(x, out, idx, keep, n, cs[n], n_pairs, interleaved, in_place, layout)


@numba.njit(**_INLINE)
def _whole_rows(x, out, idx, n_pairs, in_place, layout):
    """The common prefill call: one batch, out of place, rows of adjacent elements rotated whole in chunks of 8
    pairs (n_pairs % 8 == 0, 2·n_pairs == D), no index rows. The parallel drivers decide it once per call and then
    hand each such token straight to the vector code (``_rotate_whole_rows``) instead of ``_step``'s per-token
    choices, which cost 2-9% of a (512, 32, 128) float32 call at 2 threads (docs/rope.md, thirteenth session)."""
    return (idx is None and x.shape[0] == 1 and not in_place and layout != ROWS_STRIDED
            and n_pairs % LANES == 0 and 2 * n_pairs == x.shape[3])


@numba.njit(**_INLINE)
def _rotate_whole_rows(x, out, n, cache_row, n_pairs, interleaved):
    """Token n of x (1, N, H, D) into out when ``_whole_rows``: the vector code alone (``_rope_block``'s result)."""
    cos = cache_row[:n_pairs]
    sin = cache_row[n_pairs:2 * n_pairs]
    if interleaved:
        rotate_rows_adjacent(x[0, n], out[0, n], cos, sin, 0)
    else:
        rotate_rows_split(x[0, n], out[0, n], cos, sin, 0)


def _rotate_whole(x, out, idx, n, cache_row, n_pairs, interleaved):
    """``_rotate_whole_rows`` when idx is None; with index rows (rope_set_rows, never whole) nothing, so that
    drivers compiled for a cache as ``out`` do not type the rotation on its rows."""


@overload(_rotate_whole, inline="always")
def _rotate_whole_impl(x, out, idx, n, cache_row, n_pairs, interleaved):
    if isinstance(idx, types.NoneType):
        return lambda x, out, idx, n, cache_row, n_pairs, interleaved: _rotate_whole_rows(
            x, out, n, cache_row, n_pairs, interleaved)
    return lambda x, out, idx, n, cache_row, n_pairs, interleaved: None


@numba.njit(parallel=True, **_EXACT)
def _drive_parallel(x, out, idx, keep, cs, n_pairs, interleaved, in_place, layout, next_task, n_threads):
    """``_drive_serial`` on ``n_threads`` threads, which take tasks of TOKENS_PER_TASK tokens from
    ``next_task`` (a zeroed int64 counter)."""
    n_tasks = (x.shape[1] + TOKENS_PER_TASK - 1) // TOKENS_PER_TASK
    whole = _whole_rows(x, out, idx, n_pairs, in_place, layout)
    for _ in prange(n_threads):
        task = fetch_add(next_task)
        while task < n_tasks:
            for n in range(task * TOKENS_PER_TASK, min(x.shape[1], (task + 1) * TOKENS_PER_TASK)):
                if whole:
                    _rotate_whole(x, out, idx, n, cs[n], n_pairs, interleaved)
                else:
                    _step(x, out, idx, keep, n, cs[n], n_pairs, interleaved, in_place, layout)
            task = fetch_add(next_task)


@numba.njit(parallel=True, **_EXACT)
def _drive_fused(x, out, idx, keep, pos, streams, w, step_cos, step_sin, cos_scale, sin_scale, interleaved,
                 in_place, layout, next_task, n_threads):
    """``_drive_parallel`` with the cos/sin made inside the same pass. A task is one CACHE_BLOCK of tokens: its
    cos/sin go to the thread's scratch (exactly the values ``rope_cache`` would store: same blocks, same code),
    then its tokens are stepped through while the scratch is in L1."""
    n_tokens = x.shape[1]
    n_pairs = w.shape[0]
    n_tasks = (n_tokens + CACHE_BLOCK - 1) // CACHE_BLOCK
    whole = _whole_rows(x, out, idx, n_pairs, in_place, layout)
    for _ in prange(n_threads):
        cs = np.empty((CACHE_BLOCK, 2 * n_pairs), np.float32)
        task = fetch_add(next_task)
        while task < n_tasks:
            n0 = task * CACHE_BLOCK
            n1 = min(n_tokens, n0 + CACHE_BLOCK)
            _cache_block(pos, streams, w, step_cos, step_sin, cos_scale, sin_scale, cs, n0, n1)
            for n in range(n0, n1):
                if whole:
                    _rotate_whole(x, out, idx, n, cs[n - n0], n_pairs, interleaved)
                else:
                    _step(x, out, idx, keep, n, cs[n - n0], n_pairs, interleaved, in_place, layout)
            task = fetch_add(next_task)


@numba.njit(**_INLINE)
def _token_layout_of(mx, mo, head_dim):
    """``token_layout`` of two (N, H, D) arrays from their ``meta``."""
    (_, _, strides_x, item_x), (_, _, strides_o, item_o) = mx, mo
    if strides_x[2] != item_x or strides_o[2] != item_o:
        return ROWS_STRIDED
    if strides_x[1] == head_dim * item_x and strides_o[1] == head_dim * item_o:
        return TOKEN_BLOCK
    return ROWS_UNIT


@numba.njit(**_EXACT)
def _rope_ext_prefill(x, out, pos, streams, w, step_cos, step_sin, cos_scale, sin_scale, interleaved, n_dims,
                      min_bytes, n_threads):
    """``rope_ext`` of x (N, H, D) into out (x itself in place) at int32 positions pos (N,), NORMAL or NEOX,
    on ``n_threads`` threads, cos/sin made in the same pass (``_drive_fused``). Returns False, having written
    nothing, unless out has x's shape, pos one position per token, n_dims <= D, at least ``min_bytes`` move over
    two cache blocks of tokens or more, every array is aligned, and out is x or overlaps nothing of it."""
    n_tokens, _, head_dim = x.shape
    if (out.shape != x.shape or pos.shape[0] != n_tokens or head_dim < n_dims or n_tokens < 2 * CACHE_BLOCK
            or 2 * x.size * x.itemsize < min_bytes):
        return False
    mx, mo, mp = meta(x), meta(out), meta(pos)
    in_place = same_view(mo, mx)
    if (overlaps(mo, mx) and not in_place) or overlaps(mo, mp) or not (aligned(mx) and aligned(mo) and aligned(mp)):
        return False
    use_threads(n_threads)
    _drive_fused(x[np.newaxis], out[np.newaxis], None, None, pos[np.newaxis], streams, w, step_cos, step_sin,
                 cos_scale, sin_scale, interleaved, in_place, _token_layout_of(mx, mo, head_dim),
                  np.zeros(1, np.int64), n_threads)
    return True


#: entry points of ``_rope_ext_prefill``, keyed on x.dtype
_fast_prefill = FastPath(_rope_ext_prefill)
#: What a prefill-sized ``rope_ext`` call needs besides its arrays, keyed on its scalar arguments and their
#: classes (``_prefill_key``), recorded after the general path accepted them: (params, the kernel's arguments).
_prefill_plans: dict = {}
_PREFILL_PLANS_MAX = 64


def _prefill_key(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow,
                 backward, freq_factors) -> tuple:
    """The scalar arguments with their classes (2, 2.0 and True are one dict key, but not equally valid), and
    freq_factors (None or an ndarray) by dtype, shape and values: all that its validity and the tables depend on.
    """
    return (n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow,
            backward, n_dims.__class__, mode.__class__, freq_base.__class__, freq_scale.__class__,
            n_ctx_orig.__class__, ext_factor.__class__, attn_factor.__class__, beta_fast.__class__,
            beta_slow.__class__, backward.__class__,
            None if freq_factors is None else (freq_factors.dtype, freq_factors.shape, freq_factors.tobytes()))


def _prefill_plan(*args) -> tuple:
    """(``_prefill_key(*args)``, its recorded plan or None), or (None, None) when an argument is unhashable (the
    general path names it)."""
    try:
        key = _prefill_key(*args)
        return key, _prefill_plans.get(key)
    except TypeError:
        return None, None


def _add_prefill_plan(key: tuple, params: _args.RopeParams) -> None:
    """After the general path accepted a prefill-sized call without sections: its plan, shared by ``rope_ext``
    and ``rope_set_rows`` (the same arguments make the same tables)."""
    if key in _prefill_plans:
        return
    table = _pair_table(params)
    if len(_prefill_plans) >= _PREFILL_PLANS_MAX:
        _prefill_plans.clear()
    _prefill_plans[key] = (table.streams, table.w, table.step_cos, table.step_sin, table.cos_scale,
                           table.sin_scale, params.mode == RopeMode.NORMAL, params.n_dims)


#: the plan's part of the prefill entry points' arguments, then (n_dims, min_bytes, n_threads)
_PLAN_ARGS = ((array_type(np.dtype(np.int64), 1),) + (array_type(np.dtype(np.float64), 1),) * 3
              + (types.float64, types.float64, types.boolean) + (types.int64,) * 3)


def _add_fast_prefill(key: tuple, params: _args.RopeParams, x: np.ndarray, pos: np.ndarray) -> None:
    """After the general path accepted a prefill-sized call on 3-D x and 1-D int32 pos, without sections: its
    plan and ``_rope_ext_prefill``'s entry point for x's dtype, for next time."""
    _add_prefill_plan(key, params)
    if _fast_prefill.get(x.dtype) is None:
        x_type = array_type(x.dtype, 3)
        _fast_prefill.add(x.dtype, (x_type, x_type, array_type(pos.dtype, 1)) + _PLAN_ARGS)


@numba.njit(**_EXACT)
def _increasing_in(idx, n_rows):
    """idx strictly increasing (no duplicates) and within [0, n_rows)."""
    n = idx.shape[0]
    if n == 0 or idx[0] < 0 or idx[n - 1] >= n_rows:
        return False
    for i in range(n - 1):
        if idx[i] >= idx[i + 1]:
            return False
    return True


@numba.njit(**_EXACT)
def _rope_set_rows_prefill(dst, x, idx, pos, streams, w, step_cos, step_sin, cos_scale, sin_scale, interleaved,
                           n_dims, min_bytes, n_threads):
    """``rope_set_rows`` of x (N, H, D) into rows idx (N,) of the cache dst ((R, H·D) or (R, H, D)) at int32
    positions pos (N,), NORMAL or NEOX, on ``n_threads`` threads, cos/sin made in the same pass
    (``_drive_fused``). Returns False, having written nothing, unless dst is C-contiguous with rows of H·D,
    idx and pos have one entry per token, n_dims <= D, at least ``min_bytes`` move over two cache blocks of
    tokens or more, idx is strictly increasing within [0, R) (duplicates: the general path), every array is
    aligned and dst overlaps none of x, idx and pos."""
    n_tokens, n_heads, head_dim = x.shape
    n_rows = dst.shape[0]
    md, mx, mi, mp = meta(dst), meta(x), meta(idx), meta(pos)
    row_shape = md[1]
    last = row_shape[len(row_shape) - 1]  # D of an (R, H, D) cache, H·D of an (R, H·D) one
    row_size = head_dim if len(row_shape) == 3 else n_heads * head_dim
    if (dst.size != n_rows * n_heads * head_dim or last != row_size or idx.shape[0] != n_tokens
            or pos.shape[0] != n_tokens or head_dim < n_dims or n_tokens < 2 * CACHE_BLOCK
            or x.size * (x.itemsize + dst.itemsize) < min_bytes):
        return False
    if not (c_contiguous(md) and aligned(mx) and aligned(mi) and aligned(mp)):
        return False
    if overlaps(md, mx) or overlaps(md, mi) or overlaps(md, mp) or not _increasing_in(idx, n_rows):
        return False
    use_threads(n_threads)
    rows = assume_contiguous(dst).reshape((n_rows, n_heads, head_dim))
    _drive_fused(x[np.newaxis], rows, idx, np.ones(n_tokens, np.bool_), pos[np.newaxis], streams, w, step_cos,
                 step_sin, cos_scale, sin_scale, interleaved, False, _token_layout_of(mx, meta(rows), head_dim),
                 np.zeros(1, np.int64), n_threads)
    return True


#: entry points of ``_rope_set_rows_prefill``, keyed on (dst.dtype, dst.ndim, x.dtype, idx.dtype)
_fast_prefill_set_rows = FastPath(_rope_set_rows_prefill)


def _add_fast_prefill_set_rows(key: tuple, params: _args.RopeParams, dst: np.ndarray, x: np.ndarray,
                               idx: np.ndarray, pos: np.ndarray) -> None:
    """After the general path accepted a prefill-sized ``rope_set_rows`` on 3-D x and 1-D int32 pos, without
    sections: its plan and entry point, for next time."""
    _add_prefill_plan(key, params)
    entry_key = (dst.dtype, dst.ndim, x.dtype, idx.dtype)
    if _fast_prefill_set_rows.get(entry_key) is None:
        _fast_prefill_set_rows.add(entry_key, (array_type(dst.dtype, dst.ndim), array_type(x.dtype, 3),
                                               array_type(idx.dtype, 1), array_type(pos.dtype, 1)) + _PLAN_ARGS)


# The fast paths' calls, from the top of the public functions (where the decode-sized ones are written out) and
# again from their general paths: a first call,
# once validated, records its entry point and runs on it (the general driver, typed C where the entry point's
# arrays are 'A', would be one more cold compilation: about 20 s for _drive_fused, 8 s for _drive_serial). The
# caller has checked what the entry points rely on: exact ndarray classes, numbers of axes, out writeable.
def _try_fast_cached(x: np.ndarray, out: np.ndarray | None, cache: RopeCache) -> np.ndarray | None:
    """3-D ``apply_rope_cache`` through the entry point of its size class: the array written, or None where there
    is none or it declines (nothing written)."""
    if 2 * x.nbytes < _threads.PARALLEL_MIN_BYTES:
        entry, n_threads = _fast.get(x.dtype), ()
    else:  # the prefill one: ~70 us of Python after a large kernel
        entry, n_threads = _fast_prefill_cached.get(x.dtype), (_threads.get_num_threads(),)
    if entry is None:
        return None
    y = np.empty(x.shape, x.dtype) if out is None else out
    if entry(x, y, cache.cs, cache.n_pairs, cache.interleaved, cache.min_head_dim, cache.exact_head_dim,
             _threads.PARALLEL_MIN_BYTES, *n_threads):
        return y
    return None


def _try_fast_set_rows(dst: np.ndarray, x: np.ndarray, idx: np.ndarray, cache: RopeCache) -> bool:
    """Decode-sized ``apply_rope_cache_set_rows`` into a 2-D cache through its entry point: False where there is
    none or it declines (nothing written)."""
    entry = _fast_set_rows.get((dst.dtype, x.dtype, idx.dtype))
    return entry is not None and entry(dst, x, idx, cache.cs, cache.n_pairs, cache.interleaved,
                                       cache.min_head_dim, cache.exact_head_dim, _threads.PARALLEL_MIN_BYTES)


def _try_fast_prefill(x: np.ndarray, out: np.ndarray | None, pos: np.ndarray, plan: tuple | None
                      ) -> np.ndarray | None:
    """``rope_ext`` of 3-D x at 1-D int32 pos through its prefill entry point with a recorded ``plan``: the array
    written, or None where there is no entry point or plan, or it declines (nothing written)."""
    entry = _fast_prefill.get(x.dtype)
    if entry is None or plan is None:
        return None
    y = np.empty(x.shape, x.dtype) if out is None else out
    if entry(x, y, pos, *plan, _threads.PARALLEL_MIN_BYTES, _threads.get_num_threads()):
        return y
    return None


def _try_fast_prefill_set_rows(dst: np.ndarray, x: np.ndarray, idx: np.ndarray, pos: np.ndarray,
                               plan: tuple | None) -> bool:
    """``_try_fast_prefill`` for ``rope_set_rows``: False where there is no entry point or plan, or it declines."""
    entry = _fast_prefill_set_rows.get((dst.dtype, dst.ndim, x.dtype, idx.dtype))
    return (entry is not None and plan is not None
            and entry(dst, x, idx, pos, *plan, _threads.PARALLEL_MIN_BYTES, _threads.get_num_threads()))


# ---------------------------------------------------------------------------------------------------------------
# Per-pair tables: which stream each pair reads and its float64 angle factor. Position-independent: memoised.
def _c_max(a, b):
    return a if a > b else b  # C's MAX macro, as ggml uses it (NaN-propagation included)


def _c_min(a, b):
    return a if a < b else b


def _yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims in float32 (its floor/ceil decide integer boundaries, so follow ggml's rounding)."""
    f32 = np.float32
    log_base = f32(2) * np.log(f32(freq_base))
    with np.errstate(divide="ignore", invalid="ignore"):
        start = np.floor(f32(n_dims) * np.log(f32(n_ctx_orig) / (f32(beta_fast) * f32(2) * f32(np.pi))) / log_base)
        end = np.ceil(f32(n_dims) * np.log(f32(n_ctx_orig) / (f32(beta_slow) * f32(2) * f32(np.pi))) / log_base)
    return float(_c_max(f32(0), start)), float(_c_min(f32(n_dims - 1), end))


@dataclass(frozen=True)
class _PairTable:
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


@functools.lru_cache(maxsize=256)
def _pair_table_cached(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast,
                       beta_slow, freq_factors_bytes, sections, backward) -> _PairTable:
    n_pairs = n_dims if mode == RopeMode.VISION else n_dims // 2
    streams, exponents = _pair_streams(mode, sections, n_pairs)
    inv_freq = freq_base ** (-2.0 * exponents / n_dims)
    if freq_factors_bytes is not None:
        inv_freq = inv_freq / np.frombuffer(freq_factors_bytes, np.float64)
    scale = np.full(n_pairs, freq_scale)
    mscale = attn_factor
    if ext_factor != 0:
        low, high = _yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
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
    return _PairTable(streams, w, step_cos, step_sin, mscale, -mscale if backward else mscale)


def _pair_table(p: _args.RopeParams) -> _PairTable:
    ff = None if p.freq_factors is None else p.freq_factors.tobytes()
    return _pair_table_cached(p.n_dims, p.mode, p.freq_base, p.freq_scale, p.n_ctx_orig, p.ext_factor,
                              p.attn_factor, p.beta_fast, p.beta_slow, ff, p.sections, p.backward)


# ---------------------------------------------------------------------------------------------------------------
# Decode fast paths (``_dispatch``): compiled entry points called without Numba's dispatcher, the checks inside.
@numba.njit(**_EXACT)
def _fits_cache(n, d, cs, min_head_dim, exact_head_dim):
    """n tokens of head dim d fit the cache: one cs row per token, d >= min_head_dim (== when exact), and cs
    has aligned unit-stride rows."""
    return (n == cs.shape[0] and d >= min_head_dim and not (exact_head_dim and d != min_head_dim)
            and unit_rows(meta(cs)))


@numba.njit(**_EXACT)
def _rope_fast(x, out, cs, n_pairs, interleaved, min_head_dim, exact_head_dim, max_bytes):
    """``apply_rope_cache`` for x and out (N, H, D) of one dtype and a cache's ``cs``. Returns False, having
    written nothing, unless out has x's shape, x fits the cache, fewer than ``max_bytes`` move, x and out have
    aligned unit-stride rows and out is x or overlaps nothing of it."""
    n, h, d = x.shape
    if out.shape != x.shape or 2 * x.size * x.itemsize >= max_bytes:
        return False
    if not _fits_cache(n, d, cs, min_head_dim, exact_head_dim):
        return False
    mx, mo = meta(x), meta(out)
    in_place = same_view(mo, mx)
    if not (unit_rows(mx) and unit_rows(mo)) or (overlaps(mo, mx) and not in_place) or overlaps(mo, meta(cs)):
        return False
    _rope_tokens(x, out, cs, n_pairs, interleaved, in_place)
    return True


@numba.njit(**_INLINE)
def _rope_tokens(x, out, cs, n_pairs, interleaved, in_place):
    for i in range(x.shape[0]):
        _rope_block(x[i], out[i], assume_contiguous(cs[i]), n_pairs, interleaved, in_place, ROWS_UNIT, 0)


@numba.njit(**_EXACT)
def _rope_set_rows_fast(dst, x, idx, cs, n_pairs, interleaved, min_head_dim, exact_head_dim, max_bytes):
    """``apply_rope_cache_set_rows`` for dst (R, H·D), x (n, H, D), idx (n,). Returns False, having written
    nothing, unless the shapes match, x fits the cache, fewer than ``max_bytes`` move, dst and x have aligned
    unit-stride rows, idx is aligned, dst overlaps neither x nor idx and every index is in [0, R). Tokens are
    written in order: the last of duplicate indices wins."""
    n, h, d = x.shape
    n_rows = dst.shape[0]
    if idx.shape[0] != n or dst.shape[1] != h * d or x.size * (x.itemsize + dst.itemsize) >= max_bytes:
        return False
    if not _fits_cache(n, d, cs, min_head_dim, exact_head_dim):
        return False
    md, mx, mi = meta(dst), meta(x), meta(idx)
    if (not (unit_rows(md) and unit_rows(mx) and aligned(mi)) or overlaps(md, mx) or overlaps(md, mi)
            or overlaps(md, meta(cs))):
        return False
    for i in range(n):
        if idx[i] < 0 or idx[i] >= n_rows:
            return False
    _rope_rows_to_cache(dst, x, idx, cs, n_pairs, interleaved)
    return True


@numba.njit(**_INLINE)
def _rope_rows_to_cache(dst, x, idx, cs, n_pairs, interleaved):
    for i in range(x.shape[0]):
        block = assume_contiguous(dst[idx[i]]).reshape((x.shape[1], x.shape[2]))  # the cache row as (H, D)
        _rope_block(x[i], block, assume_contiguous(cs[i]), n_pairs, interleaved, False, ROWS_UNIT, 0)


_CACHE_ARGS = (types.int64, types.boolean, types.int64, types.boolean, types.int64)
#: entry points of ``_rope_fast``, keyed on x.dtype
_fast = FastPath(_rope_fast)
#: entry points of ``_rope_set_rows_fast``, keyed on (dst.dtype, x.dtype, idx.dtype)
_fast_set_rows = FastPath(_rope_set_rows_fast)


@numba.njit(**_EXACT)
def _rope_prefill_cached(x, out, cs, n_pairs, interleaved, min_head_dim, exact_head_dim, min_bytes, n_threads):
    """``apply_rope_cache`` of a prefill: x and out (N, H, D) of one dtype, a cache's ``cs``, on ``n_threads``
    threads (``_drive_parallel``). Returns False, having written nothing, unless out has x's shape, x fits the
    cache, at least ``min_bytes`` move over two tokens or more, x and out are aligned and out is x or overlaps
    nothing of it."""
    n, _, d = x.shape
    if out.shape != x.shape or n < 2 or 2 * x.size * x.itemsize < min_bytes:
        return False
    if not _fits_cache(n, d, cs, min_head_dim, exact_head_dim):
        return False
    mx, mo = meta(x), meta(out)
    in_place = same_view(mo, mx)
    if (overlaps(mo, mx) and not in_place) or overlaps(mo, meta(cs)) or not (aligned(mx) and aligned(mo)):
        return False
    use_threads(n_threads)
    _drive_parallel(x[np.newaxis], out[np.newaxis], None, None, cs, n_pairs, interleaved, in_place,
                    _token_layout_of(mx, mo, d), np.zeros(1, np.int64), n_threads)
    return True


#: entry points of ``_rope_prefill_cached``, keyed on x.dtype
_fast_prefill_cached = FastPath(_rope_prefill_cached)


def _add_fast(x: np.ndarray) -> None:
    """After a 3-D call was accepted: the entry point for x's dtype and size class (``_rope_fast`` for a
    decode-sized call, ``_rope_prefill_cached`` for a larger one), for next time."""
    large = 2 * x.nbytes >= _threads.PARALLEL_MIN_BYTES
    fast = _fast_prefill_cached if large else _fast
    if fast.get(x.dtype) is None:
        x_type = array_type(x.dtype, 3)
        fast.add(x.dtype, (x_type, x_type, array_type(FLOAT32, 2)) + _CACHE_ARGS
                 + ((types.int64,) if large else ()))


def _add_fast_set_rows(dst: np.ndarray, x: np.ndarray, idx: np.ndarray) -> None:
    """After a decode-sized call with a 2-D dst was accepted: its ``_rope_set_rows_fast`` entry point."""
    if dst.ndim == 2 and idx.ndim == 1 and x.size * (x.itemsize + dst.itemsize) < _threads.PARALLEL_MIN_BYTES:
        key = (dst.dtype, x.dtype, idx.dtype)
        if _fast_set_rows.get(key) is None:
            _fast_set_rows.add(key, (array_type(dst.dtype, 2), array_type(x.dtype, 3), array_type(idx.dtype, 1),
                                     array_type(FLOAT32, 2)) + _CACHE_ARGS)


# ---------------------------------------------------------------------------------------------------------------
# Public API.
@dataclass(frozen=True, eq=False)
class RopeCache:
    """cos and sin of N tokens' pairs, float32, scaled by mscale (sin negated for backward), stored side by side
    in ``cs`` (N, 2·n_pairs); ``cos`` and ``sin`` are (N, n_pairs) views.

    Build with ``rope_cache`` once per step; ``apply_rope_cache(q, cache)`` and ``apply_rope_cache(k, cache)``
    then skip all angle work."""

    cs: np.ndarray
    params: _args.RopeParams
    n_pairs: int
    interleaved: bool  # NORMAL: pairs (2p, 2p+1); otherwise (p, p + n_pairs)
    n_tokens: int
    min_head_dim: int  # D must be >= this (VISION: == this)
    exact_head_dim: bool

    @property
    def cos(self) -> np.ndarray:
        return self.cs[:, :self.n_pairs]

    @property
    def sin(self) -> np.ndarray:
        return self.cs[:, self.n_pairs:]


def _build_cache(pos: np.ndarray, params: _args.RopeParams) -> RopeCache:
    table = _pair_table(params)
    n_tokens = pos.shape[1]
    cs = np.empty((n_tokens, 2 * params.n_pairs), np.float32)
    args = (pos, table.streams, table.w, table.step_cos, table.step_sin, table.cos_scale, table.sin_scale, cs)
    # a few float64 flops per pair once the recurrence runs: parallel only for many blocks
    if n_tokens >= 8 * CACHE_BLOCK and _threads.threads_for(n_tokens * params.n_pairs * 16) > 1:
        _build_cache_parallel(*args)
    else:
        _build_cache_serial(*args)
    vision = params.mode == RopeMode.VISION
    return RopeCache(cs, params, params.n_pairs, params.mode == RopeMode.NORMAL, n_tokens,
                     2 * params.n_dims if vision else params.n_dims, vision)


def rope_cache(pos: np.ndarray, *, n_dims: int, mode: int, freq_base: float = 10000.0, freq_scale: float = 1.0,
               n_ctx_orig: int = 0, ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
               beta_slow: float = 1.0, freq_factors: np.ndarray | None = None, sections=None,
               backward: bool = False) -> RopeCache:
    """The cos/sin tables of ``rope_ext`` for positions ``pos`` ((N,), or (4, N) for MROPE/IMROPE/VISION).

    Parameters as ``rope_ext``. Apply to any number of tensors with the same positions (Q and K) with
    ``apply_rope_cache``."""
    params = _args.parse_params(n_dims=n_dims, mode=mode, freq_base=freq_base, freq_scale=freq_scale,
                                n_ctx_orig=n_ctx_orig, ext_factor=ext_factor, attn_factor=attn_factor,
                                beta_fast=beta_fast, beta_slow=beta_slow, freq_factors=freq_factors,
                                sections=sections, backward=backward)
    return _build_cache(_args.parse_pos(pos, params), params)


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


def _run(xk: np.ndarray, ok: np.ndarray, cache: RopeCache, in_place: bool, nbytes: int) -> None:
    """The kernel call on (B, N, H, D) kernel views. The size test comes first: asking for the thread count
    costs ~1 us, as much as a decode-sized rotation."""
    n_threads = _threads.threads_for(nbytes) if nbytes >= _threads.PARALLEL_MIN_BYTES and xk.shape[1] > 1 else 1
    flags = (cache.interleaved, in_place, token_layout(xk, ok))
    if n_threads > 1:
        _drive_parallel(xk, ok, None, None, cache.cs, cache.n_pairs, *flags, np.zeros(1, np.int64),
                                    n_threads)
    else:
        _drive_serial(xk, ok, None, None, cache.cs, cache.n_pairs, *flags)


def _apply(x: np.ndarray, out: np.ndarray, cache: RopeCache) -> None:
    x4 = _as_4d(x)
    out4 = _as_4d(out)
    if x4 is None or out4 is None:  # leading axes that do not merge: one call per leading index, no copy
        for index in np.ndindex(*x.shape[:-4]):
            _apply(x[index], out[index], cache)
        return
    xk = kernel_view(x4)
    _run(xk, xk if out is x else kernel_view(out4), cache, out is x, 2 * x.nbytes)


def apply_rope_cache(x: np.ndarray, cache: RopeCache, *, out: np.ndarray | None = None) -> np.ndarray:
    """Rotate ``x`` (..., N, H, D), float32 or float16, any strides, by a prebuilt ``cache`` of N tokens.

    ``out``: None (a new array of ``x``'s dtype), ``x`` itself (in place; dims past the rotated ones untouched),
    or an array of ``x``'s shape and dtype, possibly strided. Returns the array written."""
    if type(cache) is not RopeCache:
        raise _args.cache_error(cache, "fastattn.rope_cache")
    if x.__class__ is _ND and x.ndim == 3 and (out is None or (out.__class__ is _ND and out.ndim == 3
                                                           and out.dtype is x.dtype and out.flags.writeable)):
        # the decode and prefill fast paths (see _dispatch), written out: through _try_fast_cached a decode call
        # took 40-100 ns more (~1 us in all)
        if 2 * x.nbytes < _threads.PARALLEL_MIN_BYTES:
            entry = _fast.get(x.dtype)
            if entry is not None:
                y = np.empty(x.shape, x.dtype) if out is None else out
                if entry(x, y, cache.cs, cache.n_pairs, cache.interleaved, cache.min_head_dim,
                         cache.exact_head_dim, _threads.PARALLEL_MIN_BYTES):
                    return y
        else:
            y = _try_fast_cached(x, out, cache)
            if y is not None:
                return y
    _args.parse_x(x)
    shape = x.shape
    cache.params.check_head_dim("x", shape[-1])
    if shape[-3] != cache.n_tokens:
        raise ValueError(f"x must have one token per cached position: {cache.n_tokens}, got {shape[-3]}")
    _args.parse_out(out, x, dtypes=(x.dtype,), reads=(("cache", cache.cs),))
    if out is None:
        out = np.empty(shape, x.dtype)
    if x.ndim == 3:  # the fast path takes this call already, and every such call after it
        _add_fast(x)
        if x.__class__ is _ND and out.__class__ is _ND and _try_fast_cached(x, out, cache) is not None:
            return out
    _apply(x, out, cache)
    return out


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
    fast_key = None
    if (sections is None and (freq_factors is None or freq_factors.__class__ is _ND) and x.__class__ is _ND
            and pos.__class__ is _ND and x.ndim == 3 and pos.ndim == 1 and pos.dtype is _INT32
            and x.shape[0] >= 2 * CACHE_BLOCK and (out is None or (
                out.__class__ is _ND and out.ndim == 3 and out.dtype is x.dtype and out.flags.writeable))):
        # the prefill fast path (see _dispatch): the Python below costs 40-90 us right after a large kernel
        fast_key, plan = _prefill_plan(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor,
                                       beta_fast, beta_slow, backward, freq_factors)
        y = _try_fast_prefill(x, out, pos, plan)
        if y is not None:
            return y
    params = _args.parse_params(n_dims=n_dims, mode=mode, freq_base=freq_base, freq_scale=freq_scale,
                                n_ctx_orig=n_ctx_orig, ext_factor=ext_factor, attn_factor=attn_factor,
                                beta_fast=beta_fast, beta_slow=beta_slow, freq_factors=freq_factors,
                                sections=sections, backward=backward)
    _args.parse_x(x)
    params.check_head_dim("x", x.shape[-1])
    pos_1d = pos  # what the fast path takes, when fast_key is set
    pos = _args.parse_pos(pos, params, x.shape[-3])
    out = _args.parse_out(out, x, dtypes=(x.dtype,), reads=(("pos", pos), ("freq_factors", freq_factors)))
    nbytes = 2 * x.nbytes
    if nbytes >= _threads.PARALLEL_MIN_BYTES and x.shape[-3] >= 2 * CACHE_BLOCK:
        result = np.empty(x.shape, x.dtype) if out is None else out
        if fast_key is not None:  # a 3-D x: the fast path takes this call already, and every such call after it
            _add_fast_prefill(fast_key, params, x, pos_1d)
            if _try_fast_prefill(x, result, pos_1d, _prefill_plans.get(fast_key)) is not None:
                return result
        n_threads = _threads.threads_for(nbytes)
        x4 = _as_4d(x)
        out4 = _as_4d(result)
        if n_threads > 1 and x4 is not None and out4 is not None:  # one pass: cos/sin made per block of tokens
            xk = kernel_view(x4)
            ok = xk if out is x else kernel_view(out4)
            table = _pair_table(params)
            _drive_fused(xk, ok, None, None, pos, table.streams, table.w, table.step_cos, table.step_sin,
                         table.cos_scale, table.sin_scale, params.mode == RopeMode.NORMAL, out is x,
                         token_layout(xk, ok), np.zeros(1, np.int64), n_threads)
        else:
            apply_rope_cache(x, _build_cache(pos, params), out=result)
        return result
    return apply_rope_cache(x, _build_cache(pos, params), out=out)


def rope_set_rows(dst: np.ndarray, x: np.ndarray, pos: np.ndarray, idx: np.ndarray, *, n_dims: int, mode: int,
                  freq_base: float = 10000.0, freq_scale: float = 1.0, n_ctx_orig: int = 0,
                  ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, freq_factors: np.ndarray | None = None, sections=None,
                  backward: bool = False) -> np.ndarray:
    """Fused ``set_rows(dst, rope_ext(x, pos, ...), idx)``: rotate K rows and write them into a KV cache.

    dst: (R, H, D) or (R, H·D) float32 / float16 / bfloat16 cache (token-major). x: (N, H, D) float32 or
    float16, any strides. idx: int32/int64 (N,) rows of ``dst``, each in [0, R) (else ValueError, nothing
    written); duplicates: the last wins. Returns ``dst``."""
    fast_key = None
    if (sections is None and (freq_factors is None or freq_factors.__class__ is _ND) and dst.__class__ is _ND
            and x.__class__ is _ND and pos.__class__ is _ND and idx.__class__ is _ND and x.ndim == 3
            and pos.ndim == 1 and pos.dtype is _INT32 and idx.ndim == 1 and x.shape[0] >= 2 * CACHE_BLOCK
            and dst.flags.writeable):
        # the prefill fast path, as rope_ext's (see _dispatch)
        fast_key, plan = _prefill_plan(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor,
                                       beta_fast, beta_slow, backward, freq_factors)
        if _try_fast_prefill_set_rows(dst, x, idx, pos, plan):
            return dst
    params = _args.parse_params(n_dims=n_dims, mode=mode, freq_base=freq_base, freq_scale=freq_scale,
                                n_ctx_orig=n_ctx_orig, ext_factor=ext_factor, attn_factor=attn_factor,
                                beta_fast=beta_fast, beta_slow=beta_slow, freq_factors=freq_factors,
                                sections=sections, backward=backward)
    dst3, idx = _args.parse_set_rows(dst, x, idx, params, dst_dtypes=STORAGE_FLOATS,
                                     reads=(("pos", pos), ("freq_factors", freq_factors)))
    pos_1d = pos  # what the fast path takes, when fast_key is set
    pos = _args.parse_pos(pos, params, x.shape[0])
    if x.shape[0]:
        if fast_key is not None:  # 3-D x: the fast path takes this call already, and every such call after it
            _add_fast_prefill_set_rows(fast_key, params, dst, x, idx, pos_1d)
            if _try_fast_prefill_set_rows(dst, x, idx, pos_1d, _prefill_plans.get(fast_key)):
                return dst
        _set_rows(dst3, x, idx, None, pos, params)
    return dst



def apply_rope_cache_set_rows(dst: np.ndarray, x: np.ndarray, cache: RopeCache, idx: np.ndarray) -> np.ndarray:
    """``rope_set_rows`` with a prebuilt ``cache`` (the one a decode step builds once for Q and K): rotate K rows
    ``x`` (N, H, D) and write them into rows ``idx`` of ``dst`` ((R, H, D) or (R, H·D)). Returns ``dst``."""
    if type(cache) is not RopeCache:
        raise _args.cache_error(cache, "fastattn.rope_cache")
    fits_fast = (x.__class__ is _ND and dst.__class__ is _ND and idx.__class__ is _ND and x.ndim == 3
                 and dst.ndim == 2 and idx.ndim == 1 and dst.flags.writeable)
    if fits_fast:  # the decode fast path (see _dispatch), written out as in apply_rope_cache
        entry = _fast_set_rows.get((dst.dtype, x.dtype, idx.dtype))
        if entry is not None and entry(dst, x, idx, cache.cs, cache.n_pairs, cache.interleaved, cache.min_head_dim,
                                       cache.exact_head_dim, _threads.PARALLEL_MIN_BYTES):
            return dst
    dst3, idx = _args.parse_set_rows(dst, x, idx, cache.params, dst_dtypes=STORAGE_FLOATS,
                                     reads=(("cache", cache.cs),))
    if x.shape[0] != cache.n_tokens:
        raise ValueError(f"x must have one token per cached position: {cache.n_tokens}, got {x.shape[0]}")
    if x.shape[0]:
        _add_fast_set_rows(dst, x, idx)
        if fits_fast and _try_fast_set_rows(dst, x, idx, cache):  # this call already, as in apply_rope_cache
            return dst
        _set_rows(dst3, x, idx, cache)
    return dst


def _set_rows(dst3: np.ndarray, x: np.ndarray, idx: np.ndarray, cache: RopeCache | None,
              pos: np.ndarray | None = None, params: _args.RopeParams | None = None) -> None:
    """Rotate x's rows into dst3[idx] with a prebuilt ``cache``, or (cache None) with cos/sin made from ``pos`` and
    ``params``: on threads inside the same pass, serially by building the cache first."""
    n_tokens = x.shape[0]
    xk = kernel_view(x)
    dk = kernel_view(dst3)
    nbytes = x.nbytes + x.size * dst3.itemsize
    n_threads = _threads.threads_for(nbytes) if n_tokens > 1 and nbytes >= _threads.PARALLEL_MIN_BYTES else 1
    parallel = n_threads > 1
    if cache is None and not parallel:
        cache = _build_cache(pos, params)
    interleaved = params.mode == RopeMode.NORMAL if cache is None else cache.interleaved
    layout = token_layout(xk, dk)
    x1 = xk[None]  # (1, N, H, D): the drivers step through axis 1
    if not parallel:  # in order, every token writes: the last duplicate wins
        _drive_serial(x1, dk, idx, np.ones(n_tokens, np.bool_), cache.cs, cache.n_pairs, interleaved, False,
                      layout)
        return
    keep = np.zeros(n_tokens, np.bool_)
    if np.all(idx[1:] > idx[:-1]):  # the usual consecutive cache slots: no duplicates, no sort needed
        keep[:] = True
    else:
        _, last_from_end = np.unique(idx[::-1], return_index=True)
        keep[n_tokens - 1 - last_from_end] = True
    next_task = np.zeros(1, np.int64)
    if cache is not None:
        _drive_parallel(x1, dk, idx, keep, cache.cs, cache.n_pairs, interleaved, False, layout, next_task,
                        n_threads)
    else:
        table = _pair_table(params)
        _drive_fused(x1, dk, idx, keep, pos, table.streams, table.w, table.step_cos, table.step_sin,
                     table.cos_scale, table.sin_scale, interleaved, False, layout, next_task, n_threads)

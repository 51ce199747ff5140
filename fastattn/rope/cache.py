"""RoPE's cos/sin tables: cos and sin of every token's pairs, float32, side by side in one row per token.

For token n and rotated pair p the angle is theta = pos[stream(p), n] · w[p] in float64 (``rope.pairs`` makes
w and the streams). cos/sin are taken in float64 by a vectorised polynomial after a three-part Cody-Waite
reduction (exact for |theta| < LARGE_ANGLE; larger angles fall back to libm) for the first token of each block of
``CACHE_BLOCK`` tokens; a following token whose positions are the previous ones + 1 (a prompt, or the text
tokens of every stream) takes one float64 angle-addition step instead, (cos, sin)(theta + w) from
(cos, sin)(theta) and the correctly rounded (cos w, sin w): ~1e-14 off the direct values within a block, 6x
cheaper. Then they are scaled by mscale (and sin by -1 for backward) and stored as float32: row n of ``cs``
(N, 2·n_pairs) holds token n's cos then sin. Blocks are also the unit of the parallel build and of the fused
RoPE driver, which makes a block's rows in its own scratch (``rope.drivers.drive_fused``).
"""
from __future__ import annotations

import math
from decimal import Decimal, getcontext

import numpy as np
from numba import prange

from .._core import threads as _threads
from .._core.kernel import argument_positions, call_any_layout, kernel

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
TABLE_FASTMATH = frozenset({"contract", "nsz", "arcp"})


@kernel(fastmath=TABLE_FASTMATH)
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


@kernel(fastmath=TABLE_FASTMATH)
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


@kernel(fastmath=TABLE_FASTMATH)
def _follows(pos, n):
    """Every stream's position of token n is the one of token n - 1 plus 1 (and small enough to step)."""
    for s in range(pos.shape[0]):
        if pos[s, n] != pos[s, n - 1] + 1 or abs(pos[s, n]) >= RECURRENCE_MAX_POS:
            return False
    return True


@kernel(fastmath=TABLE_FASTMATH)
def cache_block(pos, table, cs, n0, n1):
    """cs[n - n0] = cos then sin (float32) of token n, for n0 <= n < n1 (float64 cos/sin kept in c64/s64), from
    the pair table ``table`` (``rope.pairs.PairTable``)."""
    # the arrays read once, not in the token loop, where each read would take and drop a reference
    streams, w, step_cos, step_sin = table.streams, table.w, table.step_cos, table.step_sin
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
            cos_row[p] = np.float32(c64[p] * table.cos_scale)
        sin_row = row[n_pairs:]
        for p in range(n_pairs):
            sin_row[p] = np.float32(s64[p] * table.sin_scale)


@kernel(fastmath=TABLE_FASTMATH)
def build_cache_serial(pos, table, cs):
    """cs: (N, 2·n_pairs) float32, cos then sin of each token."""
    n_tokens = cs.shape[0]
    for n0 in range(0, n_tokens, CACHE_BLOCK):
        n1 = min(n_tokens, n0 + CACHE_BLOCK)
        cache_block(pos, table, cs[n0:n1], n0, n1)


@kernel(parallel=True, fastmath=TABLE_FASTMATH)
def build_cache_parallel(pos, table, cs):
    n_tokens = cs.shape[0]
    for b in prange((n_tokens + CACHE_BLOCK - 1) // CACHE_BLOCK):
        n0 = b * CACHE_BLOCK
        n1 = min(n_tokens, n0 + CACHE_BLOCK)
        cache_block(pos, table, cs[n0:n1], n0, n1)


#: build_cache_*'s arguments typed any layout (pos and the table's arrays).
TABLE_INPUTS = argument_positions(build_cache_serial, "pos", "table")


def build_cs(pos: np.ndarray, params) -> np.ndarray:
    """``cs`` (N, 2·n_pairs) float32 for positions ``pos`` (streams, N) and parsed ``params``
    (``_args.rope.RopeParams``): on threads only for many blocks (a few float64 flops per pair once the recurrence
    runs)."""
    n_tokens = pos.shape[1]
    cs = np.empty((n_tokens, 2 * params.n_pairs), np.float32)
    args = (pos, params.table, cs)
    # the inputs typed any layout, as the fused RoPE drivers pass them: both share cache_block's compilation
    n_threads = _threads.threads_for(n_tokens * params.n_pairs * 16) if n_tokens >= 8 * CACHE_BLOCK else 1
    if n_threads > 1:
        _threads.launch_on(n_threads)
        call_any_layout(build_cache_parallel, TABLE_INPUTS, *args)
    else:
        call_any_layout(build_cache_serial, TABLE_INPUTS, *args)
    return cs

"""The inner loop shared by the one_chunk and split_kv attention paths: one query row, one GQA group, a KV range.

Both paths reduce to the same piece of work: for one query row and one KV head, run the online softmax of all
``G = Hq // Hkv`` query heads of that KV head's group over KV rows ``[j0, j1)``, keeping per head a running max
``M``, a running sum ``S`` and the unnormalised output ``A = sum_j exp(s_j - M) v_j``. Every K and V row is read
once and serves the whole group (GQA reuse: decode attention is memory-bound, so the group's heads must share
each row's read).

The KV range is walked in blocks of ``ROWS`` rows (a block of K and V stays in L1 while every head uses it):

1. mask terms ``slope_h * mask[.., h % Hm, i, j]`` go into the score scratch, ``-inf`` wherever the mask is
   ``-inf`` (a hidden key, whatever the slope); without a mask the logits are written straight in, and the row
   lists of steps 2 and 4 are all rows;
2. scores: the group's heads in register blocks of 4 (the rest one by one) against pairs of K rows: one pass over
   two rows feeds 8 dot products, float16/bfloat16 widened on the fly with ``to_f32``. Rows whose mask is ``-inf``
   for every head of the block are left out before any dot product is computed; a hidden score stays ``-inf``
   when the row is live for another head of the block, whatever the K row holds;
3. per head: the block max, one rescale of ``S`` and ``A`` when the max grows, ``p = fast_exp(s - M)``;
4. ``A += p v`` with the same head blocks, V rows by fours (each accumulator is loaded and stored once per
   four rows), then pairs; rows whose ``p`` is 0 for every head of the block are left out. With a per-head mask
   a row some heads weigh 0 may be live for others: if its V row holds an inf or NaN it is added per head to the
   heads that weigh it, and the block pass runs on a copy with it zeroed (``_sanitised_block``).

So a hidden K or V row is never read for the heads it is hidden from, and a NaN elsewhere propagates: the max
skips NaN scores, so a NaN is carried by ``S`` (a block whose scores are all ``-inf`` or NaN adds its NaN to
``S``). ``finalize`` folds in the sink logit and normalises; a row with nothing live (max ``-inf``, ``S`` 0, no
sink) gives exact zeros.

Memory layout: every array is read *flat* (``flat4``, inside the kernels): a 1-D C-contiguous view of the memory
the strided array spans, plus the element offset of its first element and its element strides. A K/V cache
slice, a transposed token-major cache or a padded view then compiles to the same code as a contiguous array
(one specialisation per dtype), and rows are read with unsigned offsets so the inner loops vectorise (Numba's
"any layout" arrays and signed indices do not). A row whose elements are not adjacent (column stride != 1) takes
a strided loop.
"""
from __future__ import annotations

import functools

import numpy as np

from llvmlite import ir
from numba import carray, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ._kernel import fast_exp, kernel, prefetch, to_f32
from ._simd import KERNEL_DTYPES, V8, as_int64, const, load8, loop, splat

#: KV rows per block: 32 rows of K and of V (8-16 KiB each at D 128) stay in L1 across the group's head blocks.
ROWS = 32
NEG_INF = np.float32(-np.inf)
#: Software prefetch distances: K rows this many bytes ahead of the rows being scored, V rows this many (at
#: least the next block). With cold K/V the arithmetic of a block left too few misses in flight for the hardware
#: prefetchers alone (decode Nkv 4096 float32, 1 thread: 5.0 -> 3.0-3.8 ms); the prefetches are spread over the
#: dot products (a few per row pair), not issued as a burst per block, which had made the loop 15-30% slower.
PREFETCH_K = 32768
PREFETCH_V = 16384
#: ``stream_rows`` by column slices: V columns per ``_values_columns`` call (two 8-wide vectors per head), one
#: slice after every COLUMN_EVERY scored K rows, and K rows prefetched this many rows ahead of the row scored.
VALUE_COLUMNS = 16
COLUMN_EVERY = 4
STREAM_K_AHEAD = 64


@intrinsic
def _pointer_at(typingctx, arr, offset):
    """Pointer to element ``offset`` (counted in elements from the first one, may be negative) of ``arr``'s data."""
    if not isinstance(arr, types.Array) or not isinstance(offset, types.Integer):
        raise TypingError("expected an array and an integer offset")

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.gep(data, [args[1]])

    return types.CPointer(arr.dtype)(arr, offset), codegen


@kernel
def flat4(a):
    """(1-D C-contiguous view of the memory the 4-D array ``a`` spans, element offset of ``a[0, 0, 0, 0]`` in it,
    element strides). ``a``'s strides must be whole numbers of elements (``element_strides`` checks)."""
    item = a.itemsize
    s0 = a.strides[0] // item
    s1 = a.strides[1] // item
    s2 = a.strides[2] // item
    s3 = a.strides[3] // item
    low = 0
    high = 0
    for n, s in ((a.shape[0], s0), (a.shape[1], s1), (a.shape[2], s2), (a.shape[3], s3)):
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    return carray(_pointer_at(a, low), high - low + 1), -low, (s0, s1, s2, s3)


@kernel
def flat_mask(mask):
    """``flat4`` of the mask and its (Bm, Hm); (None, 0, zeros, 1, 1) without a mask."""
    if mask is None:
        return None, 0, (0, 0, 0, 0), 1, 1
    mf, mo, mst = flat4(mask)
    return mf, mo, mst, mask.shape[0], mask.shape[1]


@functools.lru_cache(maxsize=16)
def no_sinks(n_heads: int) -> np.ndarray:
    """(n_heads,) float32 -inf: the sinks of a call without sinks, made once per head count (kernels only read
    it; writeable like a caller's sinks, so both share one compiled kernel)."""
    return np.full(n_heads, -np.inf, np.float32)


def element_strides(a: np.ndarray) -> np.ndarray:
    """``a`` itself when its strides are whole numbers of elements (every ordinary view), else a C copy."""
    item = a.itemsize
    for stride in a.strides:  # a loop, not any(generator): this runs for every input of every call
        if stride % item:
            return np.ascontiguousarray(a)
    return a


@kernel(inline=True)
def _dot4x2(qs, g, kf, o1, o2, kcs):
    """Dot products of query rows g .. g+3 with the K rows at flat offsets o1 and o2: 8 sums, one pass."""
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    s3 = np.float32(0.0)
    t0 = np.float32(0.0)
    t1 = np.float32(0.0)
    t2 = np.float32(0.0)
    t3 = np.float32(0.0)
    u1 = np.uint64(o1)
    u2 = np.uint64(o2)
    step = np.uint64(kcs)
    for d in range(qs.shape[1]):
        x = u1 + np.uint64(d) if kcs == 1 else u1 + np.uint64(d) * step
        y = u2 + np.uint64(d) if kcs == 1 else u2 + np.uint64(d) * step
        k1 = to_f32(kf[x])
        k2 = to_f32(kf[y])
        q0 = qs[g, d]
        q1 = qs[g + 1, d]
        q2 = qs[g + 2, d]
        q3 = qs[g + 3, d]
        s0 += q0 * k1
        s1 += q1 * k1
        s2 += q2 * k1
        s3 += q3 * k1
        t0 += q0 * k2
        t1 += q1 * k2
        t2 += q2 * k2
        t3 += q3 * k2
    return s0, s1, s2, s3, t0, t1, t2, t3


@kernel(inline=True)
def _dot4(qs, g, kf, o1, kcs):
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    s3 = np.float32(0.0)
    u1 = np.uint64(o1)
    step = np.uint64(kcs)
    for d in range(qs.shape[1]):
        k1 = to_f32(kf[u1 + np.uint64(d) if kcs == 1 else u1 + np.uint64(d) * step])
        s0 += qs[g, d] * k1
        s1 += qs[g + 1, d] * k1
        s2 += qs[g + 2, d] * k1
        s3 += qs[g + 3, d] * k1
    return s0, s1, s2, s3


@kernel(inline=True)
def _dot1(qs, g, kf, o1, kcs):
    s0 = np.float32(0.0)
    u1 = np.uint64(o1)
    step = np.uint64(kcs)
    for d in range(qs.shape[1]):
        s0 += qs[g, d] * to_f32(kf[u1 + np.uint64(d) if kcs == 1 else u1 + np.uint64(d) * step])
    return s0


@kernel(inline=True)
def _axpy4x4(A, a0, DV, p, g, r1, r2, r3, r4, vf, o1, o2, o3, o4, vcs):
    """A[g .. g+3] += p[.., r] V row for four rows: each accumulator is loaded and stored once per four rows
    (256-bit stores are what bounds this loop on Zen 3)."""
    p01 = p[g, r1]
    p11 = p[g + 1, r1]
    p21 = p[g + 2, r1]
    p31 = p[g + 3, r1]
    p02 = p[g, r2]
    p12 = p[g + 1, r2]
    p22 = p[g + 2, r2]
    p32 = p[g + 3, r2]
    p03 = p[g, r3]
    p13 = p[g + 1, r3]
    p23 = p[g + 2, r3]
    p33 = p[g + 3, r3]
    p04 = p[g, r4]
    p14 = p[g + 1, r4]
    p24 = p[g + 2, r4]
    p34 = p[g + 3, r4]
    u1 = np.uint64(o1)
    u2 = np.uint64(o2)
    u3 = np.uint64(o3)
    u4 = np.uint64(o4)
    step = np.uint64(vcs)
    dv = np.uint64(DV)
    b0 = np.uint64(a0)
    for d in range(DV):
        x = np.uint64(d) if vcs == 1 else np.uint64(d) * step
        v1 = to_f32(vf[u1 + x])
        v2 = to_f32(vf[u2 + x])
        v3 = to_f32(vf[u3 + x])
        v4 = to_f32(vf[u4 + x])
        e = b0 + np.uint64(d)
        A[e] += (p01 * v1 + p02 * v2) + (p03 * v3 + p04 * v4)
        A[e + dv] += (p11 * v1 + p12 * v2) + (p13 * v3 + p14 * v4)
        A[e + dv + dv] += (p21 * v1 + p22 * v2) + (p23 * v3 + p24 * v4)
        A[e + dv + dv + dv] += (p31 * v1 + p32 * v2) + (p33 * v3 + p34 * v4)


@kernel(inline=True)
def _axpy4x2(A, a0, DV, p, g, r1, r2, vf, o1, o2, vcs):
    """A[g .. g+3] += p[.., r1] V row o1 + p[.., r2] V row o2 (A flat, head g's DV values at a0)."""
    p01 = p[g, r1]
    p11 = p[g + 1, r1]
    p21 = p[g + 2, r1]
    p31 = p[g + 3, r1]
    p02 = p[g, r2]
    p12 = p[g + 1, r2]
    p22 = p[g + 2, r2]
    p32 = p[g + 3, r2]
    u1 = np.uint64(o1)
    u2 = np.uint64(o2)
    step = np.uint64(vcs)
    dv = np.uint64(DV)
    b0 = np.uint64(a0)
    for d in range(DV):
        x = u1 + np.uint64(d) if vcs == 1 else u1 + np.uint64(d) * step
        y = u2 + np.uint64(d) if vcs == 1 else u2 + np.uint64(d) * step
        v1 = to_f32(vf[x])
        v2 = to_f32(vf[y])
        e = b0 + np.uint64(d)
        A[e] += p01 * v1 + p02 * v2
        A[e + dv] += p11 * v1 + p12 * v2
        A[e + dv + dv] += p21 * v1 + p22 * v2
        A[e + dv + dv + dv] += p31 * v1 + p32 * v2


@kernel(inline=True)
def _axpy4(A, a0, DV, p, g, r1, vf, o1, vcs):
    p0 = p[g, r1]
    p1 = p[g + 1, r1]
    p2 = p[g + 2, r1]
    p3 = p[g + 3, r1]
    u1 = np.uint64(o1)
    step = np.uint64(vcs)
    dv = np.uint64(DV)
    b0 = np.uint64(a0)
    for d in range(DV):
        v1 = to_f32(vf[u1 + np.uint64(d) if vcs == 1 else u1 + np.uint64(d) * step])
        e = b0 + np.uint64(d)
        A[e] += p0 * v1
        A[e + dv] += p1 * v1
        A[e + dv + dv] += p2 * v1
        A[e + dv + dv + dv] += p3 * v1


@kernel(inline=True)
def _axpy1(A, a0, DV, p0, vf, o1, vcs):
    u1 = np.uint64(o1)
    step = np.uint64(vcs)
    b0 = np.uint64(a0)
    for d in range(DV):
        A[b0 + np.uint64(d)] += p0 * to_f32(vf[u1 + np.uint64(d) if vcs == 1 else u1 + np.uint64(d) * step])


@kernel(inline=True)
def _prefetch_row(f, start, lines, step):
    """Prefetch ``lines`` cache lines from flat offset ``start`` of ``f``, ``step`` elements apart."""
    for i in range(lines):
        prefetch(f, start + i * step)


@kernel(inline=True)
def _logit(dot, scale, softcap):
    x = np.float32(dot * scale)
    if softcap != 0.0:
        x = np.float32(softcap * np.tanh(x / softcap))
    return x


@kernel(inline=True)
def _score(sc, g, r, dot, scale, softcap, unmasked):
    """sc[g, r] = its logit (unmasked) or mask term + logit; a hidden score (mask term -inf) stays -inf, whatever
    the K row holds (a row hidden for one head of a register block may be live for another)."""
    if unmasked:
        sc[g, r] = _logit(dot, scale, softcap)
    else:
        x = sc[g, r]
        sc[g, r] = x if x == NEG_INF else x + _logit(dot, scale, softcap)


@kernel(inline=True)
def _live_rows(sc, g, width, n, every, dead, rows):
    """rows[:k] = the rows r < n where sc[g .. g+width, r] is not ``dead`` for some head; returns k. ``every``:
    all n rows (no mask: nothing to skip, and a row of zero weights adds nothing)."""
    if every:
        for r in range(n):
            rows[r] = r
        return n
    n_live = 0
    for r in range(n):
        for t in range(width):
            if sc[g + t, r] != dead:
                rows[n_live] = r
                n_live += 1
                break
    return n_live


@kernel(inline=True)
def _row_finite(vf, o, n, vcs):
    """Whether the n elements from flat offset o (column stride vcs) of vf are all finite."""
    bad = False
    u = np.uint64(o)
    step = np.uint64(vcs)
    for d in range(n):
        x = to_f32(vf[u + np.uint64(d) if vcs == 1 else u + np.uint64(d) * step])
        bad |= not abs(x) < np.float32(np.inf)  # a comparison: fast-math folds sums like acc + (x - x) to acc
    return not bad


@kernel(inline=True)
def _mixed_nonfinite(p, g, width, r, vf, o, DV, vcs):
    """Row r has weight 0 for some head g .. g+width (hidden for it under a per-head mask, or underflowed) and its
    V row at flat offset o is not finite: adding it with the others would give that head 0 * NaN."""
    for t in range(width):
        if p[g + t, r] == 0.0:
            return not _row_finite(vf, o, DV, vcs)
    return False


@kernel(inline=True)
def _add_per_head(A, DV, p, g, width, r, vf, o, vcs):
    """A[h] += p[h, r] V row (flat offset o) for the heads h = g .. g+width whose weight is not 0."""
    for t in range(width):
        if p[g + t, r] != 0.0:
            _axpy1(A, (g + t) * DV, DV, p[g + t, r], vf, o, vcs)


@kernel
def _any_mixed_nonfinite(p, g, rows, n_live, vf, vb, vrs, vcs, DV):
    """Whether a row of rows[:n_live] is ``_mixed_nonfinite`` for the head block g .. g+3."""
    for x in range(n_live):
        r = rows[x]
        if _mixed_nonfinite(p, g, 4, r, vf, vb + r * vrs, DV, vcs):
            return True
    return False


@kernel
def _sanitised_block(A, DV, p, g, rows, n_live, n, vf, vb, vrs, vcs):
    """The block's n V rows copied (row r at r * DV), each ``_mixed_nonfinite`` row zeroed after it was added per
    head to the heads of g .. g+3 that weigh it. The head block's usual V pass then runs on the copy: the same
    arithmetic, bit for bit, as with those rows finite for the heads that do not weigh them."""
    copy = np.empty(n * DV, vf.dtype)
    for r in range(n):
        for d in range(DV):
            copy[r * DV + d] = vf[vb + r * vrs + d * vcs]
    for x in range(n_live):
        r = rows[x]
        if _mixed_nonfinite(p, g, 4, r, vf, vb + r * vrs, DV, vcs):
            _add_per_head(A, DV, p, g, 4, r, vf, vb + r * vrs, vcs)
            for d in range(DV):
                copy[r * DV + d] = 0  # +0.0 in every kernel dtype
    return copy


@kernel
def _drop_mixed_nonfinite(A, DV, p, rows, n_live, vf, vb, vrs, vcs):
    """``stream_rows``: add each ``_mixed_nonfinite`` row of rows[:n_live] (over all heads of p) per head and drop
    it from the list; returns the new count. The others are added one FMA per row, so dropping a row some head
    weighs 0 leaves that head's sums bit for bit as they were."""
    G = p.shape[0]
    kept = 0
    for x in range(n_live):
        r = rows[x]
        if _mixed_nonfinite(p, 0, G, r, vf, vb + r * vrs, DV, vcs):
            _add_per_head(A, DV, p, 0, G, r, vf, vb + r * vrs, vcs)
        else:
            rows[kept] = r
            kept += 1
    return kept


@kernel(inline=True)
def _mask_terms(sc, n, mf, mbase, mhs, mcs, Hm, slopes, h0, jb):
    """sc[g, :n] = slope * mask of head h0 + g over the block's columns jb .. jb+n (nothing without a mask)."""
    if mf is not None:
        for g in range(sc.shape[0]):
            h = h0 + g
            start = mbase + (h % Hm) * mhs + jb * mcs
            slope = slopes[h]
            for r in range(n):
                x = to_f32(mf[start + r * mcs])
                sc[g, r] = NEG_INF if x == NEG_INF else slope * x  # hidden, even for a slope of 0


@kernel(inline=True)
def _block_weights(sc, n, M, S, A):
    """Per head g of sc (G, >= n): rescale S[g] and A's head g to the block's new max, sc[g, :n] = weights."""
    G = sc.shape[0]
    DV = A.shape[0] // G
    for g in range(G):
        block_max = NEG_INF
        for r in range(n):
            block_max = max(block_max, sc[g, r])
        if block_max == NEG_INF:
            # nothing live, or only NaN scores (max skips NaN): a NaN stays as its weight, so S turns NaN
            total = np.float32(0.0)
            for r in range(n):
                x = sc[g, r]
                p = np.float32(0.0) if x == NEG_INF else x
                sc[g, r] = p
                total += p
            S[g] += total
            continue
        if block_max > M[g]:
            factor = fast_exp(M[g] - block_max)  # 0 while M is still -inf
            S[g] *= factor
            a0 = g * DV
            for d in range(DV):
                A[a0 + d] *= factor
            M[g] = block_max
        m = M[g]
        total = np.float32(0.0)
        for r in range(n):
            p = fast_exp(sc[g, r] - m)
            sc[g, r] = p
            total += p
        S[g] += total


@kernel
def load_group_queries(qf, qbase, qhs, qcs, qs):
    """qs[g] = the query row at flat offset qbase + g * qhs (column stride qcs), for the G heads of a group."""
    for g in range(qs.shape[0]):
        row = qbase + g * qhs
        for d in range(qs.shape[1]):
            qs[g, d] = qf[row + d * qcs]


@kernel
def group_rows(qs, kf, kbase, krs, kcs, vf, vbase, vrs, vcs, mf, mbase, mhs, mcs, Hm, slopes, h0, scale, softcap,
               j0, j1, M, S, A, sc, rows, streaming):
    """Online softmax of a GQA group's heads over KV rows [j0, j1), updating M, S (G,) and A (G * DV,) in place.

    ``qs`` (G, DK): the group's query rows (query heads h0 .. h0+G). K row j starts at flat offset
    ``kbase + j * krs`` of ``kf`` (column stride ``kcs``), V likewise. Mask (``mf`` None for no mask): head h,
    column j at ``mbase + (h % Hm) * mhs + j * mcs``. Scratch: ``sc`` (G, ROWS) float32, ``rows`` (ROWS,) int64.
    ``streaming``: the rows are read this once (decode), not again for other query rows: float32 K/V then take
    ``stream_rows``.
    """
    if streaming and kf.itemsize == 4 and vf.itemsize == 4:
        stream_rows(qs, kf, kbase, krs, kcs, vf, vbase, vrs, vcs, mf, mbase, mhs, mcs, Hm, slopes, h0, scale,
                    softcap, j0, j1, M, S, A, sc, rows)
        return
    G = qs.shape[0]
    DV = A.shape[0] // G
    # a per-head mask can hide a row from some heads of a register block and not others ("mixed" rows)
    per_head = mf is not None and Hm > 1
    # software prefetch of rows adjacent in memory (column stride 1) PREFETCH_K / _V bytes ahead
    k_step = 64 // kf.itemsize
    v_step = 64 // vf.itemsize
    k_lines = -(-qs.shape[1] // k_step) if kcs == 1 else 0
    v_lines = -(-DV // v_step) if vcs == 1 else 0
    k_ahead = max(ROWS, PREFETCH_K // (qs.shape[1] * kf.itemsize))
    v_ahead = max(ROWS, PREFETCH_V // (DV * vf.itemsize))
    for jb in range(j0, j1, ROWS):
        n = min(ROWS, j1 - jb)
        # 1. mask terms (the scores start from them; without a mask the scores are assigned, not added)
        _mask_terms(sc, n, mf, mbase, mhs, mcs, Hm, slopes, h0, jb)
        # 2. scores, the group's heads in register blocks against pairs of K rows
        g = 0
        while g < G:
            width = 4 if G - g >= 4 else 1
            n_live = _live_rows(sc, g, width, n, mf is None, NEG_INF, rows)
            if width == 4:
                x = 0
                while x + 1 < n_live:
                    r1 = rows[x]
                    r2 = rows[x + 1]
                    if g == 0:
                        # spread over the first head block's dot products (see PREFETCH_K)
                        _prefetch_row(kf, kbase + (jb + k_ahead + r1) * krs, k_lines, k_step)
                        _prefetch_row(kf, kbase + (jb + k_ahead + r2) * krs, k_lines, k_step)
                        _prefetch_row(vf, vbase + (jb + v_ahead + r1) * vrs, v_lines, v_step)
                        _prefetch_row(vf, vbase + (jb + v_ahead + r2) * vrs, v_lines, v_step)
                    s0, s1, s2, s3, t0, t1, t2, t3 = _dot4x2(qs, g, kf, kbase + (jb + r1) * krs,
                                                             kbase + (jb + r2) * krs, kcs)
                    _score(sc, g, r1, s0, scale, softcap, mf is None)
                    _score(sc, g + 1, r1, s1, scale, softcap, mf is None)
                    _score(sc, g + 2, r1, s2, scale, softcap, mf is None)
                    _score(sc, g + 3, r1, s3, scale, softcap, mf is None)
                    _score(sc, g, r2, t0, scale, softcap, mf is None)
                    _score(sc, g + 1, r2, t1, scale, softcap, mf is None)
                    _score(sc, g + 2, r2, t2, scale, softcap, mf is None)
                    _score(sc, g + 3, r2, t3, scale, softcap, mf is None)
                    x += 2
                if x < n_live:
                    r1 = rows[x]
                    s0, s1, s2, s3 = _dot4(qs, g, kf, kbase + (jb + r1) * krs, kcs)
                    _score(sc, g, r1, s0, scale, softcap, mf is None)
                    _score(sc, g + 1, r1, s1, scale, softcap, mf is None)
                    _score(sc, g + 2, r1, s2, scale, softcap, mf is None)
                    _score(sc, g + 3, r1, s3, scale, softcap, mf is None)
            else:
                for x in range(n_live):
                    r1 = rows[x]
                    if g == 0:
                        _prefetch_row(kf, kbase + (jb + k_ahead + r1) * krs, k_lines, k_step)
                        _prefetch_row(vf, vbase + (jb + v_ahead + r1) * vrs, v_lines, v_step)
                    _score(sc, g, r1, _dot1(qs, g, kf, kbase + (jb + r1) * krs, kcs), scale, softcap, mf is None)
            g += width
        # 3. per head: rescale to the new max, turn scores into weights
        _block_weights(sc, n, M, S, A)
        # 4. A += p v, same head blocks, V rows by fours then pairs
        g = 0
        while g < G:
            width = 4 if G - g >= 4 else 1
            n_live = _live_rows(sc, g, width, n, mf is None, np.float32(0.0), rows)
            src = vf  # the V rows: vf, or a copy of the block without non-finite rows some head weighs 0
            sb = vbase + jb * vrs
            srs = vrs
            scs = vcs
            if width == 4 and per_head and _any_mixed_nonfinite(sc, g, rows, n_live, vf, sb, vrs, vcs, DV):
                src = _sanitised_block(A, DV, sc, g, rows, n_live, n, vf, sb, vrs, vcs)
                sb = 0
                srs = DV
                scs = 1
            if width == 4:
                x = 0
                while x + 3 < n_live:
                    r1 = rows[x]
                    r2 = rows[x + 1]
                    r3 = rows[x + 2]
                    r4 = rows[x + 3]
                    _axpy4x4(A, g * DV, DV, sc, g, r1, r2, r3, r4, src, sb + r1 * srs, sb + r2 * srs,
                             sb + r3 * srs, sb + r4 * srs, scs)
                    x += 4
                while x + 1 < n_live:
                    r1 = rows[x]
                    r2 = rows[x + 1]
                    _axpy4x2(A, g * DV, DV, sc, g, r1, r2, src, sb + r1 * srs, sb + r2 * srs, scs)
                    x += 2
                if x < n_live:
                    r1 = rows[x]
                    _axpy4(A, g * DV, DV, sc, g, r1, src, sb + r1 * srs, scs)
            else:
                for x in range(n_live):
                    r1 = rows[x]
                    _axpy1(A, g * DV, DV, sc[g, r1], src, sb + r1 * srs, scs)
            g += width


@kernel(inline=True)
def _scores_of_row(qs, kf, o, kcs, sc, r, scale, softcap, unmasked):
    """sc[:, r] (+)= the logits of K row at flat offset o for every head of the group (heads by fours)."""
    G = qs.shape[0]
    g = 0
    while g + 4 <= G:
        s0, s1, s2, s3 = _dot4(qs, g, kf, o, kcs)
        _score(sc, g, r, s0, scale, softcap, unmasked)
        _score(sc, g + 1, r, s1, scale, softcap, unmasked)
        _score(sc, g + 2, r, s2, scale, softcap, unmasked)
        _score(sc, g + 3, r, s3, scale, softcap, unmasked)
        g += 4
    while g < G:
        _score(sc, g, r, _dot1(qs, g, kf, o, kcs), scale, softcap, unmasked)
        g += 1


@kernel(inline=True)
def _values_of_row(A, DV, p, r, vf, o, vcs):
    """A[g] += p[g, r] V row at flat offset o for every head g of the group (heads by fours)."""
    G = p.shape[0]
    g = 0
    while g + 4 <= G:
        _axpy4(A, g * DV, DV, p, g, r, vf, o, vcs)
        g += 4
    while g < G:
        _axpy1(A, g * DV, DV, p[g, r], vf, o, vcs)
        g += 1


def _values_columns_codegen(n_heads: int):
    """LLVM IR for ``_values_columns4`` / ``_values_columns1``: n_heads x 2 accumulators in registers."""
    def codegen(context, builder, signature, llargs):
        A, p, rows, vf = (context.make_array(t)(context, builder, v)
                          for t, v in zip(signature.args[:4], llargs[:4]))
        v_dtype = signature.args[3].dtype
        g, DV, n, vbase, vrs, c0 = (as_int64(context, builder, v, t)
                                    for v, t in zip(llargs[4:], signature.args[4:]))
        ldp = builder.extract_value(p.shape, 1)
        v8p = V8.as_pointer()
        a_ptrs, p_rows = [], []
        for h in range(n_heads):
            head = builder.add(g, const(h))
            start = builder.add(builder.mul(head, DV), c0)
            a_ptrs += [builder.bitcast(builder.gep(A.data, [builder.add(start, const(8 * v))]), v8p) for v in range(2)]
            p_rows.append(builder.gep(p.data, [builder.mul(head, ldp)]))
        fma = builder.module.declare_intrinsic("llvm.fma.v8f32", (), ir.FunctionType(V8, [V8, V8, V8]))

        def step(x, acc):
            r = builder.load(builder.gep(rows.data, [x]), align=8)
            row = builder.add(vbase, builder.add(builder.mul(r, vrs), c0))
            vv = [load8(builder, v_dtype, vf.data, builder.add(row, const(8 * v))) for v in range(2)]
            out = []
            for h in range(n_heads):
                w = splat(builder, builder.load(builder.gep(p_rows[h], [r]), align=4))
                out += [builder.call(fma, [w, vv[v], acc[2 * h + v]]) for v in range(2)]
            return out

        start = [builder.load(ptr, align=4) for ptr in a_ptrs]
        for acc, ptr in zip(loop(builder, const(0), n, const(1), start, step), a_ptrs):
            builder.store(acc, ptr, align=4)
        return context.get_dummy_value()

    return codegen


def _check_values_columns(A, p, rows, vf):
    def is_c(arr, dtype, ndim):
        return isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C" and arr.ndim == ndim
    if not (is_c(A, types.float32, 1) and is_c(p, types.float32, 2) and is_c(rows, types.int64, 1)
            and any(is_c(vf, dtype, 1) for dtype in KERNEL_DTYPES)):
        raise TypingError("_values_columns: A 1-D C float32, p 2-D C float32, rows 1-D C int64, vf 1-D C float32 "
                          "or float16 / bfloat16 bits")


@intrinsic
def _values_columns4(typingctx, A, p, rows, vf, g, DV, n, vbase, vrs, c0):
    """For heads h = g .. g+3 and the 16 columns c0 .. c0+15: A[h*DV + c] += p[h, r] * V(vf[vbase + r*vrs + c])
    for r = rows[0], .., rows[n-1] in that order, one FMA per row (the roundings of ``_axpy4`` row after row),
    the 8 accumulators held in registers across the rows: A is loaded and stored once per call. V(.) widens
    float16 / bfloat16 bits exactly (``_simd.load8``)."""
    _check_values_columns(A, p, rows, vf)
    return types.none(A, p, rows, vf, g, DV, n, vbase, vrs, c0), _values_columns_codegen(4)


@intrinsic
def _values_columns1(typingctx, A, p, rows, vf, g, DV, n, vbase, vrs, c0):
    """``_values_columns4`` for the one head g."""
    _check_values_columns(A, p, rows, vf)
    return types.none(A, p, rows, vf, g, DV, n, vbase, vrs, c0), _values_columns_codegen(1)


@kernel(inline=True)
def _values_of_columns(A, DV, p, rows, n, vf, vbase, vrs, c0):
    """Columns c0 .. c0+15 of every head's A += the weighted V rows ``rows[:n]`` (heads by fours)."""
    G = p.shape[0]
    g = 0
    while g + 4 <= G:
        _values_columns4(A, p, rows, vf, g, DV, n, vbase, vrs, c0)
        g += 4
    while g < G:
        _values_columns1(A, p, rows, vf, g, DV, n, vbase, vrs, c0)
        g += 1


@kernel
def stream_rows(qs, kf, kbase, krs, kcs, vf, vbase, vrs, vcs, mf, mbase, mhs, mcs, Hm, slopes, h0, scale, softcap,
                j0, j1, M, S, A, sc, rows):
    """``group_rows`` for float32 K/V read once (decode), with K and V read side by side.

    Blocks of ROWS rows again, but the V rows of block b are consumed in the same row loop as the K rows of
    block b + 1, so both row streams are read all the time (group_rows reads a block's K rows, computes, then
    reads its V rows). The weights of block b are final before block b + 1's max can rescale A, because all of
    block b's V rows are added within block b + 1's row loop, before its softmax step.

    Each iteration scores one K row of the new block for every head (heads by fours). The V rows of block b are
    added in one of two ways, with the same FMAs in the same row order (bit-identical results):

    - by column slices (V rows of unit column stride, DV a multiple of VALUE_COLUMNS): after every
      COLUMN_EVERY K rows, ``_values_columns4`` adds one 16-column slice of every V row of block b, holding the
      slice's accumulators in registers across the rows, so A is loaded and stored once per slice and block
      instead of once per row (the per-row update is bound by its 256-bit stores). Reading V by slices defeats
      the hardware prefetchers, so each iteration prefetches the V row of the same index in the block being
      scored (added one block later) and the K row STREAM_K_AHEAD rows ahead. Eighth session, decode 32/8
      heads, D 128, one process alternating old and new per call: warm (Nkv 1024, in L3), 1 thread, 640 ->
      539 and 1064 -> 868 µs in two processes (K 32 rows ahead; 64, kept, was as good cold); cold (Nkv
      4096, 256 MiB of layers), 2 threads, within the noise of the row-by-row loop to a few points better
      (docs/attention.md). Without the prefetches the slices
      ran cold at 35-43% of the DRAM probe against 53-70%;
    - row by row otherwise: one V row of block b per iteration added to every head's A (``_axpy4``).
      Seventh session: a plain kernel reading the rows side by side reached 80-84% of a DRAM probe's
      bandwidth where one reading them block after block reached 70-73%; row pairs were slower.
    """
    G = qs.shape[0]
    DV = A.shape[0] // G
    unmasked = mf is None
    per_head = mf is not None and Hm > 1  # mixed rows possible (see group_rows)
    # the caller's scratch (sc, rows) and a second pair, swapped after every block
    cur = sc  # scores, then weights, of the block being scored
    prev = np.empty((G, ROWS), np.float32)  # weights of the block whose V rows are being added
    cur_rows = rows  # its rows to score, then its rows of nonzero weight
    prev_rows = np.empty(ROWS, np.int64)
    n_prev = 0  # rows of ``prev`` still to add
    prev_jb = j0
    # V rows of unit column stride and whole 16-column slices: by column slices (see the docstring)
    by_columns = vcs == 1 and DV % VALUE_COLUMNS == 0
    n_slices = DV // VALUE_COLUMNS
    v_step = 64 // vf.itemsize  # elements per 64-byte line
    k_step = 64 // kf.itemsize
    v_lines = -(-DV // v_step)
    k_lines = -(-qs.shape[1] // k_step) if kcs == 1 else 0
    for jb in range(j0, j1 + ROWS, ROWS):
        n = max(0, min(ROWS, j1 - jb))  # 0: the pass after the last block, adding its V rows only
        _mask_terms(cur, n, mf, mbase, mhs, mcs, Hm, slopes, h0, jb)
        n_cur = _live_rows(cur, 0, G, n, unmasked, NEG_INF, cur_rows)
        if by_columns:
            done = 0  # column slices of the previous block's V rows added so far
            for x in range(n_cur):
                r = cur_rows[x]
                _scores_of_row(qs, kf, kbase + (jb + r) * krs, kcs, cur, r, scale, softcap, unmasked)
                # this block's V row (added during the next block) and a K row STREAM_K_AHEAD rows on
                _prefetch_row(vf, vbase + (jb + r) * vrs, v_lines, v_step)
                _prefetch_row(kf, kbase + (jb + r + STREAM_K_AHEAD) * krs, k_lines, k_step)
                if x % COLUMN_EVERY == COLUMN_EVERY - 1 and done < n_slices and n_prev > 0:
                    _values_of_columns(A, DV, prev, prev_rows, n_prev, vf, vbase + prev_jb * vrs, vrs,
                                       done * VALUE_COLUMNS)
                    done += 1
            while done < n_slices and n_prev > 0:
                _values_of_columns(A, DV, prev, prev_rows, n_prev, vf, vbase + prev_jb * vrs, vrs,
                                   done * VALUE_COLUMNS)
                done += 1
        else:
            for x in range(max(n_cur, n_prev)):
                if x < n_cur:
                    r = cur_rows[x]
                    _scores_of_row(qs, kf, kbase + (jb + r) * krs, kcs, cur, r, scale, softcap, unmasked)
                if x < n_prev:
                    r = prev_rows[x]
                    _values_of_row(A, DV, prev, r, vf, vbase + (prev_jb + r) * vrs, vcs)
        _block_weights(cur, n, M, S, A)
        n_prev = _live_rows(cur, 0, G, n, unmasked, np.float32(0.0), cur_rows)
        if per_head:
            n_prev = _drop_mixed_nonfinite(A, DV, cur, cur_rows, n_prev, vf, vbase + jb * vrs, vrs, vcs)
        cur, prev = prev, cur
        cur_rows, prev_rows = prev_rows, cur_rows
        prev_jb = jb


@kernel(inline=True)
def _max_nan(a, b):
    """max(a, b), NaN when either is NaN (Python's max keeps the first argument when the second is NaN)."""
    return a if (a > b or a != a) else b


@kernel
def finalize(m, s, A, a0, DV, sink, of, obase, ocs):
    """out = A[a0:a0+DV] / (s + exp(sink - m)), both terms rescaled to max(m, sink); zeros when nothing is live.

    The DV outputs go to flat offsets ``obase + d * ocs`` of ``of``. A NaN score leaves s NaN (``m`` may still be
    -inf) and a NaN sink makes the max NaN: both give NaN outputs.
    """
    top = _max_nan(sink, m)
    if top == NEG_INF and s == 0.0:
        for d in range(DV):
            of[obase + d * ocs] = 0.0
        return
    factor = fast_exp(m - top)  # 0 when m is -inf (only the sink is live: the output is 0)
    total = s * factor + fast_exp(sink - top)
    weight = factor / total
    acc = A[a0:a0 + DV]
    for d in range(DV):
        of[obase + d * ocs] = acc[d] * weight

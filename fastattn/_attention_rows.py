"""Register-block arithmetic over a block of KV rows for a GQA group's heads (see ``_attention_group``).

Query heads go in blocks of 4 (the rest one by one). ``_dot4x2`` scores two K rows for 4 heads in one pass over
the rows (8 sums); ``_axpy4x4`` adds four weighted V rows to 4 heads' accumulators, loading and storing each
accumulator once per four rows (the per-row update is bound by its 256-bit stores). Rows are addressed by flat
offsets (``_attention_layout``) with unsigned arithmetic so the loops vectorise; float16/bfloat16 bits are widened
on the fly with ``to_f32``; column stride 1 takes the contiguous loop.
"""
from __future__ import annotations

import numpy as np

from ._kernel import kernel, prefetch, to_f32

#: KV rows per block: 32 rows of K and of V (8-16 KiB each at D 128) stay in L1 across the group's head blocks.
ROWS = 32


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
    (the per-row update is bound by its 256-bit stores)."""
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

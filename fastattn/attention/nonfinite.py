"""V rows holding inf or NaN under a per-head mask (see ``attention.group``).

With a per-head mask a KV row can be hidden from some heads of a register block (weight 0) and live for others.
The block V updates add ``p·v`` for all 4 heads at once, so such a row holding inf or NaN would give the hidden
heads ``0·NaN``. These helpers find such rows, add them per head to the heads that weigh them, and keep them out of
the grouped pass (a zeroed copy of the block, or the row dropped from the list), which leaves every other sum bit
for bit as with a finite row. They run only with a per-head mask, and copy only when such a row exists. The loops
call them through ``sanitised_rows`` and ``drop_mixed``, which compile to nothing for calls whose mask has one row
for every head (the per-head marker None: ``attention.group.group_rows``).
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .rows import axpy1
from .._core.kernel import kernel, to_f32


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
            axpy1(A, (g + t) * DV, DV, p[g + t, r], vf, o, vcs)


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


def sanitised_rows(per_head, A, DV, p, g, rows, n_live, n, vf, vb, vrs, vcs):
    """The V rows of the head block g .. g+3 for its grouped pass, as (array, base, row stride, column stride):
    vf's rows as they are, or, under a per-head mask with a ``_mixed_nonfinite`` row, the ``_sanitised_block``
    copy. ``per_head`` None (no per-head mask) compiles to the first answer alone. Kernel-only."""
    raise NotImplementedError("compiled code only")


@overload(sanitised_rows, inline="always")
def _sanitised_rows(per_head, A, DV, p, g, rows, n_live, n, vf, vb, vrs, vcs):
    if isinstance(per_head, types.NoneType):
        return lambda per_head, A, DV, p, g, rows, n_live, n, vf, vb, vrs, vcs: (vf, vb, vrs, vcs)

    def run(per_head, A, DV, p, g, rows, n_live, n, vf, vb, vrs, vcs):
        if _any_mixed_nonfinite(p, g, rows, n_live, vf, vb, vrs, vcs, DV):
            return _sanitised_block(A, DV, p, g, rows, n_live, n, vf, vb, vrs, vcs), 0, DV, 1
        return vf, vb, vrs, vcs
    return run


def drop_mixed(per_head, A, DV, p, rows, n_live, vf, vb, vrs, vcs):
    """``_drop_mixed_nonfinite`` under a per-head mask; n_live unchanged when ``per_head`` is None (compiled to
    nothing). Kernel-only."""
    raise NotImplementedError("compiled code only")


@overload(drop_mixed, inline="always")
def _drop_mixed(per_head, A, DV, p, rows, n_live, vf, vb, vrs, vcs):
    if isinstance(per_head, types.NoneType):
        return lambda per_head, A, DV, p, rows, n_live, vf, vb, vrs, vcs: n_live
    return lambda per_head, A, DV, p, rows, n_live, vf, vb, vrs, vcs: _drop_mixed_nonfinite(
        A, DV, p, rows, n_live, vf, vb, vrs, vcs)

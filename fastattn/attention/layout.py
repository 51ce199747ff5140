"""Flat views of strided attention arrays, made inside the kernels.

Memory layout: every array is read *flat* (``flat4``, inside the kernels): a 1-D C-contiguous view of the memory
the strided array spans, plus the element offset of its first element and its element strides. A K/V cache
slice, a transposed token-major cache or a padded view then compiles to the same code as a contiguous array
(one specialisation per dtype), and rows are read with unsigned offsets so the inner loops vectorise (Numba's
"any layout" arrays and signed indices do not). A row whose elements are not adjacent (column stride != 1) takes
a strided loop.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import carray, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .rows import ROWS
from .._core.kernel import call_any_layout, kernel, to_f32

NEG_INF = np.float32(-np.inf)
#: Mask entries ``mask_spans`` tests at a time before it looks entry by entry.
SPAN_STEP = 64


class FlatRows(NamedTuple):
    """Rows read flat: row j starts at offset ``base + j * row_stride`` of ``flat`` (``flat4``'s view), its
    elements ``column_stride`` apart."""
    flat: np.ndarray
    base: int
    row_stride: int
    column_stride: int


class MaskAt(NamedTuple):
    """Where one query row's entries are in the flat mask: head h, column j at
    ``base + (h % n_heads) * head_stride + j * column_stride``."""
    base: int
    head_stride: int
    column_stride: int
    n_heads: int
    per_head: bool | None  # True for a mask with a row per head, else None (``attention.nonfinite``)


class Mask(NamedTuple):
    """A call's mask as the one_chunk and split_kv drivers take it."""
    array: np.ndarray | None  # the kernel view (Bm, Hm, Nm, Nkv); None: no mask
    spans: np.ndarray  # each row's live columns [lo, hi) (``mask_spans``)
    per_head: bool | None  # True for a mask with a row per head, else None (``attention.nonfinite``)


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


@kernel(inline=True)
def _live_in(mf, start, cs, n):
    """How many of the n mask entries from flat offset ``start`` (stride cs) are not -inf; no branch (vectorised)."""
    live = 0
    u = np.uint64(start)  # unsigned offsets: signed ones carry a negative-index wrap that stops vectorisation
    if cs == 1:  # two loops: a select between the two addressings inside one loop does not vectorise
        for r in range(n):
            live += to_f32(mf[u + np.uint64(r)]) != NEG_INF
    else:
        for r in range(n):
            live += to_f32(mf[start + r * cs]) != NEG_INF
    return live


@kernel
def mask_spans(mask, n_q, spans):
    """spans[bm, hm, i] = (lo, hi): row i of mask (bm, hm) is ``-inf`` outside columns [lo, hi) (lo == hi when
    the whole row is). Scans in from each end, SPAN_STEP entries at a time, then entry by entry, so it costs the
    hidden prefix and suffix (a sliding window, a padded batch entry) once per call, not once per KV head."""
    mf, mo, mst = flat4(mask)
    n_kv = mask.shape[3]
    cs = mst[3]
    for bm in range(mask.shape[0]):
        for hm in range(mask.shape[1]):
            for i in range(n_q):
                base = mo + bm * mst[0] + hm * mst[1] + i * mst[2]
                lo = 0
                while lo + SPAN_STEP <= n_kv and _live_in(mf, base + lo * cs, cs, SPAN_STEP) == 0:
                    lo += SPAN_STEP
                while lo < n_kv and to_f32(mf[base + lo * cs]) == NEG_INF:
                    lo += 1
                hi = n_kv
                while hi - SPAN_STEP >= lo and _live_in(mf, base + (hi - SPAN_STEP) * cs, cs, SPAN_STEP) == 0:
                    hi -= SPAN_STEP
                while hi > lo and to_f32(mf[base + (hi - 1) * cs]) == NEG_INF:
                    hi -= 1
                spans[bm, hm, i, 0] = lo
                spans[bm, hm, i, 1] = hi


@kernel
def live_range(spans, mask, bm, h0, G, Hm, i, c0, c1):
    """The part of KV rows [c0, c1) a group's walk needs for query row i: the blocks (on c0's grid of ROWS rows)
    from the one holding the first column any of heads h0 .. h0+G sees to the one holding the last. The blocks left
    out are hidden from every head, so leaving them out changes nothing (see ``attention.group``)."""
    if mask is None:
        return c0, c1
    lo = c1
    hi = c0
    for t in range(min(G, Hm)):
        lo = min(lo, spans[bm, (h0 + t) % Hm, i, 0])
        hi = max(hi, spans[bm, (h0 + t) % Hm, i, 1])
    if lo >= hi or lo >= c1 or hi <= c0:
        return c0, c0
    start = c0 if lo <= c0 else c0 + ((lo - c0) // ROWS) * ROWS
    # whole blocks of the grid: a block cut short would sum its weights in another order (reassociated)
    end = min(c1, c0 + -(-(hi - c0) // ROWS) * ROWS)
    return start, end


#: The ``Mask`` group of a call without a mask (its spans a placeholder the kernels never read): made once, as
#: decode calls would otherwise pay for the group and its spans every time.
NO_MASK = Mask(None, np.zeros((1, 1, 1, 2), np.int64), None)


def mask_of(mask, n_q: int) -> Mask:
    """The ``Mask`` group of a mask kernel view (None: no mask) for ``n_q`` query rows: its spans
    (``mask_spans``) computed here."""
    if mask is None:
        return NO_MASK
    spans = np.empty(mask.shape[:2] + (n_q, 2), np.int64)
    call_any_layout(mask_spans, (0,), mask, n_q, spans)
    return Mask(element_strides(mask), spans, None if mask.shape[1] == 1 else True)


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

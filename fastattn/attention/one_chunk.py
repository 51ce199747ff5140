"""Attention path ``one_chunk``: every query row runs its own online softmax over the whole KV range.

Work unit: (batch b, KV head, a chunk of ``ROW_CHUNK`` query rows). For each query row of the unit, the query
heads of the KV head's GQA group run together over the KV rows the mask lets through
(``attention.group.group_rows``: each K/V row is read once for the whole group; blocks hidden from every head
are skipped unread, and rows masked ``-inf`` for every head are skipped without their dot product). Without a
mask that is all Nkv rows; with one, a row's hidden prefix and suffix (a window, a padded batch entry) are found
once per call (``attention.layout.mask_spans``) and left out. Then each head is normalised with its sink into ``out[b, i, h]``. Units are independent, so the parallel driver's
threads take them in any order from a shared counter (``_core.kernel.fetch_add``), with private scratch; the serial
driver runs the same units in a loop (small work: a parallel launch costs more than it saves, see ``_core.threads``).
Both call the unit by address (``_core.kernel.call_unit``), so it is compiled once, not inside every driver. A unit's
result does not depend on the thread that runs it: the output is the same for any thread count.

Arrays are read flat (``attention.group.flat4``): nothing is copied but the group's query rows (G x DK floats).
With ``pages`` (a paged cache), K/V are the cache's pages and each sequence's rows are walked through its block
table (``attention.paged.paged_group_rows``: on the same blocks, so with the same result as a contiguous cache).
"""
from __future__ import annotations

import numpy as np
from numba import prange, types

from .._core import threads as _threads
from .group import BlockScratch, SoftmaxState, group_rows_handle, load_group_queries
from .layout import FlatRows, MaskAt, element_strides, flat4, flat_mask, live_range, mask_of, no_sinks
from .paged import copies_for, paged_group_rows
from .rows import ROWS
from .softmax import Logits, finalize
from .._core.kernel import argument_positions, call_any_layout, call_unit, check_unit, fetch_add, kernel, work_unit

#: Query rows per work unit: enough units to balance two threads at small Nq, few enough to amortise the scratch.
ROW_CHUNK = 4


@kernel
def _unit(q, k, v, mask, logits, sinks, out, group_rows, pages, u):
    """The work unit ``u`` (module docstring). ``mask``: ``attention.layout.Mask`` (its ``per_head`` None: the
    per-head handling of non-finite V rows is not compiled, ``attention.nonfinite.sanitised_rows``);
    ``logits``: ``attention.softmax.Logits``; ``sinks`` (Hq,) float32; ``group_rows``: ``group_rows``' handle
    (``group_rows_handle``), called by address; ``pages``: None (k, v hold the rows), or ``attention.paged.Pages``
    with k, v the pages (not in a group: a None argument prunes the paged code while typing)."""
    B, Hq, Nq, DK = q.shape
    Bk, Hkv, Nkv = k.shape[0], k.shape[1], k.shape[2]
    DV = out.shape[3]  # v's last axis counts bytes when V is quantized
    qf, qo, qst = flat4(q)
    kf, ko, kst = flat4(k)
    vf, vo, vst = flat4(v)
    of, oo, ost = flat4(out)
    mf, mo, mst, Bm, Hm = flat_mask(mask.array)
    G = Hq // Hkv
    n_row_chunks = (Nq + ROW_CHUNK - 1) // ROW_CHUNK
    row_chunk = u % n_row_chunks
    kvh = (u // n_row_chunks) % Hkv
    b = u // (n_row_chunks * Hkv)
    h0 = kvh * G
    qs = np.empty((G, DK), np.float32)
    sc = np.empty((G, ROWS), np.float32)
    live = np.empty(ROWS, np.int64)
    M = np.empty(G, np.float32)
    S = np.empty(G, np.float32)
    A = np.empty(G * DV, np.float32)
    if pages is None:
        kb = b // (B // Bk)
        n_kv = Nkv
    else:  # page 0's rows; paged_group_rows finds the pages
        kb = 0
        n_kv = pages.ends[b] - pages.starts[b]
        copies = copies_for(kf, k.shape[3], vf, v.shape[3])
    k_rows = FlatRows(kf, ko + kb * kst[0] + kvh * kst[1], kst[2], kst[3])
    v_rows = FlatRows(vf, vo + kb * vst[0] + kvh * vst[1], vst[2], vst[3])
    for i in range(row_chunk * ROW_CHUNK, min(Nq, (row_chunk + 1) * ROW_CHUNK)):
        load_group_queries(qf, qo + b * qst[0] + h0 * qst[1] + i * qst[2], qst[1], qst[3], qs)
        M[:] = -np.inf
        S[:] = 0.0
        A[:] = 0.0
        # the mask's hidden ends left out; np.int64(0), not a literal 0: group_rows' argument types must be
        # split_kv's, which shares its compilation
        j0, j1 = live_range(mask.spans, mask.array, b % Bm, h0, G, Hm, i, np.int64(0), n_kv)
        mask_at = MaskAt(mo + (b % Bm) * mst[0] + i * mst[2], mst[1], mst[3], np.int64(Hm), mask.per_head)
        args = (qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, SoftmaxState(M, S, A), BlockScratch(sc, live),
                Nq == 1)
        if pages is None:
            call_unit(group_rows, args)
        else:
            paged_group_rows(group_rows, args, pages, b, (kst[0], vst[0]), copies)
        for g in range(G):
            finalize(M[g], S[g], A, g * DV, DV, sinks[h0 + g], of, oo + b * ost[0] + i * ost[1] + (h0 + g) * ost[2],
                     ost[3])


@kernel
def _serial(unit, q, k, v, mask, logits, sinks, out, group_rows, pages):
    n_units = q.shape[0] * k.shape[1] * ((q.shape[2] + ROW_CHUNK - 1) // ROW_CHUNK)
    for u in range(n_units):
        call_unit(unit, (q, k, v, mask, logits, sinks, out, group_rows, pages, u))


@kernel(parallel=True)
def _parallel(unit, q, k, v, mask, logits, sinks, out, group_rows, pages, next_unit, n_threads):
    n_units = q.shape[0] * k.shape[1] * ((q.shape[2] + ROW_CHUNK - 1) // ROW_CHUNK)
    # one iteration per thread, each taking units from the shared counter: decode has few units (one per KV
    # head), and a static split leaves a thread whose core is busy elsewhere deciding the time
    for _ in prange(n_threads):
        u = fetch_add(next_unit)
        while u < n_units:
            call_unit(unit, (q, k, v, mask, logits, sinks, out, group_rows, pages, u))
            u = fetch_add(next_unit)


#: The drivers' unit (``_core.kernel.work_unit``): ``_unit`` on the drivers' arguments of its parameters' names
#: and a unit number.
UNIT = work_unit(_unit, _serial, _parallel, extra=(types.int64,))
#: The driver's arguments read through flat4: compiled for any layout.
STRIDED = argument_positions(_serial, "q", "k", "v", "mask", "out")


def run_one_chunk(q, k, v, mask, slopes, sinks, scale, softcap, out, pages=None) -> None:
    """Fill ``out`` (B, Nq, Hq, DV) float32 with attention over q (B, Hq, Nq, DK) float32, k/v kernel views
    (Bk, Hkv, Nkv, DK|DV) (quantized: their bytes, ``quant.bytes_view``), mask None or a kernel view
    (Bm, Hm, Nm, Nkv), slopes (Hq,) float32, sinks None or (Hq,) float32; scale and softcap Python floats
    (softcap 0 = off). Every input may be strided. With ``pages`` (``attention.paged.Pages``), k/v are the pages
    (num_pages, Hkv, P, DK|DV) and sequence b's KV rows its live rows read through the block table (Nkv: the
    longest sequence's, which the mask's columns cover)."""
    B, Hq, Nq, DK = q.shape
    Hkv, Nkv = k.shape[1], k.shape[2]
    if sinks is None:
        sinks = no_sinks(Hq)
    sinks = np.ascontiguousarray(sinks)  # Hq floats: contiguous keeps one specialisation
    # Each query row streams the whole K and V of its KV head (from cache after the first rows).
    rows = B * Nkv if pages is None else int((pages.ends - pages.starts).sum())
    nbytes = Nq * Hkv * rows * (k.shape[3] * k.itemsize + v.shape[3] * v.itemsize)
    n_threads = _threads.threads_for(nbytes)
    mask_group = mask_of(mask, Nq)
    group_rows = group_rows_handle(k.dtype, v.dtype, None if mask is None else mask.dtype, mask_group.per_head,
                                   Nq == 1)
    args = (element_strides(q), element_strides(k), element_strides(v), mask_group,
            Logits(np.float32(scale), np.float32(softcap), slopes), sinks, out, group_rows, pages)
    with _threads.team("one_chunk", nbytes, n_threads) as launch:
        if launch.n > 1:
            call_any_layout(_parallel, STRIDED, *args, np.zeros(1, np.int64), launch.n, unit=UNIT)
        else:
            call_any_layout(_serial, STRIDED, *args, unit=UNIT)
    check_unit(group_rows)

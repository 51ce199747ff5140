"""Attention path ``split_kv``: decode (Nq == 1), the KV range cut into chunks, partial softmaxes reduced.

Phase 1, work unit (batch b, KV head, KV chunk c): the query heads of the KV head's GQA group run the online
softmax over the chunk's rows together (``attention.group.group_rows``: one read of each K/V row serves every head
of the group) and leave a partial ``(M, S, A)`` per head: running max, sum of ``exp(s - M)`` and unnormalised
``sum exp(s - M) v``. With a mask, only the chunk's blocks between the first and last key the mask lets through
are walked (``attention.layout.live_range``); a chunk outside them leaves the empty partial (-inf, 0, 0).

Phase 2 (on the calling thread: it is ~1% of the work), per (b, query head): the partials are folded in chunk
order with the two-state online softmax (``M' = max(M, M_c)``, ``S' = S e^(M - M') + S_c e^(M_c - M')``, the
same for ``A``), then the sink joins the denominator and ``out[b, 0, h] = A / S``.

Threads: one ``prange`` iteration per thread. The units are cut into one range of adjacent units per thread;
each thread takes the next unit of its own range from that range's atomic counter (``_core.kernel.fetch_add``), then
helps the other ranges the same way, so a thread slowed down by another process simply runs fewer units. A
thread's units are thus adjacent KV chunks of a head, one stream of rows for the hardware prefetchers and the
loop's own K prefetch, which runs into the next chunk (2 threads, cold cache, one process alternating the two
schedules: Nkv 512 / 4096 / 16384 float32 took 0.92x / 0.95x / 0.87x the time of units taken from one shared
counter, where consecutive units of a thread were chunks apart).

Chunk boundaries depend on Nkv only (``chunking``), never on the thread count, and each chunk and each fold runs
the same code in a fixed order: the output is bit-identical for 1 and N threads (ggml's is not).

Partials live in per-Python-thread buffers ``(B, Hkv, chunks, G)`` (M, S) and ``(B, Hkv, chunks, G * DV)`` (A),
reused from call to call (bounded: at most 32 chunks per KV head, the last 4 shapes kept), so concurrent calls
from several Python threads never share them.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
from numba import prange, types

from .._core import threads as _threads
from .group import BlockScratch, SoftmaxState, group_rows_handle, load_group_queries
from .layout import FlatRows, MaskAt, element_strides, flat4, flat_mask, live_range, mask_of, no_sinks
from .paged import copies_for, paged_group_rows
from .rows import ROWS
from .softmax import Logits, finalize
from .._core.kernel import (argument_positions, call_any_layout, call_unit, check_unit, fast_exp, fetch_add, kernel,
                             work_unit)

#: Rows per chunk aimed at. Each chunk costs a unit's setup, its partials and a fold step; measured on the
#: 2-core machine (1 thread, cold cache), 512-1024-row chunks ran 4-20% faster than 256-row ones and matched
#: one_chunk, while Nkv 4096 with 8 KV heads still gives 64 units to spread over the threads.
CHUNK_ROWS = 512
#: int64 slots between the ranges' unit counters: one 64-byte line each, so the threads' atomics do not share one.
COUNTER_STRIDE = 8
#: At most this many chunks per KV head (long contexts get longer chunks): bounds the partial buffers.
MAX_CHUNKS = 32
NEG_INF = np.float32(-np.inf)

_local = threading.local()


class Chunks(NamedTuple):
    """The KV range cut into chunks of ``rows`` rows (``chunking``) and each chunk's partial softmax, float32 per
    (batch, KV head, chunk): running max ``M`` and sum ``S`` (.., G) and unnormalised output ``A`` (.., G * DV)."""
    rows: int
    M: np.ndarray
    S: np.ndarray
    A: np.ndarray


def chunking(n_kv: int) -> tuple[int, int]:
    """(number of chunks, rows per chunk) for Nkv rows: a function of Nkv alone."""
    n_chunks = min(MAX_CHUNKS, max(1, -(-n_kv // CHUNK_ROWS)))
    rows = -(-n_kv // n_chunks)
    return -(-n_kv // rows), rows


def _partials(B: int, Hkv: int, n_chunks: int, G: int, DV: int):
    """This Python thread's partial buffers for the shape (reused; the last 4 shapes are kept)."""
    cache = getattr(_local, "partials", None)
    if cache is None:
        cache = _local.partials = {}
    key = (B, Hkv, n_chunks, G, DV)
    buffers = cache.pop(key, None)
    if buffers is None:
        if len(cache) >= 4:
            cache.pop(next(iter(cache)))
        buffers = (np.empty((B, Hkv, n_chunks, G), np.float32), np.empty((B, Hkv, n_chunks, G), np.float32),
                   np.empty((B, Hkv, n_chunks, G * DV), np.float32))
    cache[key] = buffers  # most recently used last
    return buffers


@kernel
def _chunk(q, k, v, mask, logits, chunks, group_rows, pages, u):
    """Unit ``u`` (module docstring). ``mask``: ``attention.layout.Mask``; ``logits``: ``attention.softmax.Logits``;
    ``chunks``: ``Chunks``; ``group_rows``: ``group_rows``' handle (``group_rows_handle``), called by address;
    ``pages``: None, or ``attention.paged.Pages`` with k, v the pages (as ``attention.one_chunk``'s unit)."""
    B, Hq, _, DK = q.shape
    Bk, Hkv, Nkv = k.shape[0], k.shape[1], k.shape[2]
    qf, qo, qst = flat4(q)
    kf, ko, kst = flat4(k)
    vf, vo, vst = flat4(v)
    mf, mo, mst, Bm, Hm = flat_mask(mask.array)
    rows = chunks.rows
    n_chunks = chunks.M.shape[2]
    G = Hq // Hkv
    c = u % n_chunks
    kvh = (u // n_chunks) % Hkv
    b = u // (n_chunks * Hkv)
    h0 = kvh * G
    qs = np.empty((G, DK), np.float32)
    sc = np.empty((G, ROWS), np.float32)
    live = np.empty(ROWS, np.int64)
    load_group_queries(qf, qo + b * qst[0] + h0 * qst[1], qst[1], qst[3], qs)
    M = chunks.M[b, kvh, c]
    S = chunks.S[b, kvh, c]
    M[:] = -np.inf
    S[:] = 0.0
    # The unit accumulates into its own scratch and copies it out once: accumulating straight into the partial
    # buffer (units 2 KiB apart) ran 15-30% slower in interleaved runs, likely store/load address aliasing with
    # the V rows.
    A = np.zeros(chunks.A.shape[3], np.float32)
    # the chunk's rows less the mask's hidden ends: a chunk outside the live keys leaves the empty partial
    if pages is None:
        kb = b // (B // Bk)
        n_kv = Nkv
    else:  # page 0's rows; paged_group_rows finds the pages
        kb = 0
        n_kv = pages.ends[b] - pages.starts[b]
        copies = copies_for(kf, k.shape[3], vf, v.shape[3])
    c0 = min(n_kv, c * rows)  # a paged sequence shorter than the longest may have empty chunks
    j0, j1 = live_range(mask.spans, mask.array, b % Bm, h0, G, Hm, np.int64(0), c0, min(n_kv, (c + 1) * rows))
    k_rows = FlatRows(kf, ko + kb * kst[0] + kvh * kst[1], kst[2], kst[3])
    v_rows = FlatRows(vf, vo + kb * vst[0] + kvh * vst[1], vst[2], vst[3])
    mask_at = MaskAt(mo + (b % Bm) * mst[0], mst[1], mst[3], np.int64(Hm), mask.per_head)
    # streaming as a bool, not a literal True: the argument types are one_chunk's, which shares the compilation
    args = (qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, SoftmaxState(M, S, A), BlockScratch(sc, live),
            q.shape[2] == 1)
    if pages is None:
        call_unit(group_rows, args)
    else:
        paged_group_rows(group_rows, args, pages, b, (kst[0], vst[0]), copies)
    out_partial = chunks.A[b, kvh, c]
    for d in range(A.shape[0]):  # not ``chunks.A[b, kvh, c] = A``: that compiles NumPy's shape-error formatting
        out_partial[d] = A[d]


@kernel
def _fold(chunks, sinks, out, bh):
    """Reduce the chunks of (b, query head) in chunk order and write out[b, 0, h]."""
    Mp, Sp, Ap = chunks.M, chunks.S, chunks.A
    Hkv, n_chunks, G = Mp.shape[1], Mp.shape[2], Mp.shape[3]
    DV = Ap.shape[3] // G
    of, oo, ost = flat4(out)
    b = bh // (Hkv * G)
    h = bh % (Hkv * G)
    kvh = h // G
    g = h % G
    acc = np.zeros(DV, np.float32)
    m = NEG_INF
    s = np.float32(0.0)
    for c in range(n_chunks):
        mc = Mp[b, kvh, c, g]
        sc = Sp[b, kvh, c, g]
        if mc == NEG_INF and sc == 0.0:
            continue  # nothing live in this chunk (a NaN score leaves M -inf but S NaN: folded in, NaN out)
        top = max(m, mc)
        old = fast_exp(m - top)  # 0 while m is -inf
        new = fast_exp(mc - top)
        s = s * old + sc * new
        part = Ap[b, kvh, c, g * DV:(g + 1) * DV]  # a view from 0: ``part[g * DV + d]`` did not vectorise
        for d in range(DV):
            acc[d] = acc[d] * old + part[d] * new
        m = top
    finalize(m, s, acc, np.int64(0), DV, sinks[h], of, oo + b * ost[0] + h * ost[2], ost[3])


@kernel
def _serial(unit, q, k, v, mask, logits, sinks, out, chunks, group_rows, pages):
    for u in range(chunks.M.shape[0] * chunks.M.shape[1] * chunks.M.shape[2]):
        call_unit(unit, (q, k, v, mask, logits, chunks, group_rows, pages, u))
    for bh in range(q.shape[0] * q.shape[1]):
        _fold(chunks, sinks, out, bh)


@kernel(parallel=True)
def _parallel(unit, q, k, v, mask, logits, sinks, out, chunks, group_rows, pages, next_unit):
    n_units = chunks.M.shape[0] * chunks.M.shape[1] * chunks.M.shape[2]
    n_threads = next_unit.shape[0] // COUNTER_STRIDE  # one counter per thread
    # One iteration per thread. The units are cut into n_threads ranges of adjacent units (adjacent KV chunks of
    # a head: one stream of rows); thread t takes units from range t's counter, then helps the other ranges in
    # turn (a unit's result does not depend on the thread that runs it, so the output stays bit-identical).
    per_range = -(-n_units // n_threads)
    for t in prange(n_threads):
        for j in range(n_threads):
            r = (t + j) % n_threads
            lo = r * per_range
            hi = min(n_units, lo + per_range)
            counter = next_unit[r * COUNTER_STRIDE:r * COUNTER_STRIDE + 1]
            u = lo + fetch_add(counter)
            while u < hi:
                call_unit(unit, (q, k, v, mask, logits, chunks, group_rows, pages, u))
                u = lo + fetch_add(counter)
    # The folds are ~1% of the work: on the calling thread, saving a second fork-join of the pool.
    for bh in range(q.shape[0] * q.shape[1]):
        _fold(chunks, sinks, out, bh)


#: The drivers' unit (``_core.kernel.work_unit``): ``_chunk`` on the drivers' arguments of its parameters' names
#: and a unit number; ``mask`` as one_chunk's (``attention.one_chunk.UNIT``).
UNIT = work_unit(_chunk, _serial, _parallel, extra=(types.int64,))
#: The driver's arguments read through flat4: compiled for any layout.
STRIDED = argument_positions(_serial, "q", "k", "v", "mask", "out")


def run_split_kv(q, k, v, mask, slopes, sinks, scale, softcap, out, pages=None) -> None:
    """Decode attention into ``out`` (B, 1, Hq, DV) float32: q (B, Hq, 1, DK) float32, k/v kernel views
    (Bk, Hkv, Nkv, DK|DV) (quantized: their bytes, ``quant.bytes_view``), mask None or a kernel view
    (Bm, Hm, Nm, Nkv), slopes (Hq,) float32, sinks None or (Hq,) float32; scale and softcap Python floats
    (softcap 0 = off). Every input may be strided. With ``pages`` (``attention.paged.Pages``), k/v are the pages
    (num_pages, Hkv, P, DK|DV), sequence b's KV rows its live rows read through the block table; the chunks are
    those of the longest sequence's rows (Nkv), so a batch of one chunks as the contiguous call does.

    Raises ValueError (before writing anything) when Nq != 1.
    """
    B, Hq, Nq, DK = q.shape
    if Nq != 1:
        raise ValueError(f"path 'split_kv' is for decode: q must have Nq = 1 query row, got q.shape {q.shape}")
    Hkv, Nkv = k.shape[1], k.shape[2]
    rows_read = B * Nkv
    if pages is not None:
        Nkv = max(1, int((pages.ends - pages.starts).max()))
        rows_read = int((pages.ends - pages.starts).sum())
    DV = out.shape[3]  # v's last axis counts bytes when V is quantized
    if sinks is None:
        sinks = no_sinks(Hq)
    sinks = np.ascontiguousarray(sinks)  # Hq floats: contiguous keeps one specialisation
    n_chunks, rows = chunking(Nkv)
    chunks = Chunks(rows, *_partials(B, Hkv, n_chunks, Hq // Hkv, DV))
    nbytes = Hkv * rows_read * (k.shape[3] * k.itemsize + v.shape[3] * v.itemsize)
    n_threads = _threads.threads_for(nbytes)
    mask_group = mask_of(mask, 1)
    group_rows = group_rows_handle(k.dtype, v.dtype, None if mask is None else mask.dtype, mask_group.per_head,
                                   q.shape[2] == 1)
    args = (element_strides(q), element_strides(k), element_strides(v), mask_group,
            Logits(np.float32(scale), np.float32(softcap), slopes), sinks, out, chunks, group_rows, pages)
    with _threads.team("split_kv", nbytes, n_threads) as launch:
        if launch.n > 1:
            call_any_layout(_parallel, STRIDED, *args, np.zeros(launch.n * COUNTER_STRIDE, np.int64), unit=UNIT)
        else:
            call_any_layout(_serial, STRIDED, *args, unit=UNIT)
    check_unit(group_rows)

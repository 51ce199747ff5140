"""Attention path ``one_chunk``: every query row runs its own online softmax over the whole KV range.

Work unit: (batch b, KV head, a chunk of ``ROW_CHUNK`` query rows). For each query row of the unit, the query
heads of the KV head's GQA group run together over all Nkv rows (``_attention_group.group_rows``: each K/V row is
read once for the whole group; rows masked ``-inf`` for every head are skipped without their dot product), then
each head is normalised with its sink into ``out[b, i, h]``. Units are independent, so the parallel driver's
threads take them in any order from a shared counter (``_kernel.fetch_add``), with private scratch; the serial
driver runs the same units in a loop (small work: a parallel launch costs more than it saves, see ``_threads``).
A unit's result does not depend on the thread that runs it: the output is the same for any thread count.

Arrays are read flat (``_attention_group.flat4``): nothing is copied but the group's query rows (G x DK floats).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from . import _threads
from ._attention_group import (ROWS, element_strides, finalize, flat4, flat_mask, group_rows,
                               load_group_queries, no_sinks)
from ._kernel import call_any_layout, fetch_add, kernel

#: Query rows per work unit: enough units to balance two threads at small Nq, few enough to amortise the scratch.
ROW_CHUNK = 4


#: Positions of the driver's arguments read through flat4 (q, k, v, mask, out): compiled for any layout.
STRIDED = (0, 1, 2, 3, 8)


@kernel
def _unit(q, k, v, mask, slopes, sinks, scale, softcap, out, u):
    B, Hq, Nq, DK = q.shape
    Bk, Hkv, Nkv = k.shape[0], k.shape[1], k.shape[2]
    DV = v.shape[3]
    qf, qo, qst = flat4(q)
    kf, ko, kst = flat4(k)
    vf, vo, vst = flat4(v)
    of, oo, ost = flat4(out)
    mf, mo, mst, Bm, Hm = flat_mask(mask)
    G = Hq // Hkv
    n_row_chunks = (Nq + ROW_CHUNK - 1) // ROW_CHUNK
    row_chunk = u % n_row_chunks
    kvh = (u // n_row_chunks) % Hkv
    b = u // (n_row_chunks * Hkv)
    kb = b // (B // Bk)
    h0 = kvh * G
    qs = np.empty((G, DK), np.float32)
    sc = np.empty((G, ROWS), np.float32)
    rows = np.empty(ROWS, np.int64)
    M = np.empty(G, np.float32)
    S = np.empty(G, np.float32)
    A = np.empty(G * DV, np.float32)
    kbase = ko + kb * kst[0] + kvh * kst[1]
    vbase = vo + kb * vst[0] + kvh * vst[1]
    for i in range(row_chunk * ROW_CHUNK, min(Nq, (row_chunk + 1) * ROW_CHUNK)):
        load_group_queries(qf, qo + b * qst[0] + h0 * qst[1] + i * qst[2], qst[1], qst[3], qs)
        M[:] = -np.inf
        S[:] = 0.0
        A[:] = 0.0
        group_rows(qs, kf, kbase, kst[2], kst[3], vf, vbase, vst[2], vst[3], mf, mo + (b % Bm) * mst[0] + i * mst[2],
                   mst[1], mst[3], Hm, slopes, h0, scale, softcap, 0, Nkv, M, S, A, sc, rows, Nq == 1)
        for g in range(G):
            finalize(M[g], S[g], A, g * DV, DV, sinks[h0 + g], of, oo + b * ost[0] + i * ost[1] + (h0 + g) * ost[2],
                     ost[3])


@kernel
def _serial(q, k, v, mask, slopes, sinks, scale, softcap, out):
    n_units = q.shape[0] * k.shape[1] * ((q.shape[2] + ROW_CHUNK - 1) // ROW_CHUNK)
    for u in range(n_units):
        _unit(q, k, v, mask, slopes, sinks, scale, softcap, out, u)


@kernel(parallel=True)
def _parallel(q, k, v, mask, slopes, sinks, scale, softcap, out, next_unit, n_threads):
    n_units = q.shape[0] * k.shape[1] * ((q.shape[2] + ROW_CHUNK - 1) // ROW_CHUNK)
    # one iteration per thread, each taking units from the shared counter: decode has few units (one per KV
    # head), and a static split leaves a thread whose core is busy elsewhere deciding the time
    for _ in prange(n_threads):
        u = fetch_add(next_unit)
        while u < n_units:
            _unit(q, k, v, mask, slopes, sinks, scale, softcap, out, u)
            u = fetch_add(next_unit)


def run_one_chunk(q, k, v, mask, slopes, sinks, scale, softcap, out) -> None:
    """Fill ``out`` (B, Nq, Hq, DV) float32 with attention over q (B, Hq, Nq, DK) float32, k/v kernel views
    (Bk, Hkv, Nkv, DK|DV), mask None or a kernel view (Bm, Hm, Nm, Nkv), slopes (Hq,) float32, sinks None or
    (Hq,) float32; scale and softcap Python floats (softcap 0 = off). Every input may be strided."""
    B, Hq, Nq, DK = q.shape
    Hkv, Nkv = k.shape[1], k.shape[2]
    DV = v.shape[3]
    if sinks is None:
        sinks = no_sinks(Hq)
    sinks = np.ascontiguousarray(sinks)  # Hq floats: contiguous keeps one specialisation
    # Each query row streams the whole K and V of its KV head (from cache after the first rows).
    nbytes = B * Nq * Hkv * Nkv * (DK * k.itemsize + DV * v.itemsize)
    n_threads = _threads.threads_for(nbytes)
    args = (element_strides(q), element_strides(k), element_strides(v),
            None if mask is None else element_strides(mask), slopes, sinks, np.float32(scale), np.float32(softcap),
            out)
    if n_threads > 1:
        call_any_layout(_parallel, STRIDED, *args, np.zeros(1, np.int64), n_threads)
    else:
        call_any_layout(_serial, STRIDED, *args)

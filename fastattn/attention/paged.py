"""Paged K/V caches read through a block table by the one_chunk and split_kv units.

A paged cache holds its rows in pages of ``P`` rows: the kernels take K and V as (num_pages, Hkv, P, D) views of
the pages (nothing gathered up front) and a ``Pages`` group saying where each sequence's rows are: logical row n of
sequence b is row n % P of page ``table[b, n // P]``, and its live rows are ``[starts[b], ends[b])`` (the
kernel's KV row j is logical row ``starts[b] + j``).

``paged_group_rows`` runs ``attention.group.group_rows`` over a KV range [j0, j1) of such a sequence on the same
blocks of ``ROWS`` rows (from j0) as over a contiguous cache, so the result is bit-identical to the contiguous
call's: a run of blocks lying in one page is read in place, one ``group_rows`` call for the run (its K/V base
moved so that its row j addresses the page's row); a block that crosses a page boundary (every block when P < ROWS
or P is no multiple of ROWS) is first copied row by row into the unit's scratch (``Copies``: one block of K and of
V, in L1) with the next block's rows prefetched, and ``group_rows`` runs on the copy. ``group_rows`` keeps the
online softmax state across the calls, so the calls together are its walk over [j0, j1).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .layout import FlatRows
from .rows import ROWS, prefetch_row
from .._core.kernel import call_unit, kernel


class Pages(NamedTuple):
    """A paged call's block table (B, max_pages) int64, page size ``size`` (rows) and each sequence's live logical
    rows [starts[b], ends[b]) (B,) int64."""
    table: np.ndarray
    size: int
    starts: np.ndarray
    ends: np.ndarray


class Copies(NamedTuple):
    """A unit's copy of one block of K rows and of V rows (ROWS rows of ``row_elements`` each, adjacent),
    of the K and V kernel views' element types."""
    k: np.ndarray
    v: np.ndarray


def pages_of(table: np.ndarray, size: int, starts, ends) -> Pages:
    """The ``Pages`` group of a block table (int32 or int64) and the live rows of each sequence."""
    return Pages(np.ascontiguousarray(table, np.int64), np.int64(size), np.ascontiguousarray(starts, np.int64),
                 np.ascontiguousarray(ends, np.int64))


@kernel
def copies_for(kf, k_row, vf, v_row):
    """A unit's ``Copies`` for K rows of ``k_row`` elements of flat K ``kf``, and the same for V."""
    return Copies(np.empty(ROWS * k_row, kf.dtype), np.empty(ROWS * v_row, vf.dtype))


@kernel
def _copy_block(rows_at, page_stride, table, size, first, n, copy):
    """Copy the n rows from logical row ``first`` (``rows_at``: page 0's rows, pages ``page_stride`` apart) into
    ``copy``, adjacent; prefetch the n rows after them."""
    f, base, rs, cs = rows_at.flat, rows_at.base, rows_at.row_stride, rows_at.column_stride
    length = copy.shape[0] // ROWS
    step = 64 // f.itemsize
    lines = -(-length // step) if cs == 1 else 0
    page = first // size
    row = first % size  # the row's place in its page, and the same for the row ROWS further on
    ahead_page = (first + ROWS) // size
    ahead_row = (first + ROWS) % size
    for r in range(n):
        src = base + table[page] * page_stride + row * rs
        dst = np.uint64(r * length)
        if cs == 1:  # unsigned offsets: the copy vectorises (a signed index's wrap check stops it)
            at = np.uint64(src)
            for c in range(length):
                copy[dst + np.uint64(c)] = f[at + np.uint64(c)]
        else:
            for c in range(length):
                copy[dst + np.uint64(c)] = f[src + c * cs]
        if ahead_page < table.shape[0]:
            prefetch_row(f, base + table[ahead_page] * page_stride + ahead_row * rs, lines, step)
        row += 1
        if row == size:
            row = 0
            page += 1
        ahead_row += 1
        if ahead_row == size:
            ahead_row = 0
            ahead_page += 1


@kernel
def _run_in_place(group_rows, args, page, shift, page_strides, jr0, jr1):
    """``group_rows`` over KV rows [jr0, jr1), all in page ``page`` as its rows j + ``shift``: K/V read in
    place."""
    qs, k_rows, v_rows, mf, mask_at, logits, h0, _, _, state, scratch, streaming = args
    k_at = FlatRows(k_rows.flat, k_rows.base + page * page_strides[0] + shift * k_rows.row_stride,
                    k_rows.row_stride, k_rows.column_stride)
    v_at = FlatRows(v_rows.flat, v_rows.base + page * page_strides[1] + shift * v_rows.row_stride,
                    v_rows.row_stride, v_rows.column_stride)
    call_unit(group_rows, (qs, k_at, v_at, mf, mask_at, logits, h0, jr0, jr1, state, scratch, streaming))


@kernel
def paged_group_rows(group_rows, args, pages, b, page_strides, copies):
    """``call_unit(group_rows, args)`` (``args``: ``group_rows``' arguments, its ``k_rows`` / ``v_rows`` page 0's
    rows of the unit's KV head) over sequence b's pages, ``page_strides`` (K, V) elements apart (module
    docstring)."""
    qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch, streaming = args
    size = pages.size
    start = pages.starts[b]
    table = pages.table[b]
    run0 = j0  # the first block of the run of blocks in one page not walked yet
    in_run = False
    jb = j0
    while jb < j1:
        n = min(ROWS, j1 - jb)
        first = (start + jb) // size
        if first == (start + jb + n - 1) // size:
            if not in_run:
                run0 = jb
                in_run = True
            # the run ends with the range or before a next block not wholly in this page
            if jb + n == j1 or (start + min(j1, jb + n + ROWS) - 1) // size != first:
                _run_in_place(group_rows, args, table[first], start - first * size, page_strides, run0, jb + n)
                in_run = False
        else:  # no run is open here: it ended before this block
            _copy_block(k_rows, page_strides[0], table, size, start + jb, n, copies.k)
            _copy_block(v_rows, page_strides[1], table, size, start + jb, n, copies.v)
            k_len = copies.k.shape[0] // ROWS
            v_len = copies.v.shape[0] // ROWS
            # the copy's row r is KV row jb + r
            k_at = FlatRows(copies.k, -jb * k_len, k_len, np.int64(1))
            v_at = FlatRows(copies.v, -jb * v_len, v_len, np.int64(1))
            call_unit(group_rows, (qs, k_at, v_at, mf, mask_at, logits, h0, jb, jb + n, state, scratch,
                                   streaming))
        jb += ROWS

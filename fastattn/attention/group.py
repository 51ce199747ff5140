"""The inner loop shared by the one_chunk and split_kv attention paths: one query row, one GQA group, a KV range.

Both paths reduce to the same piece of work: for one query row and one KV head, run the online softmax of all
``G = Hq // Hkv`` query heads of that KV head's group over KV rows ``[j0, j1)``, keeping per head a running max
``M``, a running sum ``S`` and the unnormalised output ``A = sum_j exp(s_j - M) v_j``. Every K and V row is read
once and serves the whole group (GQA reuse: decode attention is memory-bound, so the group's heads must share
each row's read).

The KV range is walked in blocks of ``ROWS`` rows (a block of K and V stays in L1 while every head uses it).
Each block's mask entries are read once first (``_mask_block_kind``): a block whose mask is ``-inf`` for every
head of the group (outside a sliding window, a padded batch entry's unused keys) is skipped, its K/V rows never
read, and a block whose mask is all 0 is scored as if there were no mask, so a call costs what the mask lets
through. Skipping changes nothing: a hidden block's scores are all ``-inf`` (no new max, weights 0), and adding a
0 mask term leaves a logit as it is. The blocks then take four steps:

1. mask terms ``slope_h * mask[.., h % Hm, i, j]`` go into the score scratch, ``-inf`` wherever the mask is
   ``-inf`` (a hidden key, whatever the slope); without a mask the logits are written straight in, and the row
   lists of steps 2 and 4 are all rows;
2. scores: the group's heads in register blocks of 4 (the rest one by one) against pairs of K rows: one pass over
   two rows feeds 8 dot products, float16/bfloat16 widened in registers. Rows whose mask is ``-inf``
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

The pieces live by job: ``attention.rows`` (the register-block dot products and V updates), ``attention.softmax``
(mask terms, block weights, finalize), ``attention.nonfinite`` (V rows holding inf/NaN under per-head masks),
``attention.stream`` (float32 decode with K and V read side by side), ``attention.layout`` (flat views) and
``attention.quantized`` (Q8_0 / Q4_0 K/V: read in place, each block widened in registers by the row
intrinsics).
"""
from __future__ import annotations

import inspect
from typing import NamedTuple

import numpy as np
from numba import types
from numba.np import numpy_support

from .layout import FlatRows, MaskAt
from .nonfinite import sanitised_rows
from .quantized import row_elements, row_scratch, v_block_rows
from .rows import ROWS, axpy1, axpy4, axpy4x2, axpy4x4, dot1, dot4, dot4x2, prefetch_row
from .softmax import NEG_INF, Logits, block_mask, block_weights, live_rows, mask_terms, store_score
from .stream import stream_if_float32, stream_rows
from .._core.kernel import FLOAT32, kernel, unit_address

#: Software prefetch distances: K rows this many bytes ahead of the rows being scored, V rows this many (at
#: least the next block). With cold K/V the arithmetic of a block left too few misses in flight for the hardware
#: prefetchers alone (decode Nkv 4096 float32, 1 thread: 5.0 -> 3.0-3.8 ms); the prefetches are spread over the
#: dot products (a few per row pair), not issued as a burst per block, which had made the loop 15-30% slower.
PREFETCH_K = 32768
PREFETCH_V = 16384


class SoftmaxState(NamedTuple):
    """A group's online softmax, float32: per head the running max ``M`` and sum ``S`` (G,), and the
    unnormalised output ``A`` (G * DV,), head after head."""
    M: np.ndarray
    S: np.ndarray
    A: np.ndarray


class BlockScratch(NamedTuple):
    """A block's working arrays: ``scores`` (G, ROWS) float32 (scores, then weights) and ``rows`` (ROWS,) int64
    (the rows a register block of heads needs)."""
    scores: np.ndarray
    rows: np.ndarray


@kernel
def load_group_queries(qf, qbase, qhs, qcs, qs):
    """qs[g] = the query row at flat offset qbase + g * qhs (column stride qcs), for the G heads of a group."""
    for g in range(qs.shape[0]):
        row = qbase + g * qhs
        for d in range(qs.shape[1]):
            qs[g, d] = qf[row + d * qcs]


@kernel(inline=True)
def _block_scores_of_group(qs, k_rows, v_rows, sc, rows, jb, n, terms, logits, ahead):
    """Step 2 of ``group_rows`` for the block of rows jb .. jb+n: the group's scores in ``sc``, its heads in
    register blocks of 4 against pairs of K rows (K read in place; quantized rows widened in registers by the dot
    products, ``attention.quantized``), added to the mask terms already there unless ``terms`` is False. The
    first head block's dot products are interleaved with software prefetches of the K and V rows ``ahead`` =
    (K rows ahead, K lines per row, K elements per line, and the same for V) further on."""
    G = qs.shape[0]
    kf, kbase, krs, kcs = k_rows.flat, k_rows.base, k_rows.row_stride, k_rows.column_stride
    vq, vbase_q, vrs_q = v_rows.flat, v_rows.base, v_rows.row_stride
    scale, softcap = logits.scale, logits.softcap
    k_ahead, k_lines, k_step, v_ahead, v_lines, v_step = ahead
    # g not a literal 0: store_score, compiled once, would compile again for it
    g = np.int64(0)
    while g < G:
        width = 4 if G - g >= 4 else 1
        n_live = live_rows(sc, g, width, n, not terms, NEG_INF, rows)
        if width == 4:
            x = 0
            while x + 1 < n_live:
                r1 = rows[x]
                r2 = rows[x + 1]
                if g == 0:
                    # spread over the first head block's dot products (see PREFETCH_K)
                    prefetch_row(kf, kbase + (jb + k_ahead + r1) * krs, k_lines, k_step)
                    prefetch_row(kf, kbase + (jb + k_ahead + r2) * krs, k_lines, k_step)
                    prefetch_row(vq, vbase_q + (jb + v_ahead + r1) * vrs_q, v_lines, v_step)
                    prefetch_row(vq, vbase_q + (jb + v_ahead + r2) * vrs_q, v_lines, v_step)
                s0, s1, s2, s3, t0, t1, t2, t3 = dot4x2(qs, g, kf, kbase + (jb + r1) * krs,
                                                         kbase + (jb + r2) * krs, kcs)
                store_score(sc, g, r1, s0, scale, softcap, not terms)
                store_score(sc, g + 1, r1, s1, scale, softcap, not terms)
                store_score(sc, g + 2, r1, s2, scale, softcap, not terms)
                store_score(sc, g + 3, r1, s3, scale, softcap, not terms)
                store_score(sc, g, r2, t0, scale, softcap, not terms)
                store_score(sc, g + 1, r2, t1, scale, softcap, not terms)
                store_score(sc, g + 2, r2, t2, scale, softcap, not terms)
                store_score(sc, g + 3, r2, t3, scale, softcap, not terms)
                x += 2
            if x < n_live:
                r1 = rows[x]
                s0, s1, s2, s3 = dot4(qs, g, kf, kbase + (jb + r1) * krs, kcs)
                store_score(sc, g, r1, s0, scale, softcap, not terms)
                store_score(sc, g + 1, r1, s1, scale, softcap, not terms)
                store_score(sc, g + 2, r1, s2, scale, softcap, not terms)
                store_score(sc, g + 3, r1, s3, scale, softcap, not terms)
        else:
            for x in range(n_live):
                r1 = rows[x]
                if g == 0:
                    prefetch_row(kf, kbase + (jb + k_ahead + r1) * krs, k_lines, k_step)
                    prefetch_row(vq, vbase_q + (jb + v_ahead + r1) * vrs_q, v_lines, v_step)
                store_score(sc, g, r1, dot1(qs, g, kf, kbase + (jb + r1) * krs, kcs), scale, softcap, not terms)
        g += width


@kernel(inline=True)
def _block_values_of_group(A, sc, rows, n, jb, v_block, DV, unmasked, per_head, per_head_mask):
    """Step 4 of ``group_rows``: A += p v for the block's rows jb .. jb+n, the group's heads in blocks of 4 (V
    rows by fours, then pairs, then one) or one by one. ``v_block``: the V rows as read (``FlatRows``: in place,
    or a quantized block widened for a per-head mask); ``unmasked``: no mask at all; under a per-head mask, rows
    some head of a block weighs 0 are kept off non-finite V rows (``sanitised_rows``)."""
    G = A.shape[0] // DV
    vf, vbase, vrs, vcs = v_block.flat, v_block.base, v_block.row_stride, v_block.column_stride
    g = np.int64(0)
    while g < G:
        width = 4 if G - g >= 4 else 1
        n_live = live_rows(sc, g, width, n, unmasked, np.float32(0.0), rows)
        src = vf  # the V rows: vf, or a copy of the block without non-finite rows some head weighs 0
        sb = vbase + jb * vrs
        srs = vrs
        scs = vcs
        if width == 4 and per_head:
            src, sb, srs, scs = sanitised_rows(per_head_mask, A, DV, sc, g, rows, n_live, n, vf, sb, vrs, vcs)
        if width == 4:
            x = 0
            while x + 3 < n_live:
                r1 = rows[x]
                r2 = rows[x + 1]
                r3 = rows[x + 2]
                r4 = rows[x + 3]
                axpy4x4(A, g * DV, DV, sc, g, (r1, r2, r3, r4), src,
                        (sb + r1 * srs, sb + r2 * srs, sb + r3 * srs, sb + r4 * srs), scs)
                x += 4
            while x + 1 < n_live:
                r1 = rows[x]
                r2 = rows[x + 1]
                axpy4x2(A, g * DV, DV, sc, g, (r1, r2), src, (sb + r1 * srs, sb + r2 * srs), scs)
                x += 2
            if x < n_live:
                r1 = rows[x]
                axpy4(A, g * DV, DV, sc, g, r1, src, sb + r1 * srs, scs)
        else:
            for x in range(n_live):
                r1 = rows[x]
                axpy1(A, g * DV, DV, sc[g, r1], src, sb + r1 * srs, scs)
        g += width


@kernel
def group_rows(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch, streaming):
    """Online softmax of a GQA group's heads over KV rows [j0, j1), updating ``state`` in place.

    ``qs`` (G, DK): the group's query rows (query heads h0 .. h0+G). ``k_rows``, ``v_rows``: the K and V rows
    (``attention.layout.FlatRows``). ``mf``: the flat mask (None: no mask; not in a group: a None argument prunes
    the mask code while typing, a None read from a tuple would not), read at ``mask_at``
    (``attention.layout.MaskAt``). ``logits``: ``attention.softmax.Logits``. ``state``: ``SoftmaxState``;
    ``scratch``: ``BlockScratch``. ``streaming``: the rows are read this once (decode), not again for other query
    rows: float32 K/V then take ``stream_rows``.
    """
    kq, kcs_q = k_rows.flat, k_rows.column_stride  # as stored (quantized K/V: bytes, see attention.quantized)
    vq, vcs_q = v_rows.flat, v_rows.column_stride
    Hm, per_head_mask = mask_at.n_heads, mask_at.per_head
    A = state.A
    sc, rows = scratch.scores, scratch.rows
    if streaming and stream_if_float32(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch):
        return
    G = qs.shape[0]
    DK = qs.shape[1]
    DV = A.shape[0] // G
    # a per-head mask can hide a row from some heads of a register block and not others ("mixed" rows)
    per_head = mf is not None and Hm > 1
    # software prefetch of rows adjacent in memory (column stride 1) PREFETCH_K / _V bytes ahead, in the rows as
    # stored
    k_row = row_elements(kq, DK)
    v_row = row_elements(vq, DV)
    k_step = 64 // kq.itemsize
    v_step = 64 // vq.itemsize
    k_lines = -(-k_row // k_step) if kcs_q == 1 else 0
    v_lines = -(-v_row // v_step) if vcs_q == 1 else 0
    k_ahead = max(ROWS, PREFETCH_K // (k_row * kq.itemsize))
    v_ahead = max(ROWS, PREFETCH_V // (v_row * vq.itemsize))
    ahead = (k_ahead, k_lines, k_step, v_ahead, v_lines, v_step)
    # quantized V under a per-head mask: the block's rows widened to float32 (one L1-sized block)
    widened = row_scratch(vq, DV, per_head_mask)
    for jb in range(j0, j1, ROWS):
        n = min(ROWS, j1 - jb)
        # 0. the block's mask: hidden from every head (skipped, K/V not read), all 0 (no terms) or terms to add
        hidden, terms = block_mask(mf, mask_at, h0, G, jb, n)
        if hidden:
            continue
        # 1. mask terms (the scores start from them; without terms the scores are assigned, not added)
        if terms:
            mask_terms(sc, n, mf, mask_at, logits.slopes, h0, jb)
        # 2. scores, the group's heads in register blocks against pairs of K rows
        _block_scores_of_group(qs, k_rows, v_rows, sc, rows, jb, n, terms, logits, ahead)
        # 3. per head: rescale to the new max, turn scores into weights
        block_weights(sc, n, state.M, state.S, A)
        # V read in place, or quantized rows some head weighs widened for a per-head mask (_attention_quantized)
        v_block = v_block_rows(v_rows, DV, jb, sc, n, mf is None, rows, widened, per_head_mask)
        # 4. A += p v, same head blocks, V rows by fours then pairs
        _block_values_of_group(A, sc, rows, n, jb, v_block, DV, mf is None, per_head, per_head_mask)


_F32_ROW = types.Array(types.float32, 1, "C")
_F32_BLOCK = types.Array(types.float32, 2, "C")
_I64_ROW = types.Array(types.int64, 1, "C")
_handles: dict = {}


def _group_type(group, **field_types):
    """The Numba type of parameter group ``group`` (a NamedTuple class) with its fields of ``field_types``."""
    if set(field_types) != set(group._fields):
        raise TypeError(f"{group.__name__} has the fields {group._fields}, got {tuple(field_types)}")
    return types.BaseTuple.from_types([field_types[name] for name in group._fields], group)


def _rows_types(k_dtype: np.dtype, v_dtype: np.dtype, mask_dtype: np.dtype | None, per_head: bool | None) -> tuple:
    """The types of the arguments the one_chunk and split_kv units pass ``group_rows``, in its parameters' order."""
    def rows(dtype):
        return _group_type(FlatRows, flat=types.Array(numpy_support.from_dtype(dtype), 1, "C"), base=types.int64,
                           row_stride=types.int64, column_stride=types.int64)
    by_name = dict(
        qs=_F32_BLOCK, k_rows=rows(k_dtype), v_rows=rows(v_dtype),
        # flat_mask's array: none without a mask, else optional (its two returns unified)
        mf=types.none if mask_dtype is None else types.Optional(
            types.Array(numpy_support.from_dtype(mask_dtype), 1, "C")),
        mask_at=_group_type(MaskAt, base=types.int64, head_stride=types.int64, column_stride=types.int64,
                            n_heads=types.int64, per_head=types.none if per_head is None else types.boolean),
        logits=_group_type(Logits, scale=types.float32, softcap=types.float32, slopes=_F32_ROW),
        h0=types.int64, j0=types.int64, j1=types.int64,
        state=_group_type(SoftmaxState, M=_F32_ROW, S=_F32_ROW, A=_F32_ROW),
        scratch=_group_type(BlockScratch, scores=_F32_BLOCK, rows=_I64_ROW),
        streaming=types.boolean)
    return tuple(by_name[name] for name in inspect.signature(group_rows.py_func).parameters)


@kernel
def stream_group_rows(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch, streaming):
    """``group_rows`` for a call of one query row over float32 K/V: ``stream_rows`` alone, which is what
    ``group_rows`` runs for such a row, without compiling ``group_rows``' other loops (seconds of a first float32
    decode call)."""
    stream_rows(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch)


def group_rows_handle(k_dtype: np.dtype, v_dtype: np.dtype, mask_dtype: np.dtype | None,
                      per_head: bool | None, one_query_row: bool = False) -> np.ndarray:
    """``group_rows``' address (``_core.kernel.unit_address``) for the argument types the one_chunk and split_kv units
    pass it: K/V and mask kernel-view dtypes (``mask_dtype`` None: no mask), ``per_head`` None or True as the
    units' ``per_head``. The units call it by address: linked into each unit, its code would be optimised and
    emitted again for each (about 2 s per unit and dtype combination). ``one_query_row`` with float32 K/V:
    ``stream_group_rows``' address instead (the same results: the code ``group_rows`` runs for such calls)."""
    streaming = one_query_row and k_dtype == FLOAT32 and v_dtype == FLOAT32
    key = (k_dtype, v_dtype, mask_dtype, per_head, streaming)
    handle = _handles.get(key)
    if handle is None:
        handle = _handles[key] = unit_address(stream_group_rows if streaming else group_rows,
                                              _rows_types(k_dtype, v_dtype, mask_dtype, per_head))
    return handle

"""The ``tiled`` attention path (prefill): FlashAttention's tiling on the CPU, as ggml's ``..._tiled`` does.

Work is cut into tasks (batch b, KV head g, block of query heads, Q tile). A task holds the Q rows of up to
``HEADS_PER_TASK`` query heads of one GQA group, ``Q_TILE`` rows each, and walks the KV rows ``KV_TILE`` at a time:

    every mask block is classified once per call (``_classify_mask_blocks``): all -inf / all 0 / other, and the
    range [lo, hi) of KV rows with a live entry
    for each KV tile of the task:
        heads whose mask block is all -inf skip the tile (causal prefill: about half the tiles); if all do,
        nothing is read
        widen (or dequantize: _attention_quantized.widen_rows) the K and V tiles to float32 scratch once, for
        every head of the task
        for each live head, over the live KV rows lo .. hi only:
            Sᵀ = K_tile · Q_hᵀ                      R x 16 register-blocked block products
            s  = scale·S, softcap·tanh(s/softcap), + slope·mask        (the reference's order)
                 (-inf where the mask is -inf, whatever K holds or the slope is: a hidden key is not read)
            M' = max(M, max_j s);  P = exp(s - M');  L = L·exp(M - M') + Σ P;  O = O·exp(M - M') + P·V
                 (a V tile with an inf or NaN row, under a mask block that adds: P·V without its zero weights)
    sinks join L at the end; out = O / L, or 0 for a row whose every score (and sink) is -inf.

Layout of a thread slot's float32 scratch (C-contiguous; cols = heads·Q_TILE, head after head):

    qt  (DK, cols)            the task's Q rows transposed (Q is never rounded to float16)
    ks  (KV_TILE↑R, DK)       K tile;  vs (KV_TILE, DV↑16): V tile, padding columns zero
    st  (KV_TILE↑R, cols)     scores, then probabilities, transposed: a KV row is contiguous over the queries,
                              so the softmax runs along contiguous vectors of a compile-time length (Q_TILE)
    mt  (KV_TILE, Q_TILE)     a mask block that needs adding, transposed like st
    o   (cols, DV↑16)         unnormalised output rows;  m, l, alpha, tile_max (cols,): softmax state

Both products are C[R, 16] (+)= A[R, :k] B[:k, 16] with B row-major, R = BLOCK_ROWS (16 on AVX-512, 6 on
AVX2): ``block_scores`` (ks · qt) and ``block_values`` (stᵀ · vs, with O's rescale by alpha folded into the
load of C), register-blocked intrinsics in ``attention.tiled_products``. Numba's own loops cannot hold vector
accumulators across an outer loop, and BLAS (``np.dot``) called from every prange thread contends for OpenBLAS's
own thread pool.

Threads: one prange iteration per thread slot, each slot owning its scratch; the slots take tasks one at a time
from a shared atomic counter, heaviest first (under a causal mask the last Q tiles see the most keys). A task's
result never depends on the slot that runs it, so the output is bit-identical for any thread count.
docs/attention_tiled.md has the measurements.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import prange, types

from .._core import threads as _threads
from .tiled_products import (BLOCK_COLS, BLOCK_ROWS, block_scores, block_values, exp_pass, fma_f32,
                             values_skipping_zeros)
from .quantized import widen_rows
from .softmax import Logits
from .._core.kernel import (argument_positions, assume_contiguous, call_any_layout, call_unit, fast_exp, fetch_add,
                             kernel, to_f32, work_unit)

#: Query rows of one head per tile (a multiple of the register blocks' dimensions: 6 or 16 rows, 16 columns).
Q_TILE = 48
#: Key/value rows per tile.
KV_TILE = 64
#: At most this many query heads of a GQA group share one task (and one widened K/V tile): more would push the
#: task's Q, S and O scratch out of L2.
HEADS_PER_TASK = 4

assert Q_TILE % BLOCK_ROWS == 0 and Q_TILE % BLOCK_COLS == 0, "a Q tile is whole register blocks both ways"

#: Work estimate for ``threads_for``: prefill is compute-bound, so FLOPs count as bytes at the ratio of this
#: machine's DRAM bandwidth to its attainable FLOP rate (~10 GB/s : ~40 GFLOP/s).
BYTES_PER_FLOP = 0.25

_NEG_INF = np.float32(-np.inf)
_INF = np.float32(np.inf)


MASK_SKIP, MASK_ZERO, MASK_ADD = 0, 1, 2  # a mask block: all -inf / all 0 / anything else


class TileMask(NamedTuple):
    """The mask as the tiled kernels take it."""
    array: np.ndarray  # the kernel view (Bm, Hm, Nm, Nkv); a placeholder, never read, without a mask
    blocks: np.ndarray  # (Bm, Hm, Q tiles, KV tiles, 3) int64: each block's (kind, lo, hi) (_classify_mask_blocks)
    present: bool  # False: no mask


class TileScratch(NamedTuple):
    """The thread slots' scratch (module docstring), each array's first axis the slot."""
    qt: np.ndarray
    ks: np.ndarray
    vs: np.ndarray
    st: np.ndarray
    mt: np.ndarray
    o: np.ndarray
    m: np.ndarray
    l: np.ndarray
    alpha: np.ndarray
    tile_max: np.ndarray
    kinds: np.ndarray  # (slots, heads, 3) int64: per head the mask kind and live KV rows [lo, hi) of the KV tile


@kernel
def _scan_mask_row(seg, lo, hi, nonzero):
    """Fold one mask row into (lo, hi, nonzero): the live (not -inf) KV range and the count of entries not 0.
    Branch-free, so it vectorises on a contiguous row."""
    n = seg.shape[0]
    for jj in range(n):
        x = to_f32(seg[jj])
        live = x != _NEG_INF
        lo = min(lo, jj if live else n)
        hi = max(hi, jj + 1 if live else 0)
        nonzero += x != 0.0
    return lo, hi, nonzero


@kernel
def _classify_mask_blocks(mask, n_q, blocks):
    """blocks[bm, hm, q tile, KV tile] = (kind, lo, hi) for every mask block: kind MASK_SKIP when every entry is
    -inf, MASK_ZERO when every entry is 0, else MASK_ADD; [lo, hi) bounds the KV rows with a live entry (rows
    outside it contribute exactly 0: the diagonal tiles of a causal mask are half dead). Done once per call, not
    once per KV head."""
    n_kv = mask.shape[3]
    for bm in range(mask.shape[0]):
        for hm in range(mask.shape[1]):
            plane = mask[bm, hm]
            for q_tile in range(blocks.shape[2]):
                i0 = q_tile * Q_TILE
                nq = min(Q_TILE, n_q - i0)
                for kv_tile in range(blocks.shape[3]):
                    j0 = kv_tile * KV_TILE
                    nk = min(KV_TILE, n_kv - j0)
                    lo = nk
                    hi = np.int64(0)  # not literals: a literal argument compiles _scan_mask_row once more
                    nonzero = np.int64(0)
                    for ii in range(nq):
                        seg = plane[i0 + ii][j0:j0 + nk]
                        if seg.strides[0] == seg.itemsize:
                            lo, hi, nonzero = _scan_mask_row(assume_contiguous(seg), lo, hi, nonzero)
                        else:
                            lo, hi, nonzero = _scan_mask_row(seg, lo, hi, nonzero)
                    info = blocks[bm, hm, q_tile, kv_tile]
                    info[0] = MASK_SKIP if hi == 0 else (MASK_ADD if nonzero else MASK_ZERO)
                    info[1] = lo
                    info[2] = hi


@kernel
def _copy_mask_block(plane, i0, nq, j0, nk, mt):
    """mt[jj, ii] = plane[i0 + ii, j0 + jj]: the mask block transposed like the scores."""
    for ii in range(nq):
        seg = plane[i0 + ii][j0:j0 + nk]
        for jj in range(nk):
            mt[jj, ii] = to_f32(seg[jj])


@kernel(inline=True)
def _start_task(q, qt, mt, m, l, o, b, h_first, n_heads, i0, nq):
    """A task's scratch before its first KV tile: the Q rows of its heads transposed into ``qt`` (padding columns
    of a short last Q tile zero, so their scores stay finite), the mask block's padding columns zero, and each
    column's running max -inf, sum 0 and output row 0."""
    DK = q.shape[3]
    n_cols = n_heads * Q_TILE
    for d in range(DK):
        qt[d, :n_cols] = 0.0
    for hh in range(n_heads):
        q_plane = q[b, h_first + hh]
        for ii in range(nq):
            src = q_plane[i0 + ii]
            c = hh * Q_TILE + ii
            for d in range(DK):
                qt[d, c] = src[d]
    for jj in range(mt.shape[0]):
        mt[jj, nq:] = 0.0
    for c in range(n_cols):
        m[c] = _NEG_INF
        l[c] = 0.0
        o[c, :] = 0.0


@kernel(inline=True)
def _logits(st, mt, t_max, lo, hi, c0, additive, slope, scale, softcap):
    """Rows lo .. hi of one head's scores in ``st`` (columns c0 .. c0 + Q_TILE) turned into logits in place:
    scaled, soft-capped when ``softcap`` is not 0, plus slope·mask from ``mt`` when the mask block is additive
    (a -inf entry hides its key: -inf whatever the score); ``t_max`` gets each column's max. Whole Q_TILE
    columns (padding columns of a short tile hold finite scores): loops of a compile-time trip count vectorise
    without a scalar remainder."""
    t_max[:] = _NEG_INF
    for jj in range(lo, hi):
        row = st[jj, c0:c0 + Q_TILE]
        if softcap != 0.0:
            for c in range(Q_TILE):
                row[c] = softcap * np.tanh(row[c] * scale / softcap)
            if not additive:
                for c in range(Q_TILE):
                    t_max[c] = max(t_max[c], row[c])
        if additive:
            m_row = mt[jj]
            # one FMA adds slope·mask to the rounded logit: at logits near 1e4 every extra rounding moves the
            # output by about 1e-3
            if softcap != 0.0:
                for c in range(Q_TILE):
                    mc = m_row[c]
                    x = _NEG_INF if mc == _NEG_INF else fma_f32(slope, mc, row[c])  # hidden: K not read
                    row[c] = x
                    t_max[c] = max(t_max[c], x)
            else:
                for c in range(Q_TILE):
                    mc = m_row[c]
                    x = _NEG_INF if mc == _NEG_INF else fma_f32(slope, mc, row[c] * scale)
                    row[c] = x
                    t_max[c] = max(t_max[c], x)
        elif softcap == 0.0:
            for c in range(Q_TILE):
                x = row[c] * scale
                row[c] = x
                t_max[c] = max(t_max[c], x)


@kernel(inline=True)
def _finish_task(out, m, l, o, sinks, has_sinks, b, h_first, n_heads, i0, nq):
    """The task's output rows: each column's values over its sum, the sink joining the denominator when there
    is one; a column with every score and the sink masked gives zeros, as the reference (a NaN score, skipped
    by the max, left l NaN: NaN out)."""
    DV = out.shape[3]
    for hh in range(n_heads):
        h = h_first + hh
        for ii in range(nq):
            c = hh * Q_TILE + ii
            m_row = m[c]
            l_row = l[c]
            acc = o[c]
            if has_sinks:
                sink = sinks[h]
                m_all = sink if (sink > m_row or sink != sink) else m_row  # a NaN sink: NaN out
                if m_all != _NEG_INF:
                    shrink = fast_exp(m_row - m_all)
                    for d in range(DV):
                        acc[d] *= shrink
                    l_row = l_row * shrink + fast_exp(sink - m_all)
                m_row = m_all
            dst = out[b, i0 + ii, h]
            if m_row == _NEG_INF and l_row == 0.0:
                for d in range(DV):
                    dst[d] = 0.0
            else:
                for d in range(DV):
                    dst[d] = acc[d] / l_row


@kernel
def _task(q, k, v, mask, logits, sinks, has_sinks, out, scratch, slot, position):
    """Task number ``position`` (``_task_of``: Q rows of a Q tile for a block of query heads of one KV head) on
    thread slot ``slot``'s scratch (``TileScratch``). ``mask``: ``TileMask``; ``logits``:
    ``attention.softmax.Logits``. The drivers' unit, called by address: the drivers hold no copy of its code."""
    B, Hq, Nq, DK = q.shape
    Bk, Hkv, Nkv, _ = k.shape
    group = Hq // Hkv
    b, g, head_block, q_tile = _task_of(position, B, Hkv, -(-group // HEADS_PER_TASK), -(-Nq // Q_TILE))
    h_first = g * group + head_block * HEADS_PER_TASK
    n_heads = min(HEADS_PER_TASK, group - head_block * HEADS_PER_TASK)
    i0 = q_tile * Q_TILE
    qt, ks, vs, st, mt = scratch.qt[slot], scratch.ks[slot], scratch.vs[slot], scratch.st[slot], scratch.mt[slot]
    o, m, l, alpha = scratch.o[slot], scratch.m[slot], scratch.l[slot], scratch.alpha[slot]
    tile_max, kinds = scratch.tile_max[slot], scratch.kinds[slot]
    dv_pad = vs.shape[1]
    nq = min(Q_TILE, Nq - i0)
    row_blocks = -(-nq // BLOCK_ROWS)
    bk = b // (B // Bk)
    bm = b % mask.array.shape[0]
    k_plane = k[bk, g]
    v_plane = v[bk, g]
    # a tile's weights are summed apart, then added to l: added one by one, every key rounded l at its own
    # magnitude (an output dominated by one key of value ~100 drifted ~5 ulp per 64-key tile)
    t_sum = np.empty(Q_TILE, np.float32)

    _start_task(q, qt, mt, m, l, o, b, h_first, n_heads, i0, nq)

    n_kv_tiles = -(-Nkv // KV_TILE)
    for kv_tile in range(n_kv_tiles):
        j0 = kv_tile * KV_TILE
        nk = min(KV_TILE, Nkv - j0)
        any_live = False
        for hh in range(n_heads):
            h = h_first + hh
            info = kinds[hh]
            if mask.present:  # a -inf entry hides its key whatever the slope (0 when ALiBi's underflows)
                # element by element: an array-to-array slice assignment compiles NumPy's shape-error message
                # formatting (about a second of a first call)
                for x in range(3):
                    info[x] = mask.blocks[bm, h % mask.array.shape[1], q_tile, kv_tile, x]
            else:
                info[0] = MASK_ZERO
                info[1] = 0
                info[2] = nk
            any_live = any_live or info[0] != MASK_SKIP
        if not any_live:
            continue

        # Widen the K and V tiles once for every head of the task; note a non-finite V row.
        widen_rows(k_plane, j0, nk, ks)
        v_finite = not widen_rows(v_plane, j0, nk, vs)

        loaded_plane = -1  # the mask plane whose block is in mt (one for every head when the mask has one head)
        for hh in range(n_heads):
            kind, lo, hi = kinds[hh, 0], kinds[hh, 1], kinds[hh, 2]
            if kind == MASK_SKIP:
                continue
            h = h_first + hh
            c0 = hh * Q_TILE
            for rb in range(lo // BLOCK_ROWS, -(-hi // BLOCK_ROWS)):
                for cb in range(c0, c0 + Q_TILE, BLOCK_COLS):
                    block_scores(ks, qt, st, rb * BLOCK_ROWS, cb, DK)
            if kind == MASK_ADD and h % mask.array.shape[1] != loaded_plane:
                loaded_plane = h % mask.array.shape[1]
                _copy_mask_block(mask.array[bm, loaded_plane], i0, nq, j0, nk, mt)
            # Softmax over whole Q_TILE columns (padding columns of a short tile hold finite scores): loops of
            # a compile-time trip count vectorise without a scalar remainder.
            t_max = tile_max[c0:c0 + Q_TILE]
            _logits(st, mt, t_max, lo, hi, c0, kind == MASK_ADD, logits.slopes[h], logits.scale, logits.softcap)
            m_h = m[c0:c0 + Q_TILE]
            l_h = l[c0:c0 + Q_TILE]
            a_h = alpha[c0:c0 + Q_TILE]
            for c in range(Q_TILE):
                m_new = max(m_h[c], t_max[c])
                live = m_new != _NEG_INF
                a_h[c] = fast_exp(m_h[c] - m_new) if live else np.float32(1.0)  # 0 when m was -inf
                t_max[c] = m_new if live else np.float32(0.0)  # the shift: exp(-inf - 0) = 0 for a dead row
                m_h[c] = m_new
                l_h[c] *= a_h[c]
            t_sum[:] = 0.0
            exp_pass(st, lo, hi, c0, t_max, t_sum)
            for c in range(Q_TILE):
                l_h[c] += t_sum[c]
            if kind == MASK_ADD and not v_finite:  # hidden keys weigh 0: keep them off a NaN V row
                values_skipping_zeros(st, vs, o, alpha, c0, c0 + row_blocks * BLOCK_ROWS, lo, hi)
                continue
            st_live = st[lo:]
            vs_live = vs[lo:]
            for rb in range(row_blocks):
                for cb in range(0, dv_pad, BLOCK_COLS):
                    block_values(st_live, vs_live, o, alpha, c0 + rb * BLOCK_ROWS, cb, hi - lo)

    _finish_task(out, m, l, o, sinks, has_sinks, b, h_first, n_heads, i0, nq)


@kernel
def _task_of(position, B, Hkv, n_head_blocks, n_q_tiles):
    """(b, g, head block, Q tile) of task ``position``: Q tiles last to first, so the heaviest causal tiles are
    taken first (and the light ones fill the ends)."""
    per_tile = B * Hkv * n_head_blocks
    q_tile = n_q_tiles - 1 - position // per_tile
    rest = position % per_tile
    head_block = rest % n_head_blocks
    rest //= n_head_blocks
    return rest // Hkv, rest % Hkv, head_block, q_tile


@kernel
def _n_tasks(q, k):
    group = q.shape[1] // k.shape[1]
    return q.shape[0] * k.shape[1] * -(-group // HEADS_PER_TASK) * -(-q.shape[2] // Q_TILE)


@kernel
def _run_serial(unit, next_task, q, k, v, mask, logits, sinks, has_sinks, out, scratch):
    for position in range(_n_tasks(q, k)):
        call_unit(unit, (q, k, v, mask, logits, sinks, has_sinks, out, scratch, np.int64(0), np.int64(position)))


@kernel(parallel=True)
def _run_parallel(unit, next_task, q, k, v, mask, logits, sinks, has_sinks, out, scratch):
    """Each thread slot runs tasks on its own scratch until none is left, taking the next task number from the
    shared counter ``next_task`` (dynamic scheduling: a slot slowed down by another process simply runs fewer)."""
    n_tasks = _n_tasks(q, k)
    for slot in prange(scratch.qt.shape[0]):
        position = fetch_add(next_task)
        while position < n_tasks:
            call_unit(unit, (q, k, v, mask, logits, sinks, has_sinks, out, scratch, np.int64(slot), position))
            position = fetch_add(next_task)


_NO_MASK = np.zeros((1, 1, 1, 1), np.float32)
_NO_BLOCKS = np.zeros((1, 1, 1, 1, 3), np.int64)
_NO_SINKS = np.zeros(1, np.float32)
#: The drivers' unit (``_core.kernel.work_unit``): ``_task`` on the drivers' arguments of its parameters' names, a
#: thread slot and a task number.
UNIT = work_unit(_task, _run_serial, _run_parallel, extra=(types.int64, types.int64))
#: The drivers' arguments from the caller, typed any layout (the scratch after them stays C-contiguous).
_USER_ARGS = argument_positions(_run_serial, "next_task", "q", "k", "v", "mask", "logits", "sinks", "has_sinks",
                                "out")


def run_tiled(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, slopes: np.ndarray,
              sinks: np.ndarray | None, scale: float, softcap: float, out: np.ndarray) -> None:
    """Fill ``out`` (B, Nq, Hq, DV) float32 with attention computed tile by tile.

    q (B, Hq, Nq, DK) float32; k (Bk, Hkv, Nkv, DK), v (Bk, Hkv, Nkv, DV) kernel views (float32, uint16 float16
    bits, int16 bfloat16 bits, or the bytes of Q8_0 / Q4_0 rows: ``quant.bytes_view``); mask None or
    a (Bm, Hm, Nm >= Nq, Nkv) kernel view (float32 / uint16);
    slopes (Hq,) float32; sinks None or (Hq,) float32; every argument may be strided (nothing is copied).
    """
    B, Hq, Nq, DK = q.shape
    Bk, Hkv, Nkv, _ = k.shape
    DV = out.shape[3]
    group = Hq // Hkv
    n_tasks = B * Hkv * -(-group // HEADS_PER_TASK) * -(-Nq // Q_TILE)
    flops = 2.0 * B * Hq * Nq * Nkv * (DK + DV)
    nbytes = q.nbytes + k.nbytes + v.nbytes + out.nbytes + (0 if mask is None else mask[..., :Nq, :].nbytes)
    work = int(nbytes + BYTES_PER_FLOP * flops)
    n_threads = min(_threads.threads_for(work), n_tasks)
    with _threads.team("tiled", work, n_threads) as launch:
        _run_tiles(_run_parallel if launch.n > 1 else _run_serial, launch.n, q, k, v, mask, slopes, sinks, scale,
                   softcap, out)


def _run_tiles(run, n_slots: int, q, k, v, mask, slopes, sinks, scale: float, softcap: float, out) -> None:
    """``run`` (``_run_serial`` / ``_run_parallel``) with ``n_slots`` thread slots of scratch."""
    B, Hq, Nq, DK = q.shape
    Nkv = k.shape[2]
    DV = out.shape[3]
    heads = min(Hq // k.shape[1], HEADS_PER_TASK)
    dv_pad = -(-DV // BLOCK_COLS) * BLOCK_COLS
    kv_pad = -(-KV_TILE // BLOCK_ROWS) * BLOCK_ROWS
    cols = heads * Q_TILE
    # Zero-filled: padding (rows of ks past a short tile, columns of vs past DV) is read but must stay finite.
    qt = np.zeros((n_slots, DK, cols), np.float32)
    ks = np.zeros((n_slots, kv_pad, DK), np.float32)
    vs = np.zeros((n_slots, KV_TILE, dv_pad), np.float32)
    st = np.zeros((n_slots, kv_pad, cols), np.float32)
    mt = np.zeros((n_slots, KV_TILE, Q_TILE), np.float32)
    o = np.zeros((n_slots, cols, dv_pad), np.float32)
    m, l, alpha, tile_max = (np.zeros((n_slots, cols), np.float32) for _ in range(4))
    kinds = np.zeros((n_slots, heads, 3), np.int64)
    scratch = TileScratch(qt, ks, vs, st, mt, o, m, l, alpha, tile_max, kinds)
    if mask is not None:
        blocks = np.empty(mask.shape[:2] + (-(-Nq // Q_TILE), -(-Nkv // KV_TILE), 3), np.int64)
        call_any_layout(_classify_mask_blocks, range(3), mask, Nq, blocks)
        tile_mask = TileMask(mask, blocks, True)
    else:
        tile_mask = TileMask(_NO_MASK, _NO_BLOCKS, False)
    next_task = np.zeros(1, np.int64)  # the task counter the thread slots share
    args = (next_task, q, k, v, tile_mask, Logits(np.float32(scale), np.float32(softcap), slopes),
            _NO_SINKS if sinks is None else sinks, sinks is not None, out, scratch)
    call_any_layout(run, _USER_ARGS, *args, unit=UNIT)

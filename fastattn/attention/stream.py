"""``stream_rows``: the GQA group's online softmax for float32 K/V read once (decode), K and V side by side.

See ``stream_rows`` for the algorithm and ``attention.group`` for the block steps it shares. The column-slice V
update is an LLVM intrinsic (``_values_columns4`` / ``_values_columns1``) that keeps a 16-column slice of 4 heads'
accumulators in registers across the block's rows.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from .nonfinite import drop_mixed
from .rows import ROWS, axpy1, axpy4, dot1, dot4, prefetch_row, is_c
from .softmax import NEG_INF, block_mask, block_weights, live_rows, mask_terms, store_score
from .._core.kernel import kernel
from .._core.simd import KERNEL_DTYPES, V8, as_int64, const, fma, load8, loop, splat

#: ``stream_rows`` by column slices: V columns per ``_values_columns`` call (two 8-wide vectors per head), one
#: slice after every COLUMN_EVERY scored K rows, and K rows prefetched this many rows ahead of the row scored.
VALUE_COLUMNS = 16
COLUMN_EVERY = 4
STREAM_K_AHEAD = 64


@kernel(inline=True)
def _scores_of_row(qs, kf, o, kcs, sc, r, scale, softcap, unmasked):
    """sc[:, r] (+)= the logits of K row at flat offset o for every head of the group (heads by fours)."""
    G = qs.shape[0]
    g = 0
    while g + 4 <= G:
        s0, s1, s2, s3 = dot4(qs, g, kf, o, kcs)
        store_score(sc, g, r, s0, scale, softcap, unmasked)
        store_score(sc, g + 1, r, s1, scale, softcap, unmasked)
        store_score(sc, g + 2, r, s2, scale, softcap, unmasked)
        store_score(sc, g + 3, r, s3, scale, softcap, unmasked)
        g += 4
    while g < G:
        store_score(sc, g, r, dot1(qs, g, kf, o, kcs), scale, softcap, unmasked)
        g += 1


@kernel(inline=True)
def _values_of_row(A, DV, p, r, vf, o, vcs):
    """A[g] += p[g, r] V row at flat offset o for every head g of the group (heads by fours)."""
    G = p.shape[0]
    g = 0
    while g + 4 <= G:
        axpy4(A, g * DV, DV, p, g, r, vf, o, vcs)
        g += 4
    while g < G:
        axpy1(A, g * DV, DV, p[g, r], vf, o, vcs)
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

        def step(x, acc):
            r = builder.load(builder.gep(rows.data, [x]), align=8)
            row = builder.add(vbase, builder.add(builder.mul(r, vrs), c0))
            vv = [load8(builder, v_dtype, vf.data, builder.add(row, const(8 * v))) for v in range(2)]
            out = []
            for h in range(n_heads):
                w = splat(builder, builder.load(builder.gep(p_rows[h], [r]), align=4))
                out += [fma(builder, w, vv[v], acc[2 * h + v]) for v in range(2)]
            return out

        start = [builder.load(ptr, align=4) for ptr in a_ptrs]
        for acc, ptr in zip(loop(builder, const(0), n, const(1), start, step), a_ptrs):
            builder.store(acc, ptr, align=4)
        return context.get_dummy_value()

    return codegen


def _check_values_columns(A, p, rows, vf):
    if not (is_c(A, (types.float32,), 1) and is_c(p, (types.float32,), 2) and is_c(rows, (types.int64,), 1)
            and is_c(vf, KERNEL_DTYPES, 1)):
        raise TypingError("_values_columns: A 1-D C float32, p 2-D C float32, rows 1-D C int64, vf 1-D C float32 "
                          "or float16 / bfloat16 bits")


@intrinsic
def _values_columns4(typingctx, A, p, rows, vf, g, DV, n, vbase, vrs, c0):
    """For heads h = g .. g+3 and the 16 columns c0 .. c0+15: A[h*DV + c] += p[h, r] * V(vf[vbase + r*vrs + c])
    for r = rows[0], .., rows[n-1] in that order, one FMA per row (the roundings of ``axpy4`` row after row),
    the 8 accumulators held in registers across the rows: A is loaded and stored once per call. V(.) widens
    float16 / bfloat16 bits exactly (``_core.simd.load8``)."""
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
def stream_rows(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch):
    """``group_rows`` (same arguments) for float32 K/V read once (decode), with K and V read side by side.

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
      scored (added one block later) and the K row STREAM_K_AHEAD rows ahead; without those prefetches the slices
      read at a fraction of the row-by-row bandwidth (docs/attention.md);
    - row by row otherwise: one V row of block b per iteration added to every head's A (``axpy4``). Reading K
      and V rows side by side keeps more bandwidth than reading them block after block; row pairs were slower.
    """
    kf, kbase, krs, kcs = k_rows.flat, k_rows.base, k_rows.row_stride, k_rows.column_stride
    vf, vbase, vrs, vcs = v_rows.flat, v_rows.base, v_rows.row_stride, v_rows.column_stride
    scale, softcap = logits.scale, logits.softcap
    M, S, A = state.M, state.S, state.A
    sc, rows = scratch.scores, scratch.rows
    G = qs.shape[0]
    DV = A.shape[0] // G
    unmasked = mf is None
    per_head = mf is not None and mask_at.n_heads > 1  # mixed rows possible (see group_rows)
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
        # group_rows' step 0 (the final pass, n == 0, is never skipped: it adds the last block's V rows)
        hidden, terms = block_mask(mf, mask_at, h0, G, jb, n) if n > 0 else (False, False)
        if hidden:
            # skipped, its K/V rows not read. The pending V rows of the last block scored are added in the next
            # pass that runs, still before its softmax step, in the same order
            continue
        if terms:
            mask_terms(cur, n, mf, mask_at, logits.slopes, h0, jb)
        n_cur = live_rows(cur, 0, G, n, not terms, NEG_INF, cur_rows)
        if by_columns:
            done = 0  # column slices of the previous block's V rows added so far
            for x in range(n_cur):
                r = cur_rows[x]
                _scores_of_row(qs, kf, kbase + (jb + r) * krs, kcs, cur, r, scale, softcap, not terms)
                # this block's V row (added during the next block) and a K row STREAM_K_AHEAD rows on
                prefetch_row(vf, vbase + (jb + r) * vrs, v_lines, v_step)
                prefetch_row(kf, kbase + (jb + r + STREAM_K_AHEAD) * krs, k_lines, k_step)
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
                    _scores_of_row(qs, kf, kbase + (jb + r) * krs, kcs, cur, r, scale, softcap, not terms)
                if x < n_prev:
                    r = prev_rows[x]
                    _values_of_row(A, DV, prev, r, vf, vbase + (prev_jb + r) * vrs, vcs)
        block_weights(cur, n, M, S, A)
        n_prev = live_rows(cur, 0, G, n, unmasked, np.float32(0.0), cur_rows)
        if per_head:
            n_prev = drop_mixed(mask_at.per_head, A, DV, cur, cur_rows, n_prev, vf, vbase + jb * vrs, vrs, vcs)
        cur, prev = prev, cur
        cur_rows, prev_rows = prev_rows, cur_rows
        prev_jb = jb


def stream_if_float32(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch):
    """Run ``stream_rows`` and return True when K and V are float32; else return False. Chosen while typing, so
    float16/bfloat16 callers never compile ``stream_rows`` (seconds of a first decode call)."""
    raise NotImplementedError("compiled code only")


@overload(stream_if_float32, inline="always")
def _stream_if_float32(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch):
    if k_rows.types[0].dtype == types.float32 and v_rows.types[0].dtype == types.float32:
        def run(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch):
            stream_rows(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch)
            return True
    else:
        def run(qs, k_rows, v_rows, mf, mask_at, logits, h0, j0, j1, state, scratch):
            return False
    return run

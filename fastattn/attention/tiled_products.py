"""The tiled attention path's two register-blocked products and its softmax weights, as LLVM intrinsics (see
``attention.tiled``).

Both products are C[R, 16] (+)= A[R, :k] B[:k, 16] with B row-major (R = BLOCK_ROWS): ``block_scores`` (a K tile
times the Q tile transposed; the head dimension summed in runs of SCORE_CHUNK terms) and ``block_values``
(probabilitiesᵀ times a V tile, with the output's rescale by alpha folded into the load of C). Each keeps a
BLOCK_ROWS x 16 block of C in registers for the whole k loop, as sgemm kernels do. On AVX2, 6 x 16: twelve ymm
registers and twelve 8-wide FMAs per step against two B loads and six broadcasts. Where Numba's target has AVX-512
(``_core.simd.wide_lanes``), 16 x 16: sixteen zmm registers and sixteen 16-wide FMAs against one B load and sixteen
broadcasts; with six rows the six FMA chains could not cover the FMA's latency on two ports (prefill 2048 causal, 1
thread: 16 rows took 0.82x the time of 6, 8 rows 0.91x, 24 rows 0.86x). Each element of C takes the same FMAs in the
same order with any block.
``values_skipping_zeros`` is ``block_values`` without the zero weights, for V tiles holding inf or NaN.
``exp_pass`` turns a tile's scores into softmax weights (``fast_exp`` of score minus max) 16 lanes wide.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .._core.kernel import EXP_MAX, EXP_MIN, LN2_HI, LN2_LO, LOG2E, EXP_POLYNOMIAL, kernel
from .._core.simd import as_int64, const, fma, loop, splat, wide_lanes

#: The score product sums the head dimension in runs of this many terms, each in fresh accumulators, then adds
#: the runs. One FMA chain over all of DK had up to 2.6x the max score error of NumPy's float32 matmul at D 576
#: (0.54-0.69x in runs of 128); up to D 192 it had the matmul's error (OpenBLAS's sgemm sums in the same order).
#: Runs of 32 or 64 were more exact at D 128 but made prefill 2-5% slower.
SCORE_CHUNK = 128

#: register block of the products: BLOCK_ROWS rows x BLOCK_COLS columns of accumulators (12 ymm or 16 zmm)
BLOCK_ROWS = 16 if wide_lanes() == 16 else 6
BLOCK_COLS = 16


def _check_scratch(*arrays):
    for arr in arrays:
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.layout == "C"):
            raise TypingError("block product: every array must be a C-contiguous float32 array")


def _block_codegen(a_transposed: bool, scaled_accumulate: bool, k_chunk: int = 0):
    """LLVM IR for one BLOCK_ROWS x 16 block of C = A B (or C = alpha·C + A B), B row-major.

    A[r, kk] is a[i + r, kk] (row-major) or, with ``a_transposed``, a[kk, i + r]; B[kk, col] is b[kk, j + col];
    C[r, col] is c[i + r, j + col]; kk runs over 0 .. kdim. With ``scaled_accumulate`` the block of C is loaded,
    multiplied by alpha[i + r] and accumulated into. With ``k_chunk`` each run of k_chunk values of kk is summed
    in fresh accumulators, then added to the block's totals. Every array is a C-contiguous float32 scratch array.
    """
    n_arrays = 4 if scaled_accumulate else 3

    def codegen(context, builder, signature, llargs):
        arrs = [context.make_array(t)(context, builder, v)
                for t, v in zip(signature.args[:n_arrays], llargs[:n_arrays])]
        row0, col0, k = (as_int64(context, builder, v, t)
                         for v, t in zip(llargs[n_arrays:], signature.args[n_arrays:]))
        a, b, c = arrs[:3]
        lda, ldb, ldc = (builder.extract_value(arr.shape, 1) for arr in (a, b, c))
        # a row of the block in one 16-float vector or in two 8-float ones: the same FMAs for every element
        lanes = wide_lanes()
        parts = BLOCK_COLS // lanes
        vector = ir.VectorType(ir.FloatType(), lanes)
        vector_ptr = vector.as_pointer()
        rows = [builder.add(row0, const(r)) for r in range(BLOCK_ROWS)]
        if a_transposed:
            a_rows = [builder.gep(a.data, [r]) for r in rows]
        else:
            a_rows = [builder.gep(a.data, [builder.mul(r, lda)]) for r in rows]
        c_ptrs = [builder.bitcast(builder.gep(c.data, [builder.add(builder.mul(r, ldc),
                                                                    builder.add(col0, const(lanes * v)))]), vector_ptr)
                  for r in rows for v in range(parts)]  # C[r, lanes v : lanes (v + 1)] at parts r + v
        zero = ir.Constant(vector, [0.0] * lanes)
        if scaled_accumulate:
            start = []
            for r in range(BLOCK_ROWS):
                scale = splat(builder, builder.load(builder.gep(arrs[3].data, [rows[r]]), align=4), lanes)
                start.extend(builder.fmul(builder.load(p, align=4), scale)
                             for p in c_ptrs[parts * r:parts * r + parts])
        else:
            start = [zero] * (parts * BLOCK_ROWS)

        def step(kk, acc):
            b_row = builder.gep(b.data, [builder.add(builder.mul(kk, ldb), col0)])
            bv = [builder.load(builder.bitcast(builder.gep(b_row, [const(lanes * v)]), vector_ptr), align=4)
                  for v in range(parts)]
            a_offset = builder.mul(kk, lda) if a_transposed else kk
            out = []
            for r in range(BLOCK_ROWS):
                x = splat(builder, builder.load(builder.gep(a_rows[r], [a_offset]), align=4), lanes)
                out.extend(fma(builder, x, bv[v], acc[parts * r + v]) for v in range(parts))
            return out

        if k_chunk:
            # the first run straight into the totals (all of kk when kdim <= k_chunk: one FMA chain, as without
            # runs), each later run in fresh accumulators, then added
            first = builder.select(builder.icmp_signed("<", const(k_chunk), k), const(k_chunk), k)
            result = loop(builder, const(0), first, const(1), start, step)

            def chunk(k0, totals):
                k1 = builder.add(k0, const(k_chunk))
                k1 = builder.select(builder.icmp_signed("<", k1, k), k1, k)
                partial = loop(builder, k0, k1, const(1), [zero] * len(totals), step)
                return [builder.fadd(t, x) for t, x in zip(totals, partial)]

            result = loop(builder, first, k, const(k_chunk), result, chunk)
        else:
            result = loop(builder, const(0), k, const(1), start, step)
        for acc, ptr in zip(result, c_ptrs):
            builder.store(acc, ptr, align=4)
        return context.get_dummy_value()

    return codegen


@intrinsic
def block_scores(typingctx, ks, qt, st, i, j, kdim):
    """st[i:i+6, j:j+16] = ks[i:i+6, :kdim] @ qt[:kdim, j:j+16], in runs of SCORE_CHUNK values of kdim"""
    _check_scratch(ks, qt, st)
    return types.none(ks, qt, st, i, j, kdim), _block_codegen(a_transposed=False, scaled_accumulate=False,
                                                              k_chunk=SCORE_CHUNK)


@intrinsic
def block_values(typingctx, st, vs, o, alpha, i, j, kdim):
    """o[i:i+6, j:j+16] = alpha[i:i+6, None] * o[i:i+6, j:j+16] + st[:kdim, i:i+6].T @ vs[:kdim, j:j+16]"""
    _check_scratch(st, vs, o, alpha)
    return types.none(st, vs, o, alpha, i, j, kdim), _block_codegen(a_transposed=True, scaled_accumulate=True)


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a·b + c rounded once (``llvm.fma``: the FMA of the block products)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        raise TypingError("fma_f32: expected float32 arguments")

    def codegen(context, builder, signature, args):
        return fma(builder, *args)

    return types.float32(a, b, c), codegen


@kernel
def values_skipping_zeros(st, vs, o, alpha, c0, c1, lo, hi):
    """``block_values`` for columns c0 .. c1 of a head over KV rows lo .. hi, column by column, leaving out every
    (row, column) whose weight is 0: the same FMAs in the same order, minus those that add 0·v. For V tiles with
    a non-finite row, where that 0 may be a hidden key's weight and v NaN."""
    for c in range(c0, c1):
        a = alpha[c]
        oc = o[c]
        for d in range(oc.shape[0]):
            oc[d] = oc[d] * a
        for jj in range(lo, hi):
            p = st[jj, c]
            if p != 0.0:
                row = vs[jj]
                for d in range(oc.shape[0]):
                    oc[d] = fma_f32(p, row[d], oc[d])


def _exp_lanes(builder, x):
    """``_core.kernel.fast_exp`` lane by lane on the float vector ``x``: the same clamp, range reduction, polynomial and
    exponent bits, exactly 0 below the clamp (-inf), +inf above it, NaN for NaN."""
    vector = x.type
    lanes = vector.count
    i32s = ir.VectorType(ir.IntType(32), lanes)

    def c(value):
        return ir.Constant(vector, [float(value)] * lanes)

    below = builder.fcmp_ordered("<", x, c(EXP_MIN))
    above = builder.fcmp_ordered(">", x, c(EXP_MAX))
    xc = builder.select(below, c(EXP_MIN), builder.select(above, c(EXP_MAX), x))
    floor = builder.module.declare_intrinsic(f"llvm.floor.v{lanes}f32", (), ir.FunctionType(vector, [vector]))
    n = builder.call(floor, [fma(builder, xc, c(LOG2E), c(0.5))])
    r = fma(builder, n, c(-LN2_HI), xc)
    r = fma(builder, n, c(-LN2_LO), r)
    p = c(EXP_POLYNOMIAL[0])
    for coefficient in EXP_POLYNOMIAL[1:]:
        p = fma(builder, p, r, c(coefficient))
    p = builder.fadd(fma(builder, builder.fmul(p, r), r, r), c(1.0))
    n = builder.select(builder.fcmp_ordered("==", n, n), n, c(0.0))  # NaN: any exponent (p is NaN already)
    biased = builder.add(builder.fptosi(n, i32s), ir.Constant(i32s, [127] * lanes))
    y = builder.fmul(p, builder.bitcast(builder.shl(biased, ir.Constant(i32s, [23] * lanes)), vector))
    return builder.select(below, c(0.0), builder.select(above, c(float("inf")), y))


@intrinsic
def exp_pass(typingctx, st, lo, hi, c0, t_max, t_sum):
    """st[j, c0 + c] = fast_exp(st[j, c0 + c] - t_max[c]) for rows lo <= j < hi and c < len(t_max), and
    t_sum[c] += each, in row order: the softmax weights of a tile, in vectors of ``wide_lanes()`` floats (a Numba
    loop vectorises 8 wide on AVX-512), each t_sum[c] kept in a register across the rows."""
    _check_scratch(st, t_max, t_sum)
    if not all(isinstance(t, types.Integer) for t in (lo, hi, c0)):
        raise TypingError("exp_pass: expected integer rows and column")

    def codegen(context, builder, signature, args):
        st_a, tmax_a, tsum_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 4, 5))
        lo_i, hi_i, c0_i = (as_int64(context, builder, args[i], signature.args[i]) for i in (1, 2, 3))
        ld = builder.extract_value(st_a.shape, 1)
        width = builder.extract_value(tmax_a.shape, 0)

        def columns(lanes):
            vector = ir.VectorType(ir.FloatType(), lanes)
            ptr = vector.as_pointer()

            def column_step(col, _):
                t_m = builder.load(builder.bitcast(builder.gep(tmax_a.data, [col]), ptr), align=4)
                sum_ptr = builder.bitcast(builder.gep(tsum_a.data, [col]), ptr)
                at = builder.add(c0_i, col)

                def row_step(j, carried):
                    cell = builder.bitcast(builder.gep(st_a.data, [builder.add(builder.mul(j, ld), at)]), ptr)
                    w = _exp_lanes(builder, builder.fsub(builder.load(cell, align=4), t_m))
                    builder.store(w, cell, align=4)
                    return [builder.fadd(carried[0], w)]

                total = loop(builder, lo_i, hi_i, const(1), [builder.load(sum_ptr, align=4)], row_step)[0]
                builder.store(total, sum_ptr, align=4)
                return []
            return column_step

        lanes = wide_lanes()
        n_vector = builder.and_(width, const(-lanes))
        loop(builder, const(0), n_vector, const(lanes), [], columns(lanes))
        loop(builder, n_vector, width, const(1), [], columns(1))
        return context.get_dummy_value()

    return types.none(st, lo, hi, c0, t_max, t_sum), codegen

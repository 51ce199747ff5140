"""Register-block arithmetic over a block of KV rows for a GQA group's heads (see ``attention.group``).

Query heads go in blocks of 4 (the rest one by one). ``dot4x2`` scores two K rows for 4 heads in one pass over the
rows (8 sums); ``axpy4x4`` adds four weighted V rows to 4 heads' accumulators, loading and storing each accumulator
once per four rows (the per-row update is bound by its vector stores). They are intrinsics that emit their vector
loops themselves (``_core.simd``): a vector of columns at a time (float16 and bfloat16 rows: 16 where Numba's target has
AVX-512, else 8; float32 rows: 8, ``_row_lanes``) with one float vector accumulator per head and row,
float16/bfloat16 bits widened in registers (``load_lanes``), then the columns past the last whole vector one by one;
a column stride other than 1 takes the scalar loop for every column. Intrinsics rather than Numba loops inlined into
``group_rows``: an inlined loop is typed, inlined and vectorised again at each call site (about 4 s of each
``group_rows`` specialisation's compile), where an intrinsic hands LLVM straight vector code. A (head, row) score is
the same sum in every variant (the lanes reduced pairwise, then the scalar columns), so a row scores alike in
``dot4x2``, ``dot4`` and ``dot1``; the 8 or 4 accumulators of a call are reduced side by side
(``_core.simd.hsum_many``: about 3 instructions a sum instead of 8). Rows are addressed by flat offsets into 1-D C arrays
(``attention.layout``).

Quantized rows (Q8_0 as int8 bytes, Q4_0 as uint8, offsets in bytes) take a block loop instead
(``_quantized_dots``, ``_quantized_updates``): each block of 32 values is widened in registers and multiplied by
its float16 scale once for the heads of the call (d k, d v: the dequantized values), in vectors of 16 floats where
Numba's target has AVX-512 (``_core.simd.wide_lanes``).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ..quant.blocks import BLOCK as QUANT_BLOCK
from .._core.simd import (KERNEL_DTYPES, LANES, QUANT_DTYPES, as_int64, block_scale, block_values, const, fma,
                          hsum_many, load1, load_floats, load_lanes, loop, prefetch_line, splat, wide_lanes)
from ..quant.api import block_bytes_of

_I8P = ir.IntType(8).as_pointer()

#: KV rows per block: 32 rows of K and of V (8-16 KiB each at D 128) stay in L1 across the group's head blocks.
ROWS = 32


def is_c(arr, dtypes, ndim):
    """Whether ``arr`` is an ndim-D C-contiguous array of one of ``dtypes`` (typing of the intrinsics)."""
    return isinstance(arr, types.Array) and arr.dtype in dtypes and arr.ndim == ndim and arr.layout == "C"


def _check_rows(name, matrix, rows, offsets, stride):
    """``matrix``: qs or p (2-D C float32); ``rows``: K or V (1-D C, a kernel dtype or quantized bytes); integer
    offsets and stride."""
    if not (is_c(matrix, (types.float32,), 2) and is_c(rows, KERNEL_DTYPES + QUANT_DTYPES, 1)
            and all(isinstance(t, types.Integer) for t in (*offsets, stride))):
        raise TypingError(f"{name}: expected a 2-D C float32 array, a 1-D C array of float32, float16/bfloat16 "
                          f"bits or Q8_0/Q4_0 bytes, integer offsets and stride; got {matrix}, {rows}, {offsets}, "
                          f"{stride}")


def _row_lanes(dtype) -> int:
    """Lanes of the float rows' vectors: ``wide_lanes()`` for float16/bfloat16 rows, 8 for float32 ones. A 16-float
    load is a whole 64-byte line, and a float32 row rarely starts on one (NumPy's large arrays start 16 bytes
    into a line), so every such load would span two lines; 16 half-words span at most two, as 8 floats do."""
    return LANES if dtype == types.float32 else wide_lanes()


def _columns(builder, n, stride, lanes):
    """Columns taken ``lanes`` at a time: n rounded down to a multiple of ``lanes`` when the column stride is 1,
    else 0."""
    unit = builder.icmp_signed("==", stride, const(1))
    return builder.select(unit, builder.and_(n, const(-lanes)), const(0))


def _dot_codegen(n_heads: int, n_rows: int):
    """Sums qs[g + h] · K row r for the heads h < n_heads and the K rows at flat offsets o_1 .. o_n_rows."""
    def codegen(context, builder, signature, llargs):
        qs_t, _, kf_t = signature.args[:3]
        qs = context.make_array(qs_t)(context, builder, llargs[0])
        kf = context.make_array(kf_t)(context, builder, llargs[2])
        g = as_int64(context, builder, llargs[1], signature.args[1])
        offsets = [as_int64(context, builder, llargs[3 + r], signature.args[3 + r]) for r in range(n_rows)]
        kcs = as_int64(context, builder, llargs[3 + n_rows], signature.args[3 + n_rows])
        DK = builder.extract_value(qs.shape, 1)
        q_rows = [builder.gep(qs.data, [builder.mul(builder.add(g, const(h)), DK)]) for h in range(n_heads)]
        if kf_t.dtype in QUANT_DTYPES:
            sums = _quantized_dots(builder, kf_t.dtype, builder.bitcast(kf.data, _I8P), q_rows, offsets, DK)
            values = [sums[h * n_rows + r] for r in range(n_rows) for h in range(n_heads)]
            if len(values) == 1:
                return values[0]
            return context.make_tuple(builder, signature.return_type, values)
        lanes = _row_lanes(kf_t.dtype)
        n_vector = _columns(builder, DK, kcs, lanes)

        def vector_step(d, acc):
            q = [load_lanes(builder, types.float32, row, d, lanes) for row in q_rows]
            k = [load_lanes(builder, kf_t.dtype, kf.data, builder.add(o, d), lanes) for o in offsets]
            return [fma(builder, q[h], k[r], acc[h * n_rows + r]) for h in range(n_heads) for r in range(n_rows)]

        zero = ir.Constant(ir.VectorType(ir.FloatType(), lanes), [0.0] * lanes)
        acc = loop(builder, const(0), n_vector, const(lanes), [zero] * (n_heads * n_rows), vector_step)
        sums = hsum_many(builder, acc)

        def scalar_step(d, acc):
            q = [load1(builder, types.float32, row, d) for row in q_rows]
            at = builder.mul(d, kcs)
            k = [load1(builder, kf_t.dtype, kf.data, builder.add(o, at)) for o in offsets]
            return [fma(builder, q[h], k[r], acc[h * n_rows + r]) for h in range(n_heads) for r in range(n_rows)]

        sums = loop(builder, n_vector, DK, const(1), sums, scalar_step)
        # heads vary fastest in the result: (head 0 .. 3 of row 1, then of row 2), as the callers unpack them
        values = [sums[h * n_rows + r] for r in range(n_rows) for h in range(n_heads)]
        if len(values) == 1:
            return values[0]
        return context.make_tuple(builder, signature.return_type, values)

    return codegen


def _quantized_dots(builder, dtype, base, q_rows, offsets, DK):
    """The sums q_rows[h] · K row r (rows quantized, Q8_0 or Q4_0 by ``dtype``, the first block of row r at byte
    offsets[r] of ``base``), h-major. Per block, each row's 32 values are widened in registers and multiplied by
    the row's scale d once for every head (d k is exact in float32: an 11-bit significand times an integer of at
    most 8 bits), then added to the (head, row) accumulators as float rows are: the dot product of q with the
    dequantized row, the same sum for a (head, row) in every variant, and an inf or NaN d gives the infinities
    and NaNs the dequantized values give. Vectors of ``wide_lanes()`` floats: the block's arithmetic, not its
    bytes, bounds a quantized decode."""
    n_heads, n_rows = len(q_rows), len(offsets)
    width = block_bytes_of(dtype)
    lanes = wide_lanes()
    vector = ir.VectorType(ir.FloatType(), lanes)
    zero = ir.Constant(vector, [0.0] * lanes)

    def block_step(b, acc):
        starts = [builder.gep(base, [builder.add(o, builder.mul(b, const(width)))]) for o in offsets]
        scales = [block_scale(builder, start, lanes)[0] for start in starts]
        q0 = builder.mul(b, const(QUANT_BLOCK))
        for part in range(QUANT_BLOCK // lanes):
            q = [load_floats(builder, row, builder.add(q0, const(lanes * part)), lanes) for row in q_rows]
            k = [builder.fmul(block_values(builder, dtype, start, part, lanes), d) for start, d in zip(starts, scales)]
            acc = [fma(builder, q[h], k[r], acc[h * n_rows + r]) for h in range(n_heads) for r in range(n_rows)]
        return acc

    n_blocks = builder.sdiv(DK, const(QUANT_BLOCK))
    acc = loop(builder, const(0), n_blocks, const(1), [zero] * (n_heads * n_rows), block_step)
    return hsum_many(builder, acc)


@intrinsic
def dot4x2(typingctx, qs, g, kf, o1, o2, kcs):
    """Dot products of query rows g .. g+3 with the K rows at flat offsets o1 and o2: 8 sums (the 4 heads' of
    o1, then of o2), one pass over the rows."""
    _check_rows("dot4x2", qs, kf, (g, o1, o2), kcs)
    return types.UniTuple(types.float32, 8)(qs, g, kf, o1, o2, kcs), _dot_codegen(4, 2)


@intrinsic
def dot4(typingctx, qs, g, kf, o1, kcs):
    """Dot products of query rows g .. g+3 with the K row at flat offset o1."""
    _check_rows("dot4", qs, kf, (g, o1), kcs)
    return types.UniTuple(types.float32, 4)(qs, g, kf, o1, kcs), _dot_codegen(4, 1)


@intrinsic
def dot1(typingctx, qs, g, kf, o1, kcs):
    """Dot product of query row g with the K row at flat offset o1."""
    _check_rows("dot1", qs, kf, (g, o1), kcs)
    return types.float32(qs, g, kf, o1, kcs), _dot_codegen(1, 1)


def _int64s(context, builder, value, typ) -> list:
    """An integer argument, or each integer of a tuple argument, as int64 LLVM values."""
    if isinstance(typ, types.BaseTuple):
        return [as_int64(context, builder, builder.extract_value(value, i), t) for i, t in enumerate(typ)]
    return [as_int64(context, builder, value, typ)]


def _axpy_codegen(n_rows: int, n_heads: int):
    """A[a0 + h*DV + c] += sum over rows r of w[h, r] V_r[c] for the n_heads heads: with one row a single FMA
    (the roundings of ``attention.stream``'s column slices), with 2 or 4 rows the products summed pairwise."""
    def codegen(context, builder, signature, llargs):
        args = signature.args
        A = context.make_array(args[0])(context, builder, llargs[0])
        a0 = as_int64(context, builder, llargs[1], args[1])
        DV = as_int64(context, builder, llargs[2], args[2])
        if n_heads == 1:  # (A, a0, DV, p0, vf, o1, vcs)
            weights = [[llargs[3]]]
            first_v = 4
        else:  # (A, a0, DV, p, g, rows, vf, offsets, vcs): rows and offsets an integer or a tuple of n_rows
            p = context.make_array(args[3])(context, builder, llargs[3])
            g = as_int64(context, builder, llargs[4], args[4])
            ldp = builder.extract_value(p.shape, 1)
            rs = _int64s(context, builder, llargs[5], args[5])
            weights = [[builder.load(builder.gep(p.data, [builder.add(builder.mul(builder.add(g, const(h)), ldp), r)]),
                                     align=4) for r in rs] for h in range(n_heads)]
            first_v = 6
        vf_t = args[first_v]
        vf = context.make_array(vf_t)(context, builder, llargs[first_v])
        offsets = _int64s(context, builder, llargs[first_v + 1], args[first_v + 1])
        vcs = as_int64(context, builder, llargs[first_v + 2], args[first_v + 2])
        a_rows = [builder.gep(A.data, [builder.add(a0, builder.mul(const(h), DV))]) for h in range(n_heads)]

        def update(a, w, v):
            if n_rows == 1:
                return fma(builder, w[0], v[0], a)
            pairs = [fma(builder, w[r + 1], v[r + 1], builder.fmul(w[r], v[r])) for r in range(0, n_rows, 2)]
            total = pairs[0] if len(pairs) == 1 else builder.fadd(pairs[0], pairs[1])
            return builder.fadd(a, total)

        if vf_t.dtype in QUANT_DTYPES:
            _quantized_updates(builder, vf_t.dtype, builder.bitcast(vf.data, _I8P), a_rows, weights, offsets, DV,
                               update)
            return context.get_dummy_value()
        lanes = _row_lanes(vf_t.dtype)
        vector = ir.VectorType(ir.FloatType(), lanes)
        wide = [[splat(builder, w, lanes) for w in row] for row in weights]

        def vector_step(d, _):
            v = [load_lanes(builder, vf_t.dtype, vf.data, builder.add(o, d), lanes) for o in offsets]
            for h in range(n_heads):
                ptr = builder.bitcast(builder.gep(a_rows[h], [d]), vector.as_pointer())
                builder.store(update(builder.load(ptr, align=4), wide[h], v), ptr, align=4)
            return []

        n_vector = _columns(builder, DV, vcs, lanes)
        loop(builder, const(0), n_vector, const(lanes), [], vector_step)

        def scalar_step(d, _):
            at = builder.mul(d, vcs)
            v = [load1(builder, vf_t.dtype, vf.data, builder.add(o, at)) for o in offsets]
            for h in range(n_heads):
                ptr = builder.gep(a_rows[h], [d])
                builder.store(update(builder.load(ptr, align=4), weights[h], v), ptr, align=4)
            return []

        loop(builder, n_vector, DV, const(1), [], scalar_step)
        return context.get_dummy_value()

    return codegen


def _quantized_updates(builder, dtype, base, a_rows, weights, offsets, DV, update):
    """``_axpy_codegen``'s update on quantized V rows (Q8_0 or Q4_0 by ``dtype``, the first block of row r at byte
    offsets[r] of ``base``): per block, the block's 32 values of each row widened in registers and multiplied by
    the row's scale d (exact, as in ``_quantized_dots``) once for every head, then added as the float rows are,
    w · (d q): the weighted dequantized row, infinities and NaNs included, in vectors of ``wide_lanes()``
    floats."""
    n_heads, n_rows = len(a_rows), len(offsets)
    width = block_bytes_of(dtype)
    lanes = wide_lanes()
    vector = ir.VectorType(ir.FloatType(), lanes)
    wide = [[splat(builder, weights[h][r], lanes) for r in range(n_rows)] for h in range(n_heads)]

    def block_step(b, _):
        starts = [builder.gep(base, [builder.add(o, builder.mul(b, const(width)))]) for o in offsets]
        scales = [block_scale(builder, start, lanes)[0] for start in starts]
        a_at = builder.mul(b, const(QUANT_BLOCK))
        for part in range(QUANT_BLOCK // lanes):
            v = [builder.fmul(block_values(builder, dtype, start, part, lanes), d) for start, d in zip(starts, scales)]
            at = builder.add(a_at, const(lanes * part))
            for h in range(n_heads):
                ptr = builder.bitcast(builder.gep(a_rows[h], [at]), vector.as_pointer())
                builder.store(update(builder.load(ptr, align=4), wide[h], v), ptr, align=4)
        return []

    loop(builder, const(0), builder.sdiv(DV, const(QUANT_BLOCK)), const(1), [], block_step)


def _check_axpy(name, A, a0, DV, p, vf, ints):
    if not (is_c(A, (types.float32,), 1) and is_c(vf, KERNEL_DTYPES + QUANT_DTYPES, 1)
            and (p == types.float32 or is_c(p, (types.float32,), 2))
            and all(isinstance(t, types.Integer) for t in (a0, DV, *ints))):
        raise TypingError(f"{name}: expected A 1-D C float32, weights float32, V rows 1-D C float32, "
                          f"float16/bfloat16 bits or Q8_0/Q4_0 bytes and integer offsets; got {A}, {p}, {vf}")


def _row_tuple(name, n, rows, offsets):
    """The integers of ``rows`` and ``offsets``, tuples of ``n`` (typing of the multi-row updates)."""
    if not (isinstance(rows, types.BaseTuple) and isinstance(offsets, types.BaseTuple)
            and len(rows) == n and len(offsets) == n):
        raise TypingError(f"{name}: expected tuples of {n} rows and {n} offsets, got {rows} and {offsets}")
    return (*rows, *offsets)


@intrinsic
def axpy4x4(typingctx, A, a0, DV, p, g, rows, vf, offsets, vcs):
    """A[g .. g+3] += p[.., r] V row for the four rows ``rows`` (r1, .., r4) at flat offsets ``offsets``
    (o1, .., o4): each accumulator is loaded and stored once per four rows (the per-row update is bound by its
    256-bit stores)."""
    _check_axpy("axpy4x4", A, a0, DV, p, vf, (g, *_row_tuple("axpy4x4", 4, rows, offsets), vcs))
    return types.none(A, a0, DV, p, g, rows, vf, offsets, vcs), _axpy_codegen(4, 4)


@intrinsic
def axpy4x2(typingctx, A, a0, DV, p, g, rows, vf, offsets, vcs):
    """A[g .. g+3] += p[.., r1] V row o1 + p[.., r2] V row o2 for ``rows`` (r1, r2) at ``offsets`` (o1, o2) (A
    flat, head g's DV values at a0)."""
    _check_axpy("axpy4x2", A, a0, DV, p, vf, (g, *_row_tuple("axpy4x2", 2, rows, offsets), vcs))
    return types.none(A, a0, DV, p, g, rows, vf, offsets, vcs), _axpy_codegen(2, 4)


@intrinsic
def axpy4(typingctx, A, a0, DV, p, g, r1, vf, o1, vcs):
    """A[g .. g+3] += p[.., r1] V row o1, one FMA per value."""
    _check_axpy("axpy4", A, a0, DV, p, vf, (g, r1, o1, vcs))
    return types.none(A, a0, DV, p, g, r1, vf, o1, vcs), _axpy_codegen(1, 4)


@intrinsic
def axpy1(typingctx, A, a0, DV, p0, vf, o1, vcs):
    """A[a0 .. a0+DV] += p0 V row o1, one FMA per value."""
    _check_axpy("axpy1", A, a0, DV, p0, vf, (o1, vcs))
    return types.none(A, a0, DV, p0, vf, o1, vcs), _axpy_codegen(1, 1)


@intrinsic
def prefetch_row(typingctx, f, start, lines, step):
    """Prefetch ``lines`` cache lines from flat offset ``start`` of ``f`` (1-D), ``step`` elements apart (a hint:
    never faults, so the lines may run past the end of ``f``)."""
    if not (isinstance(f, types.Array) and f.ndim == 1
            and all(isinstance(t, types.Integer) for t in (start, lines, step))):
        raise TypingError(f"prefetch_row: expected a 1-D array and integers, got {f}, {start}, {lines}, {step}")

    def codegen(context, builder, signature, llargs):
        data = context.make_array(signature.args[0])(context, builder, llargs[0]).data
        first, n, every = (as_int64(context, builder, v, t) for v, t in zip(llargs[1:], signature.args[1:]))

        def step_(i, _):
            prefetch_line(builder, builder.gep(data, [builder.add(first, builder.mul(i, every))]))
            return []

        loop(builder, const(0), n, const(1), [], step_)
        return context.get_dummy_value()

    return types.none(f, start, lines, step), codegen

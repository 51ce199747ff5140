"""Quantized K/V (Q8_0, Q4_0) in the attention kernels: blocks of rows widened once into float32 scratch.

A ``Quantized`` K or V reaches the kernels as its bytes, and, as for float16 and bfloat16, the *integer type
names the format* (``kv_view``):

    q8_0 -> ``int8`` view of the bytes      34-byte blocks: float16 d, 32 int8 q       value = q · d
    q4_0 -> ``uint8`` view of the bytes     18-byte blocks: float16 d, 16 nibble bytes  value = (nibble - 8) · d

so the flat views, offsets and strides of ``_attention_layout`` work unchanged, counted in bytes (a row of D values
is D / 32 blocks; its last axis is contiguous by ``Quantized``'s rule).

The kernels never dot a query with quantized bytes. ``block_rows`` widens the rows of one block that some head of
the group reads into a float32 scratch (ROWS x D, in L1) once, and returns a row view of the scratch; the group's
query heads then run the float32 loops on it. So each K/V row is dequantized once per query row and GQA group (not
once per query head as in ggml), Q is never rounded, and the arithmetic is float32 throughout. ``q · d`` of a Q8_0
or Q4_0 value is exact in float32 (at most 8 + 11 significant bits), so the widened values are exactly the
reference's ``dequantize``. For float K/V every function here is the identity and compiles to nothing.

``widen_row`` does the same for the tiled path's K and V tiles (one row into a float32 scratch row).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from ._attention_rows import ROWS
from ._attention_softmax import _live_rows
from ._kernel import assume_contiguous, kernel, to_f32
from ._quantized import BLOCK, BLOCK_BYTES, Quantized
from ._simd import V8, as_int64, const, shuffle

Q8_0_BYTES = BLOCK_BYTES["q8_0"]
Q4_0_BYTES = BLOCK_BYTES["q4_0"]
_INF = np.float32(np.inf)

#: The kernel dtype that names each quantized type.
_VIEW_DTYPES = {"q8_0": np.dtype(np.int8), "q4_0": np.dtype(np.uint8)}


def kv_view(a: Quantized) -> np.ndarray:
    """The bytes of a quantized K or V as the kernels read them: int8 for Q8_0, uint8 for Q4_0."""
    return a.data.view(_VIEW_DTYPES[a.qtype])


def _block_bytes(dtype) -> int:
    """Bytes per block of the quantized kernel dtype ``dtype``; 0 for a float (or float bits) dtype."""
    if dtype == types.int8:
        return Q8_0_BYTES
    if dtype == types.uint8:
        return Q4_0_BYTES
    return 0


def _block_codegen(qtype: str):
    """LLVM IR widening one block: the float16 scale, then 32 values as 4 vectors of 8, multiplied by it and
    stored (LLVM does not vectorise the scalar loop across the int8 and float32 arrays it cannot prove apart)."""
    def codegen(context, builder, signature, llargs):
        f = context.make_array(signature.args[0])(context, builder, llargs[0])
        dst = context.make_array(signature.args[2])(context, builder, llargs[2])
        o = as_int64(context, builder, llargs[1], signature.args[1])
        d0 = as_int64(context, builder, llargs[3], signature.args[3])
        i8p = ir.IntType(8).as_pointer()
        start = builder.gep(builder.bitcast(f.data, i8p), [o])
        # the scale: the block's first 4 half words converted as a vector and lane 0 broadcast (one vcvtph2ps from
        # memory; a scalar half load becomes a vpinsrw into the previous block's register, chaining the blocks)
        v4_half = ir.VectorType(ir.HalfType(), 4)
        head = builder.fpext(builder.load(builder.bitcast(start, v4_half.as_pointer()), align=1),
                             ir.VectorType(ir.FloatType(), 4))
        d = shuffle(builder, head, head, [0] * 8)
        q = builder.gep(start, [const(2)])
        out = builder.gep(dst.data, [d0])
        v8_i8 = ir.VectorType(ir.IntType(8), 8)
        v8_i32 = ir.VectorType(ir.IntType(32), 8)
        if qtype == "q4_0":  # bytes 0..7 and 8..15 widened to int32 lanes: low nibbles are values 0..15, high 16..31
            packed = [builder.zext(builder.load(builder.bitcast(builder.gep(q, [const(8 * half)]), v8_i8.as_pointer()),
                                                align=1), v8_i32) for half in range(2)]
        for part in range(4):  # 8 values at a time: 8-wide integer widening and conversion, one store each
            if qtype == "q8_0":
                ints = builder.sext(builder.load(builder.bitcast(builder.gep(q, [const(8 * part)]),
                                                                 v8_i8.as_pointer()), align=1), v8_i32)
            else:
                bytes8 = packed[part % 2]
                nibble = (builder.and_(bytes8, ir.Constant(v8_i32, [15] * 8)) if part < 2
                          else builder.lshr(bytes8, ir.Constant(v8_i32, [4] * 8)))
                ints = builder.sub(nibble, ir.Constant(v8_i32, [8] * 8))
            values = builder.sitofp(ints, V8)
            ptr = builder.bitcast(builder.gep(out, [const(8 * part)]), V8.as_pointer())
            builder.store(builder.fmul(values, d), ptr, align=4)
        return context.get_dummy_value()
    return codegen


def _check_block(f, o, dst, d0, dtype):
    if not (isinstance(f, types.Array) and f.dtype == dtype and f.ndim == 1 and f.layout == "C"
            and isinstance(dst, types.Array) and dst.dtype == types.float32 and dst.ndim == 1 and dst.layout == "C"
            and isinstance(o, types.Integer) and isinstance(d0, types.Integer)):
        raise TypingError(f"expected 1-D C {dtype} bytes, an offset, 1-D C float32 and an offset")


@intrinsic
def _q8_0_block(typingctx, f, o, dst, d0):
    """dst[d0 .. d0+32] = the Q8_0 block at byte o of f (int8 bytes, 1-D C), in float32."""
    _check_block(f, o, dst, d0, types.int8)
    return types.none(f, o, dst, d0), _block_codegen("q8_0")


@intrinsic
def _q4_0_block(typingctx, f, o, dst, d0):
    """dst[d0 .. d0+32] = the Q4_0 block at byte o of f (uint8 bytes, 1-D C), in float32."""
    _check_block(f, o, dst, d0, types.uint8)
    return types.none(f, o, dst, d0), _block_codegen("q4_0")


@kernel(inline=True)
def _q8_0_row(f, o, n_values, dst, d0):
    """dst[d0 .. d0+n_values] = the Q8_0 row whose first block is at byte o of f (int8 bytes)."""
    for blk in range(n_values // BLOCK):
        _q8_0_block(f, o + blk * Q8_0_BYTES, dst, d0 + blk * BLOCK)


@kernel(inline=True)
def _q4_0_row(f, o, n_values, dst, d0):
    """dst[d0 .. d0+n_values] = the Q4_0 row whose first block is at byte o of f (uint8 bytes)."""
    for blk in range(n_values // BLOCK):
        _q4_0_block(f, o + blk * Q4_0_BYTES, dst, d0 + blk * BLOCK)


def _dequantize_row(f, o, n_values, dst, d0):
    """dst[d0 .. d0+n_values] = the quantized row at byte o of f (Q8_0 for int8 bytes, Q4_0 for uint8).
    Kernel-only."""
    raise NotImplementedError


@overload(_dequantize_row, inline="always")
def _dequantize_row_impl(f, o, n_values, dst, d0):
    if f.dtype == types.int8:
        return lambda f, o, n_values, dst, d0: _q8_0_row(f, o, n_values, dst, d0)
    if f.dtype == types.uint8:
        return lambda f, o, n_values, dst, d0: _q4_0_row(f, o, n_values, dst, d0)
    raise TypingError(f"_dequantize_row: expected int8 (Q8_0) or uint8 (Q4_0) bytes, got {f}")


def row_elements(f, n_values):
    """Elements of ``f`` one row of ``n_values`` values spans: n_values for float data, its blocks' bytes for
    quantized data (the prefetch distance and lines of a row). Kernel-only."""
    raise NotImplementedError


@overload(row_elements, inline="always")
def _row_elements(f, n_values):
    width = _block_bytes(f.dtype)
    if width:
        return lambda f, n_values: n_values // BLOCK * width
    return lambda f, n_values: n_values


def row_scratch(kf, dk, vf, dv):
    """Float32 scratch for one block of widened rows, shared by K and V (K's rows are done with before V's are
    widened): ROWS rows of the longer quantized one; when both are float (read in place) an empty view of kf.
    Kernel-only."""
    raise NotImplementedError


@overload(row_scratch, inline="always")
def _row_scratch(kf, dk, vf, dv):
    k_quantized = _block_bytes(kf.dtype) != 0
    v_quantized = _block_bytes(vf.dtype) != 0
    if k_quantized and v_quantized:
        return lambda kf, dk, vf, dv: np.empty(ROWS * max(dk, dv), np.float32)
    if k_quantized:
        return lambda kf, dk, vf, dv: np.empty(ROWS * dk, np.float32)
    if v_quantized:
        return lambda kf, dk, vf, dv: np.empty(ROWS * dv, np.float32)
    return lambda kf, dk, vf, dv: kf[:0]  # unused by float K/V: an empty view, nothing allocated


def block_rows(rows_at, n_values, jb, sc, n, every, dead, rows, scratch):
    """Rows jb .. jb+n of a block as the float32 loops read them. ``rows_at`` = (f, base, rs, cs): row j at flat
    offset ``base + j * rs`` of f, column stride cs. Float data: ``rows_at`` itself. Quantized data: the rows r
    where some head's sc[:, r] is not ``dead`` (all n when ``every``; listed in ``rows``) are widened into
    ``scratch`` (row jb + r at r · n_values) and (scratch, -jb · n_values, n_values, 1) is returned, so row j is
    again at ``base + j * rs``; the other rows are not read. Kernel-only."""
    raise NotImplementedError


@kernel
def _widen_block(f, base, rs, n_values, jb, sc, n, every, dead, rows, scratch):
    """``block_rows``' widening of quantized rows (a call: inlined, its loops confused Numba's inliner)."""
    for x in range(_live_rows(sc, 0, sc.shape[0], n, every, dead, rows)):
        r = rows[x]
        _dequantize_row(f, base + (jb + r) * rs, n_values, scratch, r * n_values)


@overload(block_rows, inline="always")
def _block_rows(rows_at, n_values, jb, sc, n, every, dead, rows, scratch):
    if not isinstance(rows_at, types.BaseTuple):
        raise TypingError("block_rows: expected (f, base, rs, cs)")
    if _block_bytes(rows_at.types[0].dtype):
        def widen(rows_at, n_values, jb, sc, n, every, dead, rows, scratch):
            f, base, rs, _ = rows_at
            _widen_block(f, base, rs, n_values, jb, sc, n, every, dead, rows, scratch)
            return scratch, -jb * n_values, n_values, 1
        return widen
    return lambda rows_at, n_values, jb, sc, n, every, dead, rows, scratch: rows_at


@kernel
def _widen_float_row(src, dst):
    bad = False
    if src.strides[0] == src.itemsize:
        contiguous = assume_contiguous(src)
        for d in range(src.shape[0]):
            x = to_f32(contiguous[d])
            dst[d] = x
            bad |= not abs(x) < _INF
    else:
        for d in range(src.shape[0]):
            x = to_f32(src[d])
            dst[d] = x
            bad |= not abs(x) < _INF
    return bad


@kernel
def _finite_check(dst, n):
    bad = False
    for d in range(n):
        bad |= not abs(dst[d]) < _INF
    return bad


def widen_row(src, dst):
    """dst[:n] = the float32 values of the row ``src`` (float32, float16/bfloat16 bits, or the bytes of a Q8_0 or
    Q4_0 row: n = its values); returns whether the row holds an inf or NaN (a comparison: fast-math folds sums like
    acc + (x - x) to acc). Contiguous rows take the vectorised loop. Kernel-only."""
    raise NotImplementedError


@overload(widen_row)
def _widen_row(src, dst):
    width = _block_bytes(src.dtype)
    if width:
        def widen(src, dst):
            n = src.shape[0] // width * BLOCK
            _dequantize_row(assume_contiguous(src), 0, n, assume_contiguous(dst), 0)
            return _finite_check(dst, n)
        return widen
    return lambda src, dst: _widen_float_row(src, dst)

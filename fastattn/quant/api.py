"""Q8_0 / Q4_0 kernels: ``quantize``, ``dequantize``, the row quantizer ``set_rows`` uses and the block widening
attention uses (``widen_blocks``).

Each row of 32-value blocks is quantized block by block with ggml's reference rounding (``fastattn/reference/quant.py``
states it): the kernels compile without fastmath (``kernel(fastmath=EXACT)``) so that ``d = amax / 127``, ``1 / d``
and ``x · (1/d) + 8.5`` round exactly as the reference's float32 NumPy does (no FMA contraction, no reciprocal
for a division); the bytes are then identical to the reference's and to the ``gguf`` package's. Float16 input
enters as uint16 bits and is widened exactly.

A block of a contiguous row is quantized by an LLVM intrinsic on four 8-wide vectors (``_q8_0_block_vector``,
``_q4_0_block_vector``): the largest magnitude as an integer max of the magnitude bits, the scale's divisions and
the scaling as plain IEEE operations (no fast-math flags), the packing as vector integer operations. Q8_0 takes
four blocks at a time where it can (``_q8_0_blocks4_vector``): their maxima reduced together and their scales
divided in one vector, the same operations lane by lane. LLVM does not vectorise the scalar block loops (``_q8_0_block``, ``_q4_0_block``, kept for strided rows): it cannot prove the
float row and the byte row apart. The two give the same bytes.

Layout: leading axes are merged into one (``_core.layout.merge_leading``, never a copy), so the kernels see rows:
values (rows, n) and bytes (rows, n / 32 · block_bytes). Rows are independent: ``prange`` over rows above the
threading rule's size (``_core.threads.threads_for``), serially below.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from .._core import layout as _layout
from .._core import threads as _threads
from .._core.kernel import (EXACT, f16_bits_to_f32, f32_to_f16_bits, any_layout, argument_positions,
                           assume_contiguous, call_any_layout, kernel, kernel_view, to_f32)
from .blocks import BLOCK, BLOCK_BYTES, QTYPE_CODES, Quantized, quantized_array, values_array
from .._core.simd import (KERNEL_DTYPES, LANES, V8, as_int64, block_scale, block_values, const, load1, load8, shuffle,
                          splat)

Q8_0 = QTYPE_CODES["q8_0"]
Q4_0 = QTYPE_CODES["q4_0"]
Q8_0_BYTES = BLOCK_BYTES["q8_0"]
Q4_0_BYTES = BLOCK_BYTES["q4_0"]


@intrinsic
def _magnitude_bits(typingctx, value):
    """The bits of |value| (float32) as uint32: ordered as the magnitudes are, so an integer max (which
    vectorises without fastmath, unlike a float max) finds the largest magnitude."""
    if value != types.float32:
        raise TypingError("expected float32")

    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], ir.IntType(32))
        return builder.and_(bits, ir.Constant(ir.IntType(32), 0x7FFFFFFF))

    return types.uint32(value), codegen


@intrinsic
def _from_bits(typingctx, bits):
    """The float32 whose bits are ``bits`` (uint32)."""
    if bits != types.uint32:
        raise TypingError("expected uint32")

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(bits), codegen


@kernel(inline=True, fastmath=EXACT)
def _store_scale(out, o, d):
    """The float16 scale ``d`` (rounded to nearest even) as two little-endian bytes at out[o]."""
    bits = f32_to_f16_bits(d)
    out[o] = np.uint8(bits & 0xFF)
    out[o + 1] = np.uint8(bits >> 8)


@kernel(inline=True, fastmath=EXACT)
def _load_scale(data, o):
    return f16_bits_to_f32(np.uint16(np.int32(data[o]) | (np.int32(data[o + 1]) << 8)))


@kernel(inline=True, fastmath=EXACT)
def _q8_0_block(x, j0, out, o):
    """Values x[j0 .. j0+32] into the Q8_0 block at out[o]: d = amax/127, q = roundf(x/d) (halves away from 0)."""
    top = np.uint32(0)
    for j in range(BLOCK):
        top = max(top, _magnitude_bits(to_f32(x[j0 + j])))
    d = _from_bits(top) / np.float32(127.0)
    inv = np.float32(1.0) / d if d != 0.0 else np.float32(0.0)
    _store_scale(out, o, d)
    for j in range(BLOCK):
        v = to_f32(x[j0 + j]) * inv
        t = np.trunc(v)
        # roundf: v - t is exact, so this is its half-way test; a select, so the loop vectorises
        r = t + math.copysign(np.float32(1.0), v) if abs(v - t) >= np.float32(0.5) else t
        out[o + 2 + j] = np.uint8(np.int32(r) & 0xFF)


def _umax(builder, a, b):
    return builder.select(builder.icmp_unsigned(">", a, b), a, b)


def _store_q8_0(builder, base, scale_bits, inverse, values):
    """One Q8_0 block at byte pointer ``base``: its float16 scale bits, then round(v · inverse) of its four
    8-wide ``values`` (halves away from zero) as int8."""
    builder.store(scale_bits, builder.bitcast(base, ir.IntType(16).as_pointer()), align=1)
    v32_i8 = ir.VectorType(ir.IntType(8), 4 * LANES)
    # roundf as LLVM expands llvm.round (trunc(v + copysign(0.49999997, v)): exact, the sum rounds a half up to
    # the next integer and nothing below it), the truncation left to fptosi: one instruction less per vector
    below_half = ir.Constant(V8, [float(np.nextafter(np.float32(0.5), np.float32(0.0)))] * LANES)
    copysign = builder.module.declare_intrinsic("llvm.copysign.v8f32", (), ir.FunctionType(V8, [V8, V8]))
    q = []
    for v in values:
        scaled = builder.fmul(v, splat(builder, inverse))
        q.append(builder.fptosi(builder.fadd(scaled, builder.call(copysign, [below_half, scaled])),
                                ir.VectorType(ir.IntType(32), LANES)))
    # the block's 32 values truncated to bytes in one operation (packs, not a shuffle per vector)
    joined = shuffle(builder, shuffle(builder, q[0], q[1], list(range(2 * LANES))),
                     shuffle(builder, q[2], q[3], list(range(2 * LANES))), list(range(4 * LANES)))
    builder.store(builder.trunc(joined, v32_i8),
                  builder.bitcast(builder.gep(base, [const(2)]), v32_i8.as_pointer()), align=1)


def _q8_0_vector_codegen(context, builder, signature, llargs):
    x = context.make_array(signature.args[0])(context, builder, llargs[0])
    out = context.make_array(signature.args[2])(context, builder, llargs[2])
    j0 = as_int64(context, builder, llargs[1], signature.args[1])
    o = as_int64(context, builder, llargs[3], signature.args[3])
    i32, v8_i32 = ir.IntType(32), ir.VectorType(ir.IntType(32), LANES)
    values = [load8(builder, signature.args[0].dtype, x.data, builder.add(j0, const(LANES * p))) for p in range(4)]
    magnitude = [builder.and_(builder.bitcast(v, v8_i32), ir.Constant(v8_i32, [0x7FFFFFFF] * LANES)) for v in values]
    top = _umax(builder, _umax(builder, magnitude[0], magnitude[1]), _umax(builder, magnitude[2], magnitude[3]))
    reduce = builder.module.declare_intrinsic("llvm.vector.reduce.umax.v8i32", (), ir.FunctionType(i32, [v8_i32]))
    amax = builder.bitcast(builder.call(reduce, [top]), ir.FloatType())
    f32 = ir.FloatType()
    d = builder.fdiv(amax, ir.Constant(f32, 127.0))
    inverse = builder.select(builder.fcmp_ordered("!=", d, ir.Constant(f32, 0.0)),
                             builder.fdiv(ir.Constant(f32, 1.0), d), ir.Constant(f32, 0.0))
    scale_bits = builder.bitcast(builder.fptrunc(d, ir.HalfType()), ir.IntType(16))
    _store_q8_0(builder, builder.gep(out.data, [o]), scale_bits, inverse, values)
    return context.get_dummy_value()


#: Blocks ``_q8_0_blocks4_vector`` quantizes at once, and where each one's scale lands in its 8 lanes.
_GROUP = 4
_GROUP_LANES = (0, 4, 2, 6)


def _q8_0_blocks4_codegen(context, builder, signature, llargs):
    """Four consecutive blocks: their largest magnitudes reduced together (a transposed max: one vector of the
    four maxima, each in two lanes), then d = amax / 127 and 1 / d divided once for all four, lane by lane the
    same IEEE operations as the single block's."""
    x = context.make_array(signature.args[0])(context, builder, llargs[0])
    out = context.make_array(signature.args[2])(context, builder, llargs[2])
    j0 = as_int64(context, builder, llargs[1], signature.args[1])
    o = as_int64(context, builder, llargs[3], signature.args[3])
    v8_i32 = ir.VectorType(ir.IntType(32), LANES)
    dtype = signature.args[0].dtype
    values = [[load8(builder, dtype, x.data, builder.add(j0, const(BLOCK * b + LANES * p))) for p in range(4)]
              for b in range(_GROUP)]
    sign_off = ir.Constant(v8_i32, [0x7FFFFFFF] * LANES)

    def umax(a, b):
        return _umax(builder, a, b)

    tops = []
    for block in values:
        m = [builder.and_(builder.bitcast(v, v8_i32), sign_off) for v in block]
        tops.append(umax(umax(m[0], m[1]), umax(m[2], m[3])))
    # lanes 0-3 block 0 and 4-7 block 1 (c01), blocks 2 and 3 (c23); then [b0 b0 b2 b2 b1 b1 b3 b3]; then each
    # pair of lanes holds its block's maximum
    c01 = umax(shuffle(builder, tops[0], tops[1], [0, 1, 2, 3, 8, 9, 10, 11]),
               shuffle(builder, tops[0], tops[1], [4, 5, 6, 7, 12, 13, 14, 15]))
    c23 = umax(shuffle(builder, tops[2], tops[3], [0, 1, 2, 3, 8, 9, 10, 11]),
               shuffle(builder, tops[2], tops[3], [4, 5, 6, 7, 12, 13, 14, 15]))
    e = umax(shuffle(builder, c01, c23, [0, 1, 8, 9, 4, 5, 12, 13]),
             shuffle(builder, c01, c23, [2, 3, 10, 11, 6, 7, 14, 15]))
    top = umax(e, shuffle(builder, e, ir.Constant(v8_i32, ir.Undefined), [1, 0, 3, 2, 5, 4, 7, 6]))
    d = builder.fdiv(builder.bitcast(top, V8), ir.Constant(V8, [127.0] * LANES))
    zero = ir.Constant(V8, [0.0] * LANES)
    inverse = builder.select(builder.fcmp_ordered("!=", d, zero), builder.fdiv(ir.Constant(V8, [1.0] * LANES), d),
                             zero)
    scale_bits = builder.bitcast(builder.fptrunc(d, ir.VectorType(ir.HalfType(), LANES)),
                                 ir.VectorType(ir.IntType(16), LANES))
    for b, lane in enumerate(_GROUP_LANES):
        at = ir.Constant(ir.IntType(32), lane)
        _store_q8_0(builder, builder.gep(out.data, [builder.add(o, const(Q8_0_BYTES * b))]),
                    builder.extract_element(scale_bits, at), builder.extract_element(inverse, at), values[b])
    return context.get_dummy_value()


@intrinsic
def _q8_0_blocks4_vector(typingctx, x, j0, out, o):
    """``_q8_0_block_vector`` for the four blocks from value j0 (bytes from o): the same bytes, the reduction
    and the divisions shared."""
    _check_block_vector("_q8_0_blocks4_vector", x, j0, out, o)
    return types.none(x, j0, out, o), _q8_0_blocks4_codegen


@intrinsic
def _q8_0_block_vector(typingctx, x, j0, out, o):
    """``_q8_0_block`` for a C-contiguous row x (float32, float16 or bfloat16 bits) in explicit 8-wide vectors, with
    the same IEEE operations (no fast-math flags: d = amax / 127 and 1 / d divided, x · (1/d) multiplied, then
    rounded half away from zero as ``llvm.round`` is, ``_store_q8_0``) and so the same bytes."""
    _check_block_vector("_q8_0_block_vector", x, j0, out, o)
    return types.none(x, j0, out, o), _q8_0_vector_codegen


def _check_block_vector(name, x, j0, out, o):
    if not (isinstance(x, types.Array) and x.dtype in KERNEL_DTYPES and x.ndim == 1 and x.layout == "C"
            and isinstance(out, types.Array) and out.dtype == types.uint8 and out.ndim == 1 and out.layout == "C"
            and isinstance(j0, types.Integer) and isinstance(o, types.Integer)):
        raise TypingError(f"{name}: expected a 1-D C float row, an offset, 1-D C uint8 and an offset")


def _q4_0_vector_codegen(context, builder, signature, llargs):
    x = context.make_array(signature.args[0])(context, builder, llargs[0])
    out = context.make_array(signature.args[2])(context, builder, llargs[2])
    j0 = as_int64(context, builder, llargs[1], signature.args[1])
    o = as_int64(context, builder, llargs[3], signature.args[3])
    dtype = signature.args[0].dtype
    i32, f32 = ir.IntType(32), ir.FloatType()
    v8_i32 = ir.VectorType(i32, LANES)
    values = [load8(builder, dtype, x.data, builder.add(j0, const(LANES * p))) for p in range(4)]
    # |x| as integers, NaN as 0: the scalar loop's ``amax < |v|`` never takes a NaN
    inf_bits = ir.Constant(v8_i32, [0x7F800000] * LANES)
    magnitude = []
    for v in values:
        bits = builder.and_(builder.bitcast(v, v8_i32), ir.Constant(v8_i32, [0x7FFFFFFF] * LANES))
        magnitude.append(builder.select(builder.icmp_unsigned(">", bits, inf_bits), ir.Constant(v8_i32, [0] * LANES),
                                        bits))

    def umax(a, b):
        return _umax(builder, a, b)
    reduce = builder.module.declare_intrinsic("llvm.vector.reduce.umax.v8i32", (), ir.FunctionType(i32, [v8_i32]))
    top = builder.call(reduce, [umax(umax(magnitude[0], magnitude[1]), umax(magnitude[2], magnitude[3]))])
    # m: the first value of the largest magnitude (+0 when every magnitude is 0, as the loop starts from m = +0)
    lanes = ir.Constant(i32, 0)
    for p, mag in enumerate(magnitude):
        hits = builder.bitcast(builder.icmp_unsigned("==", mag, _splat_i32(builder, top)), ir.IntType(LANES))
        lanes = builder.or_(lanes, builder.shl(builder.zext(hits, i32), ir.Constant(i32, LANES * p)))
    cttz = builder.module.declare_intrinsic("llvm.cttz.i32", (), ir.FunctionType(i32, [i32, ir.IntType(1)]))
    first = builder.zext(builder.call(cttz, [lanes, ir.Constant(ir.IntType(1), 0)]), ir.IntType(64))
    first = builder.select(builder.icmp_unsigned("<", first, const(BLOCK)), first, const(0))  # no lane: any
    m = builder.select(builder.icmp_unsigned("==", top, ir.Constant(i32, 0)), ir.Constant(f32, 0.0),
                       load1(builder, dtype, x.data, builder.add(j0, first)))
    d = builder.fdiv(m, ir.Constant(f32, -8.0))
    inverse = builder.select(builder.fcmp_ordered("!=", d, ir.Constant(f32, 0.0)),
                             builder.fdiv(ir.Constant(f32, 1.0), d), ir.Constant(f32, 0.0))
    base = builder.gep(out.data, [o])
    builder.store(builder.bitcast(builder.fptrunc(d, ir.HalfType()), ir.IntType(16)),
                  builder.bitcast(base, ir.IntType(16).as_pointer()), align=1)
    fifteen = ir.Constant(v8_i32, [15] * LANES)
    q = []
    for v in values:  # min(15, trunc(x · (1/d) + 8.5)): a multiply, then an add, each rounded
        shifted = builder.fadd(builder.fmul(v, splat(builder, inverse)), splat(builder, ir.Constant(f32, 8.5)))
        t = builder.fptosi(shifted, v8_i32)
        q.append(builder.select(builder.icmp_signed("<", t, fifteen), t, fifteen))
    v8_i8 = ir.VectorType(ir.IntType(8), LANES)
    for half in range(2):  # byte j = value j | value j + 16 << 4
        packed = builder.or_(q[half], builder.shl(q[half + 2], ir.Constant(v8_i32, [4] * LANES)))
        builder.store(builder.trunc(packed, v8_i8),
                      builder.bitcast(builder.gep(base, [const(2 + LANES * half)]), v8_i8.as_pointer()), align=1)
    return context.get_dummy_value()


def _splat_i32(builder, value):
    v8_i32 = ir.VectorType(ir.IntType(32), LANES)
    one = builder.insert_element(ir.Constant(v8_i32, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(v8_i32, ir.Undefined), ir.Constant(v8_i32, [0] * LANES))


@intrinsic
def _q4_0_block_vector(typingctx, x, j0, out, o):
    """``_q4_0_block`` for a C-contiguous row x in explicit 8-wide vectors, with the same IEEE operations and
    choices (m the first value of largest magnitude, NaNs never chosen; +0 for a block of zeros) and so the same
    bytes."""
    _check_block_vector("_q4_0_block_vector", x, j0, out, o)
    return types.none(x, j0, out, o), _q4_0_vector_codegen


@kernel(inline=True, fastmath=EXACT)
def _q4_0_block(x, j0, out, o):
    """Values x[j0 .. j0+32] into the Q4_0 block at out[o]: d = m/-8 with m the first value of largest
    magnitude, q = min(15, trunc(x/d + 8.5)); value j in the low nibble of byte j, value j+16 in its high one."""
    amax = np.float32(0.0)
    m = np.float32(0.0)
    for j in range(BLOCK):
        v = to_f32(x[j0 + j])
        if amax < abs(v):
            amax = abs(v)
            m = v
    d = m / np.float32(-8.0)
    inv = np.float32(1.0) / d if d != 0.0 else np.float32(0.0)
    _store_scale(out, o, d)
    half = BLOCK // 2
    for j in range(half):
        low = min(15, np.int32(to_f32(x[j0 + j]) * inv + np.float32(8.5)))
        high = min(15, np.int32(to_f32(x[j0 + half + j]) * inv + np.float32(8.5)))
        out[o + 2 + j] = np.uint8(low | (high << 4))


@kernel(inline=True, fastmath=EXACT)
def _blocks_of_row(x, out, code):
    width = 34 if code == Q8_0 else 18
    for blk in range(x.shape[0] // BLOCK):
        if code == Q8_0:
            _q8_0_block(x, blk * BLOCK, out, blk * width)
        else:
            _q4_0_block(x, blk * BLOCK, out, blk * width)


@kernel(inline=True, fastmath=EXACT)
def _blocks_of_contiguous_row(x, out, code):
    if code == Q8_0:
        n_blocks = x.shape[0] // BLOCK
        blk = 0
        while blk + _GROUP <= n_blocks:
            _q8_0_blocks4_vector(x, blk * BLOCK, out, blk * Q8_0_BYTES)
            blk += _GROUP
        while blk < n_blocks:
            _q8_0_block_vector(x, blk * BLOCK, out, blk * Q8_0_BYTES)
            blk += 1
    else:
        for blk in range(x.shape[0] // BLOCK):
            _q4_0_block_vector(x, blk * BLOCK, out, blk * 18)


@kernel(llvm_inline=True, fastmath=EXACT)
def _quantize_any_row(x, out, code):
    """``quantize_row`` on rows typed any layout: compiled once per element type of x and shared by every kernel
    that quantizes (the callers' row types differ only in layout), then inlined by LLVM into each."""
    if x.strides[0] == x.itemsize:
        _blocks_of_contiguous_row(assume_contiguous(x), assume_contiguous(out), code)
    else:
        _blocks_of_row(x, assume_contiguous(out), code)


@kernel(inline=True, fastmath=EXACT)
def quantize_row(x, out, code):
    """One row of values (a multiple of 32) into its blocks of type ``code`` (Q8_0 or Q4_0) at ``out`` (bytes,
    contiguous); a unit-stride row is retyped contiguous and its blocks quantized in explicit vectors."""
    _quantize_any_row(any_layout(x), any_layout(out), code)


# ---------------------------------------------------------------------------------------------------------------
# Dequantization: a block of bytes widened to float32 in explicit vectors (quantized K/V in attention, dequantize).
#: The kernel dtype that names each quantized type.
_VIEW_DTYPES = {"q8_0": np.dtype(np.int8), "q4_0": np.dtype(np.uint8)}


def bytes_view(a: Quantized) -> np.ndarray:
    """The bytes of a quantized K or V as the kernels read them: int8 for Q8_0, uint8 for Q4_0."""
    return a.data.view(_VIEW_DTYPES[a.qtype])


def block_bytes_of(dtype) -> int:
    """Bytes per block of the quantized kernel dtype ``dtype``; 0 for a float (or float bits) dtype."""
    if dtype == types.int8:
        return Q8_0_BYTES
    if dtype == types.uint8:
        return Q4_0_BYTES
    return 0


def _widen_codegen(context, builder, signature, llargs):
    """LLVM IR widening one block (Q8_0 or Q4_0 by the bytes' dtype): the float16 scale, then 32 values as 4
    vectors of 8, multiplied by it and stored (LLVM does not vectorise the scalar loop across the int8 and float32
    arrays it cannot prove apart)."""
    f = context.make_array(signature.args[0])(context, builder, llargs[0])
    dst = context.make_array(signature.args[2])(context, builder, llargs[2])
    o = as_int64(context, builder, llargs[1], signature.args[1])
    d0 = as_int64(context, builder, llargs[3], signature.args[3])
    i8p = ir.IntType(8).as_pointer()
    start = builder.gep(builder.bitcast(f.data, i8p), [o])
    d, _ = block_scale(builder, start)
    out = builder.gep(dst.data, [d0])
    for part in range(4):  # 8 values at a time: 8-wide integer widening and conversion, one store each
        values = block_values(builder, signature.args[0].dtype, start, part)
        ptr = builder.bitcast(builder.gep(out, [const(8 * part)]), V8.as_pointer())
        builder.store(builder.fmul(values, d), ptr, align=4)
    return context.get_dummy_value()


def _check_widen(f, o, dst, d0, dtype):
    if not (isinstance(f, types.Array) and f.dtype == dtype and f.ndim == 1 and f.layout == "C"
            and isinstance(dst, types.Array) and dst.dtype == types.float32 and dst.ndim == 1 and dst.layout == "C"
            and isinstance(o, types.Integer) and isinstance(d0, types.Integer)):
        raise TypingError(f"expected 1-D C {dtype} bytes, an offset, 1-D C float32 and an offset")


@intrinsic
def _widen_q8_0_block(typingctx, f, o, dst, d0):
    """dst[d0 .. d0+32] = the Q8_0 block at byte o of f (int8 bytes, 1-D C), in float32."""
    _check_widen(f, o, dst, d0, types.int8)
    return types.none(f, o, dst, d0), _widen_codegen


@intrinsic
def _widen_q4_0_block(typingctx, f, o, dst, d0):
    """dst[d0 .. d0+32] = the Q4_0 block at byte o of f (uint8 bytes, 1-D C), in float32."""
    _check_widen(f, o, dst, d0, types.uint8)
    return types.none(f, o, dst, d0), _widen_codegen


@kernel(inline=True)
def _widen_q8_0_row(f, o, n_values, dst, d0):
    """dst[d0 .. d0+n_values] = the Q8_0 row whose first block is at byte o of f (int8 bytes)."""
    for blk in range(n_values // BLOCK):
        _widen_q8_0_block(f, o + blk * Q8_0_BYTES, dst, d0 + blk * BLOCK)


@kernel(inline=True)
def _widen_q4_0_row(f, o, n_values, dst, d0):
    """dst[d0 .. d0+n_values] = the Q4_0 row whose first block is at byte o of f (uint8 bytes)."""
    for blk in range(n_values // BLOCK):
        _widen_q4_0_block(f, o + blk * Q4_0_BYTES, dst, d0 + blk * BLOCK)


def widen_blocks(f, o, n_values, dst, d0):
    """dst[d0 .. d0+n_values] = the quantized row at byte o of f (Q8_0 for int8 bytes, Q4_0 for uint8).
    Kernel-only."""
    raise NotImplementedError


@overload(widen_blocks, inline="always")
def _widen_blocks_impl(f, o, n_values, dst, d0):
    if f.dtype == types.int8:
        return lambda f, o, n_values, dst, d0: _widen_q8_0_row(f, o, n_values, dst, d0)
    if f.dtype == types.uint8:
        return lambda f, o, n_values, dst, d0: _widen_q4_0_row(f, o, n_values, dst, d0)
    raise TypingError(f"widen_blocks: expected int8 (Q8_0) or uint8 (Q4_0) bytes, got {f}")


@kernel(fastmath=EXACT)
def _quantize_serial(x, data, code):
    for r in range(x.shape[0]):
        quantize_row(x[r], data[r], code)


@kernel(parallel=True, fastmath=EXACT)
def _quantize_parallel(x, data, code):
    for r in prange(x.shape[0]):
        quantize_row(x[r], data[r], code)


@kernel(fastmath=EXACT)
def _dequantize_serial(data, out):
    for r in range(data.shape[0]):
        widen_blocks(assume_contiguous(data[r]), 0, out.shape[1], assume_contiguous(out[r]), 0)


@kernel(parallel=True, fastmath=EXACT)
def _dequantize_parallel(data, out):
    for r in prange(data.shape[0]):
        widen_blocks(assume_contiguous(data[r]), 0, out.shape[1], assume_contiguous(out[r]), 0)


#: The (de)quantizers' input typed any layout (the values to quantize, the blocks to dequantize): one compilation
#: for contiguous and strided inputs; the outputs are new C-contiguous arrays.
_QUANTIZE_ARRAYS = argument_positions(_quantize_serial, "x")
_DEQUANTIZE_ARRAYS = argument_positions(_dequantize_serial, "data")


def _row_pairs(a: np.ndarray, b: np.ndarray) -> list:
    """(a rows, b rows): views of ``a`` and ``b`` (same leading shape) with their leading axes merged into one."""
    if a.ndim == 1:
        return [(a[None], b[None])]
    return [tuple(full) for full, _ in _layout.merge_leading([a, b], [], a.ndim - 1)]


def quantize(x: np.ndarray, qtype: str) -> Quantized:
    """Quantize ``x`` (..., n) float32 or float16, n a multiple of 32, into a new ``Quantized`` of ``qtype``
    ("q8_0" or "q4_0") with ggml's reference rounding (the bytes of ``fastattn.reference.quantize``). ``x`` may be
    any strided view."""
    x = values_array("x", x)
    if not isinstance(qtype, str) or qtype not in BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {tuple(BLOCK_BYTES)}, got {qtype!r}")
    data = np.empty(x.shape[:-1] + (x.shape[-1] // BLOCK * BLOCK_BYTES[qtype],), np.uint8)
    code = QTYPE_CODES[qtype]
    nbytes = x.size * (x.itemsize + 1)
    with _threads.team("quantize", nbytes, _threads.threads_for(nbytes)) as launch:
        for xr, dr in _row_pairs(kernel_view(x), data):
            call_any_layout(_quantize_parallel if launch.n > 1 else _quantize_serial, _QUANTIZE_ARRAYS, xr, dr, code)
    return Quantized(data, qtype)


def dequantize(a: Quantized) -> np.ndarray:
    """The float32 values of ``a`` in its logical shape (q · d per block, as ggml's dequantizers)."""
    a = quantized_array("a", a)
    out = np.empty(a.shape, np.float32)
    with _threads.team("dequantize", out.size * 5, _threads.threads_for(out.size * 5)) as launch:
        for dr, orow in _row_pairs(bytes_view(a), out):
            call_any_layout(_dequantize_parallel if launch.n > 1 else _dequantize_serial, _DEQUANTIZE_ARRAYS, dr, orow)
    return out

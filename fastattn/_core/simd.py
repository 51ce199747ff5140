"""LLVM IR building blocks for intrinsics that work on explicit float32 vectors (8 lanes, or 16 where ``wide_lanes``).

Numba's loops are vectorised by LLVM when it can prove they are safe and worth it; a loop that must hold
vector accumulators across an outer loop, or that runs over a short row many times (paying LLVM's runtime
overlap checks and set-up each time), is better written as an ``@intrinsic`` that emits the vector code
itself. These helpers are the pieces such intrinsics share (``rope.rotate``, ``attention.tiled``'s block
products).

Elements are addressed in the kernel dtypes of ``_core.kernel``: float32, float16 bits (``uint16``) and bfloat16 bits
(``int16``). ``load8`` widens 8 consecutive elements to ``<8 x float>`` (``vcvtph2ps`` for float16), ``store8``
narrows with round-to-nearest-even (bit-exact with NumPy's ``astype``, as ``_core.kernel.from_f32``). Arithmetic on
the vectors is plain IEEE (no fast-math flags) unless a caller adds them.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError

LANES = 8
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
V8 = ir.VectorType(ir.FloatType(), LANES)
_V8_I16 = ir.VectorType(I16, LANES)
_V8_I32 = ir.VectorType(I32, LANES)
#: The element types a kernel sees (``_core.kernel.kernel_view``): float32, float16 bits, bfloat16 bits.
KERNEL_DTYPES = (types.float32, types.uint16, types.int16)
#: The bytes of quantized rows (``quant.bytes_view``): Q8_0 as int8, Q4_0 as uint8 (blocks of ``quant.blocks.BLOCK``).
QUANT_DTYPES = (types.int8, types.uint8)


def check_array(name: str, arr, dtypes=KERNEL_DTYPES, ndim: int = 1) -> None:
    """Raise a TypingError unless ``arr`` is an ndim-D array (any layout) of one of ``dtypes``."""
    if not (isinstance(arr, types.Array) and arr.dtype in dtypes and arr.ndim == ndim):
        raise TypingError(f"{name}: expected a {ndim}-D array of {', '.join(map(str, dtypes))}, got {arr}")


def const(n: int):
    return ir.Constant(I64, n)


def as_int64(context, builder, value, typ):
    return context.cast(builder, value, typ, types.int64)


def element_stride(builder, arr, axis: int, dtype):
    """The stride of ``arr`` along ``axis`` in elements (Numba keeps it in bytes)."""
    return builder.sdiv(builder.extract_value(arr.strides, axis), const(dtype.bitwidth // 8))


def _vector_ptr(builder, data, offset, vector_type):
    return builder.bitcast(builder.gep(data, [offset]), vector_type.as_pointer())


def load8(builder, dtype, data, offset):
    """Elements offset .. offset+7 of ``data`` (a pointer to ``dtype`` elements) widened to <8 x float>."""
    return load_lanes(builder, dtype, data, offset, LANES)


def load_lanes(builder, dtype, data, offset, lanes: int):
    """Elements offset .. offset + lanes - 1 of ``data`` (a pointer to ``dtype`` elements) widened to a float
    vector of ``lanes`` lanes."""
    floats = ir.VectorType(ir.FloatType(), lanes)
    if dtype == types.float32:
        return builder.load(_vector_ptr(builder, data, offset, floats), align=4)
    i32s = ir.VectorType(I32, lanes)
    bits = builder.load(_vector_ptr(builder, data, offset, ir.VectorType(I16, lanes)), align=2)
    if dtype == types.uint16:  # float16
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), lanes)), floats)
    wide = builder.shl(builder.zext(bits, i32s), ir.Constant(i32s, [16] * lanes))  # bfloat16
    return builder.bitcast(wide, floats)


def widen(builder, value, dtype):
    """One element ``value`` of kernel dtype ``dtype`` (float32, float16 bits, bfloat16 bits) as float, exactly."""
    if dtype == types.float32:
        return value
    if dtype == types.uint16:
        return builder.fpext(builder.bitcast(value, ir.HalfType()), ir.FloatType())
    return builder.bitcast(builder.shl(builder.zext(value, I32), ir.Constant(I32, 16)), ir.FloatType())


def load1(builder, dtype, data, offset):
    """Element ``offset`` of ``data`` (a pointer to ``dtype`` elements) widened to float."""
    return widen(builder, builder.load(builder.gep(data, [offset]), align=dtype.bitwidth // 8), dtype)


def hsum(builder, v):
    """The sum of the 8 lanes of ``v``: halves added pairwise (4 + 4, 2 + 2, 1 + 1)."""
    undef = ir.Constant(V8, ir.Undefined)
    v4 = builder.fadd(shuffle(builder, v, undef, [0, 1, 2, 3]), shuffle(builder, v, undef, [4, 5, 6, 7]))
    undef4 = ir.Constant(v4.type, ir.Undefined)
    v2 = builder.fadd(shuffle(builder, v4, undef4, [0, 1]), shuffle(builder, v4, undef4, [2, 3]))
    return builder.fadd(builder.extract_element(v2, ir.Constant(I32, 0)),
                        builder.extract_element(v2, ir.Constant(I32, 1)))


def fma(builder, a, b, c):
    """a * b + c, rounded once (``llvm.fma`` on float or a float vector)."""
    name = f"llvm.fma.v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "llvm.fma.f32"
    fn = builder.module.declare_intrinsic(name, (), ir.FunctionType(a.type, [a.type] * 3))
    return builder.call(fn, [a, b, c])


def store8(builder, dtype, data, offset, value):
    """Store <8 x float> ``value`` to elements offset .. offset+7 of ``data``, narrowed to ``dtype`` (round to
    nearest even; a bfloat16 NaN stays a quiet NaN)."""
    if dtype == types.float32:
        builder.store(value, _vector_ptr(builder, data, offset, V8), align=4)
        return
    if dtype == types.uint16:
        bits = builder.bitcast(builder.fptrunc(value, ir.VectorType(ir.HalfType(), LANES)), _V8_I16)
    else:
        wide = builder.bitcast(value, _V8_I32)
        lsb = builder.and_(builder.lshr(wide, splat_int(builder, 16)), splat_int(builder, 1))
        rounded = builder.add(wide, builder.add(lsb, splat_int(builder, 0x7FFF)))
        quiet_nan = builder.or_(wide, splat_int(builder, 0x400000))
        chosen = builder.select(builder.fcmp_unordered("uno", value, value), quiet_nan, rounded)
        bits = builder.trunc(builder.lshr(chosen, splat_int(builder, 16)), _V8_I16)
    builder.store(bits, _vector_ptr(builder, data, offset, _V8_I16), align=2)


def prefetch_line(builder, pointer):
    """``prefetcht0`` of the cache line holding ``pointer`` (a hint: never faults, any address)."""
    i32 = ir.IntType(32)
    fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
        ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]))
    builder.call(fn, [builder.bitcast(pointer, ir.IntType(8).as_pointer()), ir.Constant(i32, 0),
                      ir.Constant(i32, 3), ir.Constant(i32, 1)])


def splat_int(builder, n: int):
    return ir.Constant(_V8_I32, [n] * LANES)


def shuffle(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(lanes)), lanes))


def splat(builder, x, lanes: int = LANES):
    """A float vector of ``lanes`` (8 by default) lanes, each ``x``."""
    vector = ir.VectorType(ir.FloatType(), lanes)
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), x, ir.Constant(I32, 0))
    return shuffle(builder, one, ir.Constant(vector, ir.Undefined), [0] * lanes)


def loop(builder, start, stop, step, carried, body):
    """``for i in range(start, stop, step): carried = body(i, carried)``, the carried LLVM values in registers
    (phis); returns their final values. ``body`` may emit loops of its own."""
    entry = builder.basic_block
    head = builder.append_basic_block("loop.head")
    block = builder.append_basic_block("loop.body")
    done = builder.append_basic_block("loop.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(I64)
    i.add_incoming(start, entry)
    phis = [builder.phi(v.type) for v in carried]
    for phi, v in zip(phis, carried):
        phi.add_incoming(v, entry)
    builder.cbranch(builder.icmp_signed("<", i, stop), block, done)
    builder.position_at_end(block)
    updated = body(i, phis)
    end = builder.basic_block
    for phi, v in zip(phis, updated):
        phi.add_incoming(v, end)
    i.add_incoming(builder.add(i, step), end)
    builder.branch(head)
    builder.position_at_end(done)
    return phis


def block_scale(builder, start, lanes: int = LANES):
    """The float16 scale d of the Q8_0/Q4_0 block at ``start`` (an i8 pointer): (a vector of ``lanes`` d, d). The
    first 4 half words are converted as a vector and lane 0 taken (one ``vcvtph2ps`` from memory; a scalar half
    load becomes a ``vpinsrw`` into the previous block's register, chaining the blocks)."""
    v4_half = ir.VectorType(ir.HalfType(), 4)
    head = builder.fpext(builder.load(builder.bitcast(start, v4_half.as_pointer()), align=1),
                         ir.VectorType(ir.FloatType(), 4))
    return shuffle(builder, head, head, [0] * lanes), builder.extract_element(head, ir.Constant(I32, 0))


def block_values(builder, dtype, start, part: int, lanes: int = LANES):
    """Values lanes·part .. lanes·part + lanes - 1 (``lanes`` 8 or 16) of the block at ``start`` (an i8 pointer)
    as a float vector, before the scale: Q8_0 (``dtype`` int8) its int8 q, Q4_0 (uint8) its nibble - 8 (byte j
    holds value j in its low nibble and value j + 16 in its high one)."""
    i8s = ir.VectorType(ir.IntType(8), lanes)
    i32s = ir.VectorType(I32, lanes)
    first = lanes * part
    if dtype == types.int8:
        ints = builder.sext(builder.load(_vector_ptr(builder, start, const(2 + first), i8s), align=1), i32s)
    else:
        packed = builder.zext(builder.load(_vector_ptr(builder, start, const(2 + first % 16), i8s), align=1), i32s)
        nibble = (builder.and_(packed, ir.Constant(i32s, [15] * lanes)) if first < 16
                  else builder.lshr(packed, ir.Constant(i32s, [4] * lanes)))
        ints = builder.sub(nibble, ir.Constant(i32s, [8] * lanes))
    return builder.sitofp(ints, ir.VectorType(ir.FloatType(), lanes))


def load_floats(builder, data, offset, lanes: int):
    """Float elements offset .. offset + lanes - 1 of ``data`` (a float pointer) as a vector."""
    return builder.load(_vector_ptr(builder, data, offset, ir.VectorType(ir.FloatType(), lanes)), align=4)


def hsum_any(builder, v):
    """The sum of the lanes of ``v`` (8 or 16): 16 lanes halved to 8 first, then ``hsum``."""
    if v.type.count == 16:
        undef = ir.Constant(v.type, ir.Undefined)
        v = builder.fadd(shuffle(builder, v, undef, list(range(8))), shuffle(builder, v, undef, list(range(8, 16))))
    return hsum(builder, v)


def hsum_many(builder, vectors):
    """The lane sums of ``vectors`` (a power of two of them, all of 8 or of 16 lanes) as scalars, each the same sum
    ``hsum_any`` gives (halves added pairwise: lane i + lane i + width/2, down to one lane), computed side by side:
    at each level two vectors' halved segments are packed into one vector and added with one instruction, so n sums
    cost about n adds and 2n shuffles where ``hsum_any`` spends four adds and four shuffles or extracts on each."""
    width = vectors[0].type.count
    if len(vectors) > width:
        return [s for at in range(0, len(vectors), width) for s in hsum_many(builder, vectors[at:at + width])]
    count = len(vectors)
    segment = width  # the vectors hold their sums' partials in segments of this many lanes, in order

    def halves(per_vector):
        half = segment // 2
        lo = [j * segment + t for j in range(per_vector) for t in range(half)]
        return lo, [i + half for i in lo]

    while len(vectors) > 1:
        lo, hi = halves(width // segment)
        vectors = [builder.fadd(shuffle(builder, x, y, lo + [width + i for i in lo]),
                                shuffle(builder, x, y, hi + [width + i for i in hi]))
                   for x, y in zip(vectors[0::2], vectors[1::2])]
        segment //= 2
    packed = vectors[0]
    while segment > 1:  # one vector left: halve its segments in place (the upper lanes are don't-cares)
        lo, hi = halves(count)
        filler = list(range(width - len(lo)))
        packed = builder.fadd(shuffle(builder, packed, packed, lo + filler),
                              shuffle(builder, packed, packed, hi + filler))
        segment //= 2
    return [builder.extract_element(packed, ir.Constant(I32, j)) for j in range(count)]


def wide_lanes() -> int:
    """Float lanes per vector for code whose accumulators fit in 32 registers: 16 where Numba's target has
    AVX-512 (32 zmm registers), else 8 (a <16 x float> on AVX2 would take two of its 16 ymm registers)."""
    from numba.core.registry import cpu_target
    features = getattr(cpu_target.target_context.codegen(), "_tm_features", None)
    if features is None:  # the features Numba compiles for: NUMBA_CPU_FEATURES, else the host's
        from llvmlite import binding
        from numba.core import config
        features = config.CPU_FEATURES or binding.get_host_cpu_features().flatten()
    return 16 if "+avx512f" in features else LANES

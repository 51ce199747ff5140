"""Quantized K/V (Q8_0, Q4_0) in the attention kernels: rows read in place or widened into float32 scratch.

A ``Quantized`` K or V reaches the kernels as its bytes, and, as for float16 and bfloat16, the *integer type
names the format* (``quant.bytes_view``):

    q8_0 -> ``int8`` view of the bytes      34-byte blocks: float16 d, 32 int8 q       value = q · d
    q4_0 -> ``uint8`` view of the bytes     18-byte blocks: float16 d, 16 nibble bytes  value = (nibble - 8) · d

so the flat views, offsets and strides of ``attention.layout`` work unchanged, counted in bytes (a row of D values
is D / 32 blocks; its last axis is contiguous by ``Quantized``'s rule).

The one_chunk and split_kv loops (``attention.group``) read quantized rows in place: the row intrinsics of
``attention.rows`` widen each block's 32 values in registers and multiply them by the block's scale once for
the group's query heads (K: q · (d k), V: p · (d v)). So each K/V row is dequantized once per query row and GQA
group (not once per query head as in ggml), Q is never rounded, and the arithmetic is float32 throughout. Under
a mask with a row per head, V rows are widened into a float32 scratch first (``v_block_rows``:
``attention.nonfinite`` copies and zeroes float rows). ``q · d`` of a Q8_0 or Q4_0
value is exact in float32 (at most 8 + 11 significant bits), so widened values are exactly the reference's
``dequantize``.

``widen_rows`` does the same for the tiled path's K and V tiles (a tile's rows into a float32 scratch).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from .layout import FlatRows
from .rows import ROWS
from .softmax import live_rows
from .._core.kernel import assume_contiguous, kernel, to_f32
from ..quant.blocks import BLOCK
from .._core.simd import KERNEL_DTYPES, const, load1, load_lanes, loop, wide_lanes
from ..quant.api import block_bytes_of, widen_blocks

_INF = np.float32(np.inf)

def row_elements(f, n_values):
    """Elements of ``f`` one row of ``n_values`` values spans: n_values for float data, its blocks' bytes for
    quantized data (the prefetch distance and lines of a row). Kernel-only."""
    raise NotImplementedError


@overload(row_elements, inline="always")
def _row_elements(f, n_values):
    width = block_bytes_of(f.dtype)
    if width:
        return lambda f, n_values: n_values // BLOCK * width
    return lambda f, n_values: n_values


def row_scratch(vf, dv, per_head_mask):
    """Float32 scratch for one block of V rows widened for ``sanitised_rows`` (quantized V under a mask with a row
    per head: ``per_head_mask`` not None): ROWS rows; otherwise an empty view of vf. Kernel-only."""
    raise NotImplementedError


@overload(row_scratch, inline="always")
def _row_scratch(vf, dv, per_head_mask):
    if block_bytes_of(vf.dtype) and not isinstance(per_head_mask, types.NoneType):
        return lambda vf, dv, per_head_mask: np.empty(ROWS * dv, np.float32)
    return lambda vf, dv, per_head_mask: vf[:0]  # unused: an empty view, nothing allocated


def v_block_rows(rows_at, n_values, jb, sc, n, every, rows, scratch, per_head_mask):
    """V rows jb .. jb+n of a block as the row updates read them. ``rows_at``: the rows as stored
    (``attention.layout.FlatRows``). Float data, and quantized data without a per-head mask (``per_head_mask``
    None): ``rows_at`` itself (quantized rows are widened in registers). Quantized data under a per-head mask
    (whose non-finite rows ``sanitised_rows`` copies and zeroes as float32): the rows r where some head's sc[:, r]
    is not 0 (all n when ``every``; listed in ``rows``) are widened into ``scratch`` (row jb + r at r · n_values)
    and FlatRows(scratch, -jb · n_values, n_values, 1) is returned, so row j is again at
    ``base + j * row_stride``; the other rows are not read. Kernel-only."""
    raise NotImplementedError


@kernel
def _widen_block(f, base, rs, n_values, jb, sc, n, every, rows, scratch):
    """``v_block_rows``' widening of quantized rows (a call: inlined, its loops confused Numba's inliner)."""
    for x in range(live_rows(sc, 0, sc.shape[0], n, every, np.float32(0.0), rows)):
        r = rows[x]
        widen_blocks(f, base + (jb + r) * rs, n_values, scratch, r * n_values)


@overload(v_block_rows, inline="always")
def _v_block_rows(rows_at, n_values, jb, sc, n, every, rows, scratch, per_head_mask):
    if not isinstance(rows_at, types.BaseTuple):
        raise TypingError("v_block_rows: expected FlatRows")
    if block_bytes_of(rows_at.types[0].dtype) and not isinstance(per_head_mask, types.NoneType):
        def widen(rows_at, n_values, jb, sc, n, every, rows, scratch, per_head_mask):
            _widen_block(rows_at.flat, rows_at.base, rows_at.row_stride, n_values, jb, sc, n, every, rows, scratch)
            return FlatRows(scratch, -jb * n_values, n_values, 1)
        return widen
    return lambda rows_at, n_values, jb, sc, n, every, rows, scratch, per_head_mask: rows_at


def _nonfinite(builder, x):
    """|x| >= inf or x NaN (``fcmp uge``, no fast-math flags), lane by lane for a vector."""
    name = f"llvm.fabs.v{x.type.count}f32" if isinstance(x.type, ir.VectorType) else "llvm.fabs.f32"
    fabs = builder.module.declare_intrinsic(name, (), ir.FunctionType(x.type, [x.type]))
    inf = ir.Constant(x.type, [float("inf")] * x.type.count if isinstance(x.type, ir.VectorType) else float("inf"))
    return builder.fcmp_unordered(">=", builder.call(fabs, [x]), inf)


def _any_lane(builder, mask):
    """Whether any lane of the i1 vector ``mask`` is set."""
    bits = ir.IntType(mask.type.count)
    return builder.icmp_unsigned("!=", builder.bitcast(mask, bits), ir.Constant(bits, 0))


@intrinsic
def _widen_floats(typingctx, src, dst, n):
    """dst[:n] = src[:n] widened to float32 (src 1-D C float32, float16 bits or bfloat16 bits; dst 1-D C float32);
    returns whether a value is an inf or NaN. In vectors of ``wide_lanes()`` (one load, one conversion and one
    store per vector, where a Numba loop with the check compiled to scalar half conversions)."""
    if not (isinstance(src, types.Array) and src.dtype in KERNEL_DTYPES and src.ndim == 1 and src.layout == "C"
            and isinstance(dst, types.Array) and dst.dtype == types.float32 and dst.ndim == 1
            and dst.layout == "C" and isinstance(n, types.Integer)):
        raise TypingError(f"_widen_floats: expected 1-D C src of {KERNEL_DTYPES}, 1-D C float32 dst and an "
                          f"integer count; got {src}, {dst}, {n}")

    def codegen(context, builder, signature, args):
        src_t, dst_t, n_t = signature.args
        a = context.make_array(src_t)(context, builder, args[0])
        b = context.make_array(dst_t)(context, builder, args[1])
        count = context.cast(builder, args[2], n_t, types.int64)
        lanes = wide_lanes()
        vector = ir.VectorType(ir.FloatType(), lanes)
        no = ir.Constant(ir.VectorType(ir.IntType(1), lanes), [0] * lanes)

        def vector_step(d, carried):
            x = load_lanes(builder, src_t.dtype, a.data, d, lanes)
            builder.store(x, builder.bitcast(builder.gep(b.data, [d]), vector.as_pointer()), align=4)
            return [builder.or_(carried[0], _nonfinite(builder, x))]

        n_vector = builder.and_(count, const(-lanes))
        bad_lanes = loop(builder, const(0), n_vector, const(lanes), [no], vector_step)[0]

        def scalar_step(d, carried):
            x = load1(builder, src_t.dtype, a.data, d)
            builder.store(x, builder.gep(b.data, [d]), align=4)
            return [builder.or_(carried[0], _nonfinite(builder, x))]

        tail = loop(builder, n_vector, count, const(1), [_any_lane(builder, bad_lanes)], scalar_step)[0]
        return tail

    return types.boolean(src, dst, n), codegen


@kernel
def _widen_float_rows(plane, j0, n, dst):
    """``widen_rows`` for float32, float16 and bfloat16 rows."""
    bad = False
    for jj in range(n):
        src = plane[j0 + jj]
        row = dst[jj]
        if src.strides[0] == src.itemsize:
            bad |= _widen_floats(assume_contiguous(src), row, src.shape[0])
        else:
            for d in range(src.shape[0]):
                x = to_f32(src[d])
                row[d] = x
                bad |= not abs(x) < _INF
    return bad


@kernel
def _widen_quantized_rows(plane, j0, n, dst, n_values):
    """``widen_rows`` for Q8_0 and Q4_0 rows of ``n_values`` values (their bytes; the last axis contiguous by
    ``Quantized``'s rule)."""
    bad = False
    for jj in range(n):
        row = dst[jj]
        widen_blocks(assume_contiguous(plane[j0 + jj]), 0, n_values, row, 0)
        bad |= _widen_floats(row, row, n_values)  # float32 in place: the finite check alone
    return bad


def widen_rows(plane, j0, n, dst):
    """dst[jj, :] = the float32 values of row j0 + jj of ``plane`` (2-D: rows of float32, float16/bfloat16 bits, or
    the bytes of Q8_0 or Q4_0 rows) for jj < n, ``dst`` a C-contiguous float32 scratch of at least n rows of the
    row's values; returns whether a value is an inf or NaN (a comparison: fast-math folds sums like acc + (x - x)
    to acc). One call per tile: contiguous rows take ``_widen_floats``' vector loop. Kernel-only."""
    raise NotImplementedError


@overload(widen_rows)
def _widen_rows(plane, j0, n, dst):
    width = block_bytes_of(plane.dtype)
    if width:
        return lambda plane, j0, n, dst: _widen_quantized_rows(plane, j0, n, dst, plane.shape[1] // width * BLOCK)
    return lambda plane, j0, n, dst: _widen_float_rows(plane, j0, n, dst)

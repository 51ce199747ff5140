"""The RoPE rotation of one token's head rows (H, D): explicit 8-wide vector code, and scalar loops for the rest.

``rotate_rows_split(src, dst, cos, sin, ahead)`` (NEOX pairing) and ``rotate_rows_adjacent(src, dst, cos, sin,
ahead)`` (NORMAL pairing) rotate every row h of ``src`` (H, D) into the same row of ``dst``, for the pairs of
the whole chunks of 8: p < 8·(n_pairs // 8) with n_pairs = len(cos). For pair p with angle (cos[p], sin[p]):

    NEOX   (a, b) = (row[p], row[p + n_pairs])      NORMAL   (a, b) = (row[2p], row[2p + 1])
    a' = a·cos − b·sin,  b' = a·sin + b·cos    (float32, every product rounded on its own: no FMA)

``ahead`` != 0 also asks for (``prefetcht0``) the D elements ``ahead`` elements past each src row before
rotating it, e.g. the same row of a later token (``rope.drivers._rows_ahead`` says when). NORMAL loads 16 dims
as two vectors, splits them into the a and b lanes and interleaves the results back with shuffles. src and dst
may be the same array (in place: each chunk is read before it is written) or arrays of different kernel dtypes
(float32 / float16 bits / bfloat16 bits: widened on load, rounded to nearest even on store); their rows may lie
anywhere, but each row's elements must be adjacent, as must cos and sin's (``token_layout`` tells).

``rope_block`` rotates a whole token: the vector code for the chunks of 8, then scalar loops for the pairs past
the last whole chunk and the dims past the rotated span (copied out of place, left alone in place); rows whose
elements are not adjacent take strided scalar loops.

Why intrinsics: written as Numba loops, each (row, 64 pairs) paid LLVM's runtime overlap checks and loop set-up
on top of its 8 vector iterations, about as much again as the work; here a token's rows are one loop nest with
nothing but the arithmetic inside.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from .._core.kernel import KERNEL_OPTIONS, from_f32, kernel, to_f32
from .._core.simd import (LANES, as_int64, check_array, const, element_stride, load8, loop, prefetch_line, shuffle,
                          store8)


def _rotation_codegen(adjacent: bool):
    def codegen(context, builder, signature, args):
        src, dst, cos, sin = (context.make_array(t)(context, builder, v)
                              for t, v in zip(signature.args[:4], args[:4]))
        ahead = as_int64(context, builder, args[4], signature.args[4])
        s_type, d_type = signature.args[0].dtype, signature.args[1].dtype
        row_len = builder.extract_value(src.shape, 1)
        line = const(64 // (s_type.bitwidth // 8))  # elements per cache line
        n_rows = builder.extract_value(src.shape, 0)
        n_pairs = builder.extract_value(cos.shape, 0)
        n_chunks = builder.sdiv(n_pairs, const(LANES))
        s_rs = element_stride(builder, src, 0, s_type)
        d_rs = element_stride(builder, dst, 0, d_type)

        def angles(p):
            return (load8(builder, types.float32, arr.data, p) for arr in (cos, sin))

        def rotate(a, b, c, s):
            return (builder.fsub(builder.fmul(a, c), builder.fmul(b, s)),
                    builder.fadd(builder.fmul(a, s), builder.fmul(b, c)))

        def row(h, _):
            s0 = builder.mul(h, s_rs)
            d0 = builder.mul(h, d_rs)
            with builder.if_then(builder.icmp_signed("!=", ahead, const(0))):
                def fetch(k, _):
                    prefetch_line(builder, builder.gep(src.data, [builder.add(builder.add(s0, ahead), k)]))
                    return []
                loop(builder, const(0), as_int64(context, builder, row_len, types.intp), line, [], fetch)

            def chunk(k, _):
                p = builder.mul(k, const(LANES))
                c, s = angles(p)
                if adjacent:
                    lo = builder.add(p, p)  # dims 2p .. 2p+15
                    hi = builder.add(lo, const(LANES))
                    x0 = load8(builder, s_type, src.data, builder.add(s0, lo))
                    x1 = load8(builder, s_type, src.data, builder.add(s0, hi))
                    a = shuffle(builder, x0, x1, list(range(0, 16, 2)))
                    b = shuffle(builder, x0, x1, list(range(1, 16, 2)))
                    first, second = rotate(a, b, c, s)
                    y0 = shuffle(builder, first, second, [0, 8, 1, 9, 2, 10, 3, 11])
                    y1 = shuffle(builder, first, second, [4, 12, 5, 13, 6, 14, 7, 15])
                    store8(builder, d_type, dst.data, builder.add(d0, lo), y0)
                    store8(builder, d_type, dst.data, builder.add(d0, hi), y1)
                else:
                    q = builder.add(p, n_pairs)
                    a = load8(builder, s_type, src.data, builder.add(s0, p))
                    b = load8(builder, s_type, src.data, builder.add(s0, q))
                    first, second = rotate(a, b, c, s)
                    store8(builder, d_type, dst.data, builder.add(d0, p), first)
                    store8(builder, d_type, dst.data, builder.add(d0, q), second)
                return []

            loop(builder, const(0), n_chunks, const(1), [], chunk)
            return []

        loop(builder, const(0), as_int64(context, builder, n_rows, types.intp), const(1), [], row)
        return context.get_dummy_value()

    return codegen


def _typer(name, adjacent):
    def typer(typingctx, src, dst, cos, sin, ahead):
        check_array(f"{name} src", src, ndim=2)
        check_array(f"{name} dst", dst, ndim=2)
        check_array(f"{name} cos", cos, (types.float32,))
        check_array(f"{name} sin", sin, (types.float32,))
        if not isinstance(ahead, types.Integer):
            raise TypingError(f"{name} ahead: expected an integer, got {ahead}")
        return types.none(src, dst, cos, sin, ahead), _rotation_codegen(adjacent)
    typer.__name__ = name
    typer.__doc__ = f"Rotate the whole chunks of 8 pairs of every row of src into dst ({name}: module docstring)."
    return typer


rotate_rows_split = intrinsic(_typer("rotate_rows_split", adjacent=False))
rotate_rows_adjacent = intrinsic(_typer("rotate_rows_adjacent", adjacent=True))


# ---------------------------------------------------------------------------------------------------------------
# A token's rows, whole: the vector code above for the chunks of 8 pairs, scalar loops for the rest and for rows
# whose elements are not adjacent. Helpers are inlined into the drivers (a call per head row costs as much as its
# work). No FMA contraction or reassociation here: a*c - b*s could contract either way, differently in the vectorised
# body, the scalar remainder and the serial and parallel builds; with every product rounded on its own the
# result is bit-identical across layouts and thread counts (and the op stays memory-bound).
ROTATION_FASTMATH = frozenset({"nsz", "arcp"})
#: The options of the overloads that pick a step by argument type: compiled as functions of their own, not inlined
#: (Numba compiles an inlined overload's implementation anyway, then types it again inside every caller); cached
#: within their callers.
PICK_OPTIONS = {key: value for key, value in KERNEL_OPTIONS.items() if key != "cache"} | {
    "fastmath": set(ROTATION_FASTMATH)}


def _store(v, like):
    """Element ``v`` (float32, or float16/bfloat16 bits) as ``like``'s element type: raw when the types match."""
    raise NotImplementedError


@overload(_store, inline="always")
def _store_impl(v, like):
    if v == like.dtype:
        return lambda v, like: v
    return lambda v, like: from_f32(to_f32(v), like)


@kernel(fastmath=ROTATION_FASTMATH)
def _rotate_in_place(row, cos, sin, n_pairs, interleaved):
    """Rotate the pairs of ``row`` (D,) in place with one token's cos/sin (each pair is read before written)."""
    if interleaved:
        for p in range(n_pairs):
            a = to_f32(row[2 * p])
            b = to_f32(row[2 * p + 1])
            row[2 * p] = from_f32(a * cos[p] - b * sin[p], row)
            row[2 * p + 1] = from_f32(a * sin[p] + b * cos[p], row)
    else:
        first = row[:n_pairs]
        second = row[n_pairs:2 * n_pairs]
        for p in range(n_pairs):
            a = to_f32(first[p])
            b = to_f32(second[p])
            first[p] = from_f32(a * cos[p] - b * sin[p], row)
            second[p] = from_f32(a * sin[p] + b * cos[p], row)


@kernel(fastmath=ROTATION_FASTMATH)
def _rotate_into(src, dst, cos, sin, n_pairs, interleaved):
    """dst = rope(src) for separate rows of any element types: widened, rotated in float32, narrowed once."""
    if interleaved:
        for p in range(n_pairs):
            a = to_f32(src[2 * p])
            b = to_f32(src[2 * p + 1])
            dst[2 * p] = from_f32(a * cos[p] - b * sin[p], dst)
            dst[2 * p + 1] = from_f32(a * sin[p] + b * cos[p], dst)
    else:
        src_first = src[:n_pairs]
        src_second = src[n_pairs:2 * n_pairs]
        dst_first = dst[:n_pairs]
        dst_second = dst[n_pairs:2 * n_pairs]
        for p in range(n_pairs):
            a = to_f32(src_first[p])
            b = to_f32(src_second[p])
            dst_first[p] = from_f32(a * cos[p] - b * sin[p], dst)
            dst_second[p] = from_f32(a * sin[p] + b * cos[p], dst)


@kernel(fastmath=ROTATION_FASTMATH)
def _copy_tail(src, dst, start):
    """dst[start:] = src[start:] (converted if the types differ): the dims past the rotated span."""
    src_tail = src[start:]
    dst_tail = dst[start:]
    for j in range(src_tail.shape[0]):
        dst_tail[j] = _store(src_tail[j], dst)


@kernel(fastmath=ROTATION_FASTMATH)
def _rotate_rest(src, dst, cos, sin, done, n_pairs, interleaved, in_place):
    """Pairs done .. n_pairs of one row (at most 7: those past the vector code's whole chunks), then, out of place,
    the dims past the rotated span."""
    if done < n_pairs:
        rest = n_pairs - done
        if interleaved:  # passed on as the variable (True here): a literal True would compile the callee again
            if in_place:
                _rotate_in_place(dst[2 * done:2 * n_pairs], cos[done:], sin[done:], rest, interleaved)
            else:
                _rotate_into(src[2 * done:2 * n_pairs], dst[2 * done:2 * n_pairs], cos[done:], sin[done:], rest,
                             interleaved)
        else:
            for p in range(rest):  # the two halves of a split row are n_pairs apart: a few scalar pairs
                a = to_f32(src[done + p])
                b = to_f32(src[n_pairs + done + p])
                dst[done + p] = from_f32(a * cos[done + p] - b * sin[done + p], dst)
                dst[n_pairs + done + p] = from_f32(a * sin[done + p] + b * cos[done + p], dst)
    if not in_place:
        _copy_tail(src, dst, 2 * n_pairs)


#: Layouts of one token's (H, D) head rows (``token_layout``), a run-time argument of the drivers.
ROWS_STRIDED = 0  # elements of a row not adjacent: strided loops
ROWS_UNIT = 1  # rows of adjacent elements, heads apart (e.g. a partial-head view)
TOKEN_BLOCK = 2  # the H rows adjacent too (contiguous x, Q or K of a fused QKV buffer)


def token_layout(a: np.ndarray, b: np.ndarray) -> int:
    """The layout the (H, D) rows of ``a`` and ``b`` (..., H, D) share, from their last two strides."""
    strides_a, item_a = a.strides, a.itemsize  # each ``strides`` read builds a tuple: read once
    strides_b, item_b = (strides_a, item_a) if b is a else (b.strides, b.itemsize)
    if strides_a[-1] != item_a or strides_b[-1] != item_b:
        return ROWS_STRIDED
    if strides_a[-2] == a.shape[-1] * item_a and strides_b[-2] == b.shape[-1] * item_b:
        return TOKEN_BLOCK
    return ROWS_UNIT


@kernel(fastmath=ROTATION_FASTMATH)
def rope_block(src, dst, cache_row, n_pairs, interleaved, in_place, layout, ahead):
    """One token's head rows src, dst (H, D) (the same memory in place) with its cache row (cos then sin).

    Rows of adjacent elements (any row stride) take the vector code (``rope.rotate``) for the whole chunks of 8
    pairs of every row at once, then the scalar rest; rows with strided elements take strided scalar loops.
    ``ahead`` != 0: the vector code prefetches each row's D elements that far past it (``_rows_ahead``)."""
    cos = cache_row[:n_pairs]
    sin = cache_row[n_pairs:2 * n_pairs]
    if layout == ROWS_STRIDED:
        for h in range(src.shape[0]):
            if in_place:
                _rotate_in_place(dst[h], cos, sin, n_pairs, interleaved)
            else:
                _rotate_into(src[h], dst[h], cos, sin, n_pairs, interleaved)
                _copy_tail(src[h], dst[h], 2 * n_pairs)
        return
    if interleaved:
        rotate_rows_adjacent(src, dst, cos, sin, ahead)
    else:
        rotate_rows_split(src, dst, cos, sin, ahead)
    done = n_pairs // LANES * LANES
    if done < n_pairs or (2 * n_pairs < src.shape[1] and not in_place):
        for h in range(src.shape[0]):
            _rotate_rest(src[h], dst[h], cos, sin, done, n_pairs, interleaved, in_place)

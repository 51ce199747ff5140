"""The RoPE rotation of a token's head rows, as explicit 8-wide vector code (``_simd``).

``rotate_rows_split(src, dst, cos, sin, ahead)`` (NEOX pairing) and ``rotate_rows_adjacent(src, dst, cos, sin,
ahead)`` (NORMAL pairing) rotate every row h of ``src`` (H, D) into the same row of ``dst``, for the pairs of
the whole chunks of 8: p < 8·(n_pairs // 8) with n_pairs = len(cos). For pair p with angle (cos[p], sin[p]):

    NEOX   (a, b) = (row[p], row[p + n_pairs])      NORMAL   (a, b) = (row[2p], row[2p + 1])
    a' = a·cos − b·sin,  b' = a·sin + b·cos    (float32, every product rounded on its own: no FMA)

The remaining pairs and the dims past the rotated span are the caller's. ``ahead`` != 0 also asks for
(``prefetcht0``) the D elements ``ahead`` elements past each src row before rotating it, e.g. the same row of
the next token (``rope._rotate_step`` says when). NORMAL loads 16 dims as two vectors,
splits them into the a and b lanes and interleaves the results back with shuffles.

src and dst may be the same array (in place: each chunk is read before it is written) or different arrays of
different kernel dtypes (float32 / float16 bits / bfloat16 bits: widened on load, rounded to nearest even on
store). Their rows may lie anywhere (any row stride, negative included); each row's elements must be adjacent,
as must cos and sin's (1-D float32, e.g. slices of a cache row): the caller checks (``rope.token_layout``).

Why: written as Numba loops, each (row, 64 pairs) cost LLVM's runtime overlap checks and loop set-up on top of
its 8 vector iterations, about as much again as the work; here a token's 32 rows are one loop nest with nothing
but the arithmetic inside (docs/rope.md has the measurements).
"""
from __future__ import annotations

from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ._simd import (LANES, as_int64, check_array, const, element_stride, load8, loop, prefetch_line, shuffle,
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

"""Quantized K/V (Q8_0, Q4_0) in the attention kernels: rows read in place or widened into float32 scratch.

A ``Quantized`` K or V reaches the kernels as its bytes, and, as for float16 and bfloat16, the *integer type
names the format* (``quant.bytes_view``):

    q8_0 -> ``int8`` view of the bytes      34-byte blocks: float16 d, 32 int8 q       value = q · d
    q4_0 -> ``uint8`` view of the bytes     18-byte blocks: float16 d, 16 nibble bytes  value = (nibble - 8) · d

so the flat views, offsets and strides of ``_attention_layout`` work unchanged, counted in bytes (a row of D values
is D / 32 blocks; its last axis is contiguous by ``Quantized``'s rule).

The one_chunk and split_kv loops (``_attention_group``) read quantized rows in place: the row intrinsics of
``_attention_rows`` widen each block's 32 values in registers and multiply them by the block's scale once for
the group's query heads (K: q · (d k), V: p · (d v)). So each K/V row is dequantized once per query row and GQA
group (not once per query head as in ggml), Q is never rounded, and the arithmetic is float32 throughout. Under
a mask with a row per head, V rows are widened into a float32 scratch first (``v_block_rows``:
``_attention_nonfinite`` copies and zeroes float rows). ``q · d`` of a Q8_0 or Q4_0
value is exact in float32 (at most 8 + 11 significant bits), so widened values are exactly the reference's
``dequantize``.

``widen_row`` does the same for the tiled path's K and V tiles (one row into a float32 scratch row).
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.extending import overload

from ._attention_rows import ROWS
from ._attention_softmax import _live_rows
from ._kernel import assume_contiguous, kernel, to_f32
from ._quantized import BLOCK
from .quant import block_bytes_of, widen_blocks

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
    """V rows jb .. jb+n of a block as the row updates read them. ``rows_at`` = (f, base, rs, cs): row j at flat
    offset ``base + j * rs`` of f, column stride cs. Float data, and quantized data without a per-head mask
    (``per_head_mask`` None): ``rows_at`` itself (quantized rows are widened in registers). Quantized data under a
    per-head mask (whose non-finite rows ``sanitised_rows`` copies and zeroes as float32): the rows r where some
    head's sc[:, r] is not 0 (all n when ``every``; listed in ``rows``) are widened into ``scratch`` (row jb + r at
    r · n_values) and (scratch, -jb · n_values, n_values, 1) is returned, so row j is again at ``base + j * rs``;
    the other rows are not read. Kernel-only."""
    raise NotImplementedError


@kernel
def _widen_block(f, base, rs, n_values, jb, sc, n, every, rows, scratch):
    """``v_block_rows``' widening of quantized rows (a call: inlined, its loops confused Numba's inliner)."""
    for x in range(_live_rows(sc, 0, sc.shape[0], n, every, np.float32(0.0), rows)):
        r = rows[x]
        widen_blocks(f, base + (jb + r) * rs, n_values, scratch, r * n_values)


@overload(v_block_rows, inline="always")
def _v_block_rows(rows_at, n_values, jb, sc, n, every, rows, scratch, per_head_mask):
    if not isinstance(rows_at, types.BaseTuple):
        raise TypingError("v_block_rows: expected (f, base, rs, cs)")
    if block_bytes_of(rows_at.types[0].dtype) and not isinstance(per_head_mask, types.NoneType):
        def widen(rows_at, n_values, jb, sc, n, every, rows, scratch, per_head_mask):
            f, base, rs, _ = rows_at
            _widen_block(f, base, rs, n_values, jb, sc, n, every, rows, scratch)
            return scratch, -jb * n_values, n_values, 1
        return widen
    return lambda rows_at, n_values, jb, sc, n, every, rows, scratch, per_head_mask: rows_at


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
    width = block_bytes_of(src.dtype)
    if width:
        def widen(src, dst):
            n = src.shape[0] // width * BLOCK
            widen_blocks(assume_contiguous(src), 0, n, assume_contiguous(dst), 0)
            return _finite_check(dst, n)
        return widen
    return lambda src, dst: _widen_float_row(src, dst)

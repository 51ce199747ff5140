"""SET_ROWS (a KV-cache write): row ``i`` of ``src`` goes to row ``idx[i]`` of ``dst``, converted to dst's dtype.

Layout: the leading axes are merged into one (``_core.layout.merge_leading``, never a copy), so the kernels see
``dst`` (B, R, D), ``src`` (B, n, D) and ``idx`` (I, n) with ``I`` dividing ``B``: batch ``b`` reads index row
``b % I``. Half-precision arrays enter as 16-bit integer views; each element is widened with ``to_f32`` and
narrowed with ``from_f32`` (``vcvtph2ps`` / ``vcvtps2ph``: round to nearest even, bit-exact with NumPy's astype).

Checks first: the kernel scans every index before its first write and returns the position of a bad one, so an
out-of-range index leaves ``dst`` untouched.

Threads: a few rows (a decode step writes one) run serially. Many rows run on ``prange`` workers that split the
work by *destination*: worker ``t`` writes exactly the rows whose destination hashes to ``t``, visiting ``src``
rows in order. All writes to one destination row therefore happen on one worker in source order, so with
duplicate indices the last row wins, as in ggml. The hash is Fibonacci hashing of the destination row: the
fractional part of ``row * golden ratio`` spreads any arithmetic progression of slots (consecutive, every other
one, ...) evenly over the workers. Each worker scans all ``n`` indices, which is cheap next to the row copies.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from .._core import layout as _layout
from .._core import threads as _threads
from . import args as _args
from .._core.kernel import (EXACT, adjacent_rows, argument_positions, call_any_layout, from_f32, kernel, kernel_view,
                           rows_if, to_f32)
from ..quant.blocks import QTYPE_CODES, Quantized
from ..quant.api import quantize_row

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio


@kernel
def _first_bad(idx, n_rows):
    """Flat position of the first index outside [0, n_rows), or -1."""
    for k in range(idx.shape[0]):
        row = idx[k]
        for i in range(row.shape[0]):
            if row[i] < 0 or row[i] >= n_rows:
                return k * row.shape[0] + i
    return -1


@kernel
def _copy_row(src_row, dst_row):
    for j in range(src_row.shape[0]):
        dst_row[j] = from_f32(to_f32(src_row[j]), dst_row)


@kernel
def _owner(row, n_workers):
    """Fibonacci hash of a destination row to a worker in [0, n_workers)."""
    mixed = (np.uint64(row) * _GOLDEN) >> np.uint64(32)
    return np.int64((mixed * np.uint64(n_workers)) >> np.uint64(32))


# The drivers take any-layout arrays and ``adjacent`` (``_core.kernel.adjacent_rows``): at most two compiled drivers
# per dtype combination; with adjacent elements the rows are retyped contiguous and the conversion vectorises.
@kernel
def _set_rows_serial(dst, src, idx, adjacent):
    bad = _first_bad(idx, dst.shape[1])
    if bad >= 0:
        return bad
    for b in range(src.shape[0]):
        rows = idx[b % idx.shape[0]]
        for i in range(src.shape[1]):
            _copy_row(rows_if(src[b, i], adjacent), rows_if(dst[b, rows[i]], adjacent))
    return -1


@kernel(parallel=True)
def _set_rows_parallel(dst, src, idx, adjacent, n_workers):
    bad = _first_bad(idx, dst.shape[1])
    if bad >= 0:
        return bad
    n_rows = dst.shape[1]
    for t in prange(n_workers):
        for b in range(src.shape[0]):
            rows = idx[b % idx.shape[0]]
            for i in range(src.shape[1]):
                if _owner(b * n_rows + rows[i], n_workers) == t:
                    _copy_row(rows_if(src[b, i], adjacent), rows_if(dst[b, rows[i]], adjacent))
    return -1


@kernel(fastmath=EXACT)
def _set_quantized_serial(data, src, idx, code):
    """``_set_rows_serial`` into quantized rows: each src row quantized straight into its destination's bytes."""
    bad = _first_bad(idx, data.shape[1])
    if bad >= 0:
        return bad
    for b in range(src.shape[0]):
        rows = idx[b % idx.shape[0]]
        for i in range(src.shape[1]):
            quantize_row(src[b, i], data[b, rows[i]], code)
    return -1


@kernel(parallel=True, fastmath=EXACT)
def _set_quantized_parallel(data, src, idx, code, n_workers):
    """``_set_rows_parallel`` into quantized rows (workers own destination rows: the last duplicate wins)."""
    bad = _first_bad(idx, data.shape[1])
    if bad >= 0:
        return bad
    n_rows = data.shape[1]
    for t in prange(n_workers):
        for b in range(src.shape[0]):
            rows = idx[b % idx.shape[0]]
            for i in range(src.shape[1]):
                if _owner(b * n_rows + rows[i], n_workers) == t:
                    quantize_row(src[b, i], data[b, rows[i]], code)
    return -1


def _set_rows_quantized(dst: Quantized, src: np.ndarray, idx: np.ndarray) -> Quantized:
    n_rows = dst.shape[-2]
    n_workers = _threads.threads_for(src.size * (src.itemsize + 1))
    code = QTYPE_CODES[dst.qtype]
    blocks = _layout.merge_leading([dst.data, kernel_view(src)], [idx[(None,) * (src.ndim - 1 - idx.ndim)]],
                                   src.ndim - 2)
    if len(blocks) > 1:  # checked up front: the per-block kernel checks would come after earlier blocks' writes
        bad = _args.first_bad_index(idx, n_rows)
        if bad is not None:
            raise _args.index_error(idx, n_rows, bad)
    # the cache bytes and the values typed any layout: one compilation whether the merged blocks are contiguous
    # or strided (quantize_row checks each row's strides itself)
    with _threads.team("set_rows_quantized", src.size * (src.itemsize + 1), n_workers) as launch:
        if launch.n == 1:
            _write_blocks(blocks, idx, n_rows, lambda dk, sk, ik: call_any_layout(
                _set_quantized_serial, _QUANTIZED_ROW_ARRAYS, dk, sk, ik, code))
        else:
            _write_blocks(blocks, idx, n_rows, lambda dk, sk, ik: call_any_layout(
                _set_quantized_parallel, _QUANTIZED_ROW_ARRAYS, dk, sk, ik, code, launch.n))
    return dst


#: The drivers' arrays typed any layout (``call_any_layout``): dst (a quantized cache's bytes), src and idx.
_ROW_ARRAYS = argument_positions(_set_rows_serial, "dst", "src", "idx")
_QUANTIZED_ROW_ARRAYS = argument_positions(_set_quantized_serial, "data", "src")


def _write_blocks(blocks, idx: np.ndarray, n_rows: int, write) -> None:
    """``write(dst, src, idx)`` per merged block; a bad index it reports (its flat position, >= 0) raises."""
    for (dk, sk), (ik,) in blocks:
        bad = write(dk, sk, ik)
        if bad >= 0:
            raise _args.index_error(idx, n_rows, tuple(int(i) for i in np.unravel_index(bad, idx.shape)))


def set_rows(dst: np.ndarray, src: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Write row ``i`` of ``src`` into row ``idx[i]`` of ``dst``, converted to ``dst``'s dtype; returns ``dst``.

    dst: (*lead, R, D) float32, float16 or bfloat16, any strides (a slice of a KV cache). src: (*lead, n, D)
    float32, float16 or bfloat16. idx: (*idx_lead, n) int32 or int64, repeated over the leading axes (each
    ``idx_lead`` length divides ``lead``'s, aligned from the right). Duplicate indices: the last row wins.
    An index outside [0, R) raises ``ValueError`` and nothing is written. Nothing of ``dst`` but the indexed
    rows changes.
    """
    dst, src, idx = _args.set_rows(dst, src, idx)
    if dst.__class__ is Quantized:
        return _set_rows_quantized(dst, src, idx)
    n_rows = dst.shape[-2]
    n_workers = _threads.threads_for(src.size * (src.itemsize + dst.itemsize))
    dk, sk = kernel_view(dst), kernel_view(src)
    if dst.ndim == 2:  # the common case directly: at decode size the generic merge costs a fifth of the call
        blocks = [((dk[None], sk[None]), (idx[None],))]
    else:
        blocks = _layout.merge_leading([dk, sk], [idx[(None,) * (dst.ndim - 1 - idx.ndim)]], dst.ndim - 2)
    if len(blocks) > 1:  # checked up front: the per-block kernel checks would come after earlier blocks' writes
        bad = _args.first_bad_index(idx, n_rows)
        if bad is not None:
            raise _args.index_error(idx, n_rows, bad)
    adjacent = adjacent_rows(dst, src)
    with _threads.team("set_rows", src.size * (src.itemsize + dst.itemsize), n_workers) as launch:
        if launch.n == 1:
            _write_blocks(blocks, idx, n_rows,
                          lambda dk, sk, ik: call_any_layout(_set_rows_serial, _ROW_ARRAYS, dk, sk, ik, adjacent))
        else:
            _write_blocks(blocks, idx, n_rows, lambda dk, sk, ik: call_any_layout(
                _set_rows_parallel, _ROW_ARRAYS, dk, sk, ik, adjacent, launch.n))
    return dst

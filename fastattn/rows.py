"""SET_ROWS (a KV-cache write): row ``i`` of ``src`` goes to row ``idx[i]`` of ``dst``, converted to dst's dtype.

Layout: the leading axes are merged into one (``_layout.merge_leading``, never a copy), so the kernels see
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

from . import _layout, _threads
from ._args import rows as _args
from ._kernel import from_f32, kernel, kernel_view, to_f32

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


@kernel
def _set_rows_serial(dst, src, idx):
    bad = _first_bad(idx, dst.shape[1])
    if bad >= 0:
        return bad
    for b in range(src.shape[0]):
        rows = idx[b % idx.shape[0]]
        for i in range(src.shape[1]):
            _copy_row(src[b, i], dst[b, rows[i]])
    return -1


@kernel(parallel=True)
def _set_rows_parallel(dst, src, idx, n_workers):
    bad = _first_bad(idx, dst.shape[1])
    if bad >= 0:
        return bad
    n_rows = dst.shape[1]
    for t in prange(n_workers):
        for b in range(src.shape[0]):
            rows = idx[b % idx.shape[0]]
            for i in range(src.shape[1]):
                if _owner(b * n_rows + rows[i], n_workers) == t:
                    _copy_row(src[b, i], dst[b, rows[i]])
    return -1


def set_rows(dst: np.ndarray, src: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Write row ``i`` of ``src`` into row ``idx[i]`` of ``dst``, converted to ``dst``'s dtype; returns ``dst``.

    dst: (*lead, R, D) float32, float16 or bfloat16, any strides (a slice of a KV cache). src: (*lead, n, D)
    float32, float16 or bfloat16. idx: (*idx_lead, n) int32 or int64, repeated over the leading axes (each
    ``idx_lead`` length divides ``lead``'s, aligned from the right). Duplicate indices: the last row wins.
    An index outside [0, R) raises ``ValueError`` and nothing is written. Nothing of ``dst`` but the indexed
    rows changes.
    """
    dst, src, idx = _args.set_rows(dst, src, idx)
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
    for (dk, sk), (ik,) in blocks:
        if n_workers == 1:
            bad = _set_rows_serial(dk, sk, ik)
        else:
            bad = _set_rows_parallel(dk, sk, ik, n_workers)
        if bad >= 0:
            raise _args.index_error(idx, n_rows, tuple(int(i) for i in np.unravel_index(bad, idx.shape)))
    return dst

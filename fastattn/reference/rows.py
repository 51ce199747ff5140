"""SET_ROWS, the definition: ``dst[*b, idx[*b % idx_lead, i], :] = src[*b, i, :]`` for every row, in order.

Rows are written one at a time in C order of ``src``'s rows, so with duplicate indices the last row wins.
Values are widened exactly to float64 and rounded once to ``dst``'s dtype (round to nearest even); into a
``Quantized`` dst, each row is quantized with ggml's reference rounding (``fastattn/reference/quant.py``).
"""
from __future__ import annotations

import numpy as np

from ..rows import args as _args
from ..quant.blocks import Quantized

from .quant import quantize


def set_rows(dst: np.ndarray, src: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Write row ``i`` of ``src`` (*lead, n, D) into row ``idx[i]`` of ``dst`` (*lead, R, D); returns ``dst``.

    ``idx`` (*idx_lead, n), int32 or int64, repeats over the leading axes (each of its leading lengths divides
    ``src``'s). An index outside [0, R) raises ``ValueError`` before anything is written.
    """
    dst, src, idx = _args.set_rows(dst, src, idx)
    n_rows = dst.shape[-2]
    bad = _args.first_bad_index(idx, n_rows)
    if bad is not None:
        raise _args.index_error(idx, n_rows, bad)
    idx_lead = (1,) * (src.ndim - 1 - idx.ndim) + idx.shape[:-1]
    idx = idx.reshape(idx_lead + idx.shape[-1:])
    if isinstance(dst, Quantized):  # each row quantized from its float32 values (exact for float16/bfloat16)
        target = dst.data
        values = quantize(src.astype(np.float32), dst.qtype).data
    else:
        target = dst
        values = src.astype(np.float64).astype(dst.dtype)
    for lead in np.ndindex(src.shape[:-2]):
        rows = idx[tuple(b % m for b, m in zip(lead, idx_lead))]
        for i in range(src.shape[-2]):
            target[lead + (rows[i],)] = values[lead + (i,)]
    return dst

"""Arguments of ``set_rows``, shared by the fast path and the reference.

Shapes (NumPy order, ggml's ``ne`` reversed): ``dst`` (*lead, R, D) (an ndarray, or a ``Quantized`` of that
logical shape), ``src`` (*lead, n, D), ``idx``
(*idx_lead, n) where ``idx_lead`` has at most ``len(lead)`` axes and each of its lengths divides the matching
(right-aligned) ``lead`` length: ``idx`` repeats over the leading axes as ggml's ``set_rows`` broadcasts it.

The range check of ``idx`` (every value in [0, R)) is the op's own business: the reference does it with NumPy
(``first_bad_index``), the fast path inside its kernel before the first write; both raise ``index_error``.
"""
from __future__ import annotations

import numpy as np

from .._core import validate as _validate
from ..quant.blocks import Quantized
from .._core.validate import INDEX_INTS, STORAGE_FLOATS

_FLOATS = _validate.STORAGE_FLOAT_SET  # bfloat16 misses it and takes the full check
_INTS = frozenset(INDEX_INTS)


def set_rows(dst, src, idx):
    """Checked (dst, src, idx); dst an ndarray or a ``Quantized`` (its logical shape is checked, its bytes are
    what must be writeable and disjoint from src and idx)."""
    if isinstance(dst, Quantized):
        memory = dst.data
        if memory.ndim < 2:
            raise ValueError(f"dst must have at least 2 axes (*lead, R, D), got shape {dst.shape}")
    else:
        if not (isinstance(dst, np.ndarray) and dst.dtype in _FLOATS and dst.ndim >= 2):
            _validate.array("dst", dst, dtypes=STORAGE_FLOATS, min_ndim=2)
        memory = dst
    if not memory.flags.writeable:
        raise ValueError("dst must be writeable")
    if not (isinstance(src, np.ndarray) and src.dtype in _FLOATS and src.ndim == dst.ndim):
        _validate.array("src", src, dtypes=STORAGE_FLOATS, ndim=dst.ndim)
    d_shape, s_shape = dst.shape, src.shape
    if s_shape[:-2] != d_shape[:-2] or s_shape[-1] != d_shape[-1]:
        raise ValueError(f"src must have shape (*lead, n, D) = {d_shape[:-2]} + (n, {d_shape[-1]}) to match "
                         f"dst {d_shape}, got {s_shape}")
    if not (isinstance(idx, np.ndarray) and idx.dtype in _INTS and 1 <= idx.ndim < src.ndim):
        _validate.array("idx", idx, dtypes=INDEX_INTS, min_ndim=1)
        raise ValueError(f"idx must have at most {src.ndim - 1} axes (*lead, n), got shape {idx.shape}")
    i_shape = idx.shape
    if i_shape[-1] != s_shape[-2]:
        raise ValueError(f"idx must have src's row count {s_shape[-2]} as its last axis, got shape {i_shape}")
    if len(i_shape) > 1 and any(m % n if n else m for n, m in zip(reversed(i_shape[:-1]), reversed(s_shape[:-2]))):
        raise ValueError(f"idx's leading axes {i_shape[:-1]} must each divide src's {s_shape[:-2]} "
                         "(aligned from the right): idx repeats over them")
    if np.may_share_memory(memory, src) or np.may_share_memory(memory, idx):
        raise ValueError("dst overlaps src or idx; pass separate arrays")
    return dst, src, idx


def first_bad_index(idx: np.ndarray, n_rows: int) -> tuple[int, ...] | None:
    """The position (C order) of the first value of ``idx`` outside [0, n_rows), or None."""
    bad = (idx < 0) | (idx >= n_rows)
    if not bad.any():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), idx.shape))


def index_error(idx: np.ndarray, n_rows: int, position: tuple[int, ...]) -> ValueError:
    return ValueError(f"idx must be in [0, {n_rows}) (dst's row count; no wraparound), got {int(idx[position])} "
                      f"at idx{list(position)}")

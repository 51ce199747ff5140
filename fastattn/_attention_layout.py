"""Flat views of strided attention arrays, made inside the kernels.

Memory layout: every array is read *flat* (``flat4``, inside the kernels): a 1-D C-contiguous view of the memory
the strided array spans, plus the element offset of its first element and its element strides. A K/V cache
slice, a transposed token-major cache or a padded view then compiles to the same code as a contiguous array
(one specialisation per dtype), and rows are read with unsigned offsets so the inner loops vectorise (Numba's
"any layout" arrays and signed indices do not). A row whose elements are not adjacent (column stride != 1) takes
a strided loop.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import carray, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ._kernel import kernel


@intrinsic
def _pointer_at(typingctx, arr, offset):
    """Pointer to element ``offset`` (counted in elements from the first one, may be negative) of ``arr``'s data."""
    if not isinstance(arr, types.Array) or not isinstance(offset, types.Integer):
        raise TypingError("expected an array and an integer offset")

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.gep(data, [args[1]])

    return types.CPointer(arr.dtype)(arr, offset), codegen


@kernel
def flat4(a):
    """(1-D C-contiguous view of the memory the 4-D array ``a`` spans, element offset of ``a[0, 0, 0, 0]`` in it,
    element strides). ``a``'s strides must be whole numbers of elements (``element_strides`` checks)."""
    item = a.itemsize
    s0 = a.strides[0] // item
    s1 = a.strides[1] // item
    s2 = a.strides[2] // item
    s3 = a.strides[3] // item
    low = 0
    high = 0
    for n, s in ((a.shape[0], s0), (a.shape[1], s1), (a.shape[2], s2), (a.shape[3], s3)):
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    return carray(_pointer_at(a, low), high - low + 1), -low, (s0, s1, s2, s3)


@kernel
def flat_mask(mask):
    """``flat4`` of the mask and its (Bm, Hm); (None, 0, zeros, 1, 1) without a mask."""
    if mask is None:
        return None, 0, (0, 0, 0, 0), 1, 1
    mf, mo, mst = flat4(mask)
    return mf, mo, mst, mask.shape[0], mask.shape[1]


@functools.lru_cache(maxsize=16)
def no_sinks(n_heads: int) -> np.ndarray:
    """(n_heads,) float32 -inf: the sinks of a call without sinks, made once per head count (kernels only read
    it; writeable like a caller's sinks, so both share one compiled kernel)."""
    return np.full(n_heads, -np.inf, np.float32)


def element_strides(a: np.ndarray) -> np.ndarray:
    """``a`` itself when its strides are whole numbers of elements (every ordinary view), else a C copy."""
    item = a.itemsize
    for stride in a.strides:  # a loop, not any(generator): this runs for every input of every call
        if stride % item:
            return np.ascontiguousarray(a)
    return a

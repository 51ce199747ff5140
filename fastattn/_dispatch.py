"""The fast paths: compiled entry points called without Numba's dispatcher, checks inside the kernel.

A decode step calls each op on one row, where the kernel takes well under a microsecond and the Python around it
(argument checks, ``np.may_share_memory``, views, the dispatcher typing every argument) took three times that.
An op's fast path therefore does in Python only what the compiled code relies on, and falls back to its general
path on anything else:

1. Python checks each argument's exact class (``numpy.ndarray``) and number of axes (the entry point does not:
   it would read a wrong-rank array out of bounds), that an output is writeable, and the dtypes, by looking up
   the entry point keyed on them (``FastPath``). An op records a key only after its general path accepted a call
   with those dtypes, so a hit needs no dtype check of its own.
2. The kernel checks the rest (shapes, value ranges, overlaps as ``np.may_share_memory`` judges them, the size
   from which the op runs in parallel, alignment and unit-stride rows) *before it writes anything*, and returns
   False when any fails.
3. On a miss or a False the op runs its general path, which validates everything and raises its usual message,
   or does the work (other strides, leading axes, broadcasting, parallel kernels, ...).

Larger calls take the same route, because right after a kernel that streamed megabytes the interpreter's own
data is cold and the general path's Python costs 40-90 µs instead of ~10: ``rope_ext`` and ``rope_set_rows`` of a
prefill (3-D x, int32 positions; the scalar arguments looked up with their classes, freq_factors by dtype, shape
and bytes), ``apply_rope_cache`` of a prefill (3-D x) and ``flash_attn_ext`` decode on one_chunk (no mask, sinks, ALiBi or softcap). Their kernels set Numba's thread count themselves (``_kernel.use_threads``).

Entry points are compiled for any-layout (``A``) arrays (``array_type``), one per dtype combination for every
layout: a C-contiguous or read-only array fits such a parameter (only the static typing differs, not the data
model). The kernel retypes the unit-stride rows contiguous (``_kernel.assume_contiguous``) so that they vectorise.
Half-precision arrays are passed as they are to entry points compiled for their 16-bit integer views
(``_kernel.kernel_view``): the unboxing reads the data pointer, shape, strides and itemsize and checks only the
itemsize, so no view is made. Only compiled code is cached, keyed on types; nothing about a particular array is
remembered between calls.
"""
from __future__ import annotations

import threading

import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic
from numba.np import numpy_support

from ._kernel import _HALF_VIEW, kernel


def array_type(dtype: np.dtype, ndim: int) -> types.Array:
    """The Numba type of a fast entry point's parameter for arrays of ``dtype`` (storage float or index int):
    its kernel view's element type, any layout ('A'), writeable and aligned as ``numba.typeof`` types an ordinary
    array. So a row the kernel retypes contiguous has the very type of a row of a C-contiguous array in the
    general path, whose row functions (compiled already) are then shared, not compiled again. The kernel checks
    the alignment (``unit_rows``, ``aligned``) before it reads anything, and never writes its inputs."""
    return types.Array(numpy_support.from_dtype(_HALF_VIEW.get(dtype, dtype)), ndim, "A")


class FastPath:
    """Entry points of one kernel, keyed on the dtypes of its array arguments (a tuple, in argument order).

    ``get(key)`` returns the entry point or None; ``add(key, arg_types)`` compiles (or loads from Numba's cache)
    the kernel for ``arg_types`` and remembers its entry point under ``key``. The caller guarantees that the
    key determines ``arg_types`` and that every argument's ndim matches them (the entry point does not check).
    """

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self.entries: dict = {}
        self.get = self.entries.get  # the hot lookup, one bound method call
        self._lock = threading.Lock()

    def add(self, key: tuple, arg_types: tuple) -> None:
        with self._lock:
            if key not in self.entries:
                self.dispatcher.compile(arg_types)
                self.entries[key] = self.dispatcher.overloads[arg_types].entry_point


# ---------------------------------------------------------------------------------------------------------------
# Kernel side: the checks np.may_share_memory and _validate make, for the kernels' own use. They take an array's
# ``meta``, whose type depends on its number of axes only, so each is compiled once for all dtypes and layouts
# (a kernel helper taking arrays costs a compilation, ~0.2 s, per array type: a second per entry point).
@intrinsic
def meta(typingctx, a):
    """``(data pointer, shape, strides, itemsize)`` of array ``a``, as integers and tuples of them."""
    if not isinstance(a, types.Array):
        raise TypingError("meta: expected an array")
    axes = types.UniTuple(types.intp, a.ndim)
    result = types.Tuple((types.intp, axes, axes, types.intp))

    def codegen(context, builder, signature, args):
        ary = context.make_array(a)(context, builder, args[0])
        data = builder.ptrtoint(ary.data, context.get_value_type(types.intp))
        return context.make_tuple(builder, result, (data, ary.shape, ary.strides, ary.itemsize))

    return result(a), codegen


@kernel
def _extent(m):
    """The half-open byte range [lo, hi) an array spans (empty for an empty array), as NumPy's
    ``offset_bounds_from_strides`` computes it."""
    data, shape, strides, itemsize = m
    lo = 0
    hi = 0
    for k in range(len(shape)):
        n = shape[k]
        if n == 0:
            return 0, 0
        step = strides[k] * (n - 1)
        if step > 0:
            hi += step
        else:
            lo += step
    return data + lo, data + hi + itemsize


@kernel
def overlaps(ma, mb):
    """``np.may_share_memory(a, b)`` from ``meta(a), meta(b)``: whether the byte ranges they span intersect."""
    lo_a, hi_a = _extent(ma)
    lo_b, hi_b = _extent(mb)
    return lo_a < hi_b and lo_b < hi_a and lo_a < hi_a and lo_b < hi_b


@kernel
def same_view(ma, mb):
    """From ``meta(a), meta(b)``: the same view of memory (``_validate._same_view``), in-place use."""
    return ma == mb


@kernel
def aligned(m):
    """From ``meta(a)``: every element of ``a`` is aligned to its size (data pointer and strides multiples)."""
    data, _, strides, itemsize = m
    if data % itemsize != 0:
        return False
    for k in range(len(strides)):
        if strides[k] % itemsize != 0:
            return False
    return True


@kernel
def unit_rows(m):
    """From ``meta(a)``: ``a`` is aligned and its last axis has unit stride (rows can be retyped contiguous)."""
    return m[2][len(m[2]) - 1] == m[3] and aligned(m)


@kernel
def c_contiguous(m):
    """From ``meta(a)``: ``a`` is aligned and C-contiguous (``assume_contiguous`` may retype it; axes of length
    one may have any stride, as NumPy's flag allows)."""
    _, shape, strides, itemsize = m
    expected = itemsize
    for k in range(len(shape) - 1, -1, -1):
        if shape[k] != 1 and strides[k] != expected:
            return False
        expected *= shape[k]
    return aligned(m)

"""Routes: compiled entry points that take a class of calls without Numba's dispatcher, checks inside.

A decode step calls each op on one row, where the kernel takes well under a microsecond and the Python around it
(argument checks, ``np.may_share_memory``, views, the dispatcher typing every argument) took three times that; a
prefill call pays the same Python again right after a kernel that flushed the caches (40-90 µs instead of ~10).
So every op has the same three parts, in this order:

1. **The guard** (at most one short test, at the top of the public function): each argument's exact class
   (``numpy.ndarray``) and number of axes, an output's writeable flag, and the route's entry point looked up by
   the dtypes (``Route.get``). An entry exists only for a key the general path has accepted once, so a hit needs
   no dtype check of its own.
2. **The route** (``Route``): its entry kernel checks everything else it relies on (shapes, value ranges,
   overlaps as ``np.may_share_memory`` judges them, sizes, alignment, unit-stride rows) *before it writes
   anything*, and returns False to decline.
3. **The general path**: parses every argument once (raising the op's usual errors), and when a route accepts the
   parsed call it runs that route itself (``Route.run``: the entry point is compiled, or loaded from Numba's
   cache, on first use, so a first call runs the very code later calls take); anything else (other strides,
   leading axes, broadcasting, ...) runs on the general drivers.

``ROUTES`` holds every route by name. ``general_only()`` and ``forget_routes()`` are the test hooks (re-exported
by ``fastattn.testing``): the first makes every call take the general drivers, the second forgets every entry
point, as a new process would.

Entry points are compiled for any-layout (``A``) arrays (``array_type``), one per key (dtypes, and numbers of
axes where a route takes several): a C-contiguous or read-only array fits such a parameter (only the static
typing differs, not the data model). The kernel retypes the unit-stride rows contiguous
(``_core.kernel.assume_contiguous``) so that they vectorise. Half-precision arrays are passed as they are to entry
points compiled for their 16-bit integer views (``_core.kernel.kernel_view``): the unboxing reads the data pointer,
shape, strides and itemsize and checks only the itemsize, so no view is made. Only compiled code is cached, keyed
on types; nothing about a particular array is remembered between calls.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Callable, Iterator

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic
from numba.np import numpy_support

from .kernel import HALF_VIEW, HANDLE_TYPE, check_unit, compile_beside, kernel


def array_type(dtype: np.dtype, ndim: int) -> types.Array:
    """The Numba type of an entry kernel's parameter for arrays of ``dtype`` (storage float or index int): its
    kernel view's element type, any layout ('A'), writeable and aligned as ``numba.typeof`` types an ordinary
    array. The kernel checks the alignment (``unit_rows``, ``aligned``) before it reads anything, and never
    writes its inputs."""
    return types.Array(numpy_support.from_dtype(HALF_VIEW.get(dtype, dtype)), ndim, "A")


#: Every route, by name.
ROUTES: dict[str, "Route"] = {}
_general_only = False


def _no_entry(key):
    return None


class Route:
    """A class of calls an entry kernel takes without Numba's dispatcher (module docstring).

    ``kernel``: the entry kernel (a ``numba.njit`` dispatcher) returning True when it did the work, False when it
    declined having written nothing. ``arg_types(*key)``: the Numba types of its parameters for a key (a tuple of
    dtypes, None and small ints that determines them; the caller guarantees every array's number of axes).
    ``unit(*key)``, for an entry kernel whose first parameters are work units' handles (``_core.kernel.call_unit``):
    those handles (``_core.kernel.unit_address``); the entry point is stored with them bound, so callers pass the
    parameters after them.
    """

    def __init__(self, name: str, kernel, arg_types: Callable[..., tuple], unit: Callable | None = None):
        self.name = name
        self.kernel = kernel
        self.arg_types = arg_types
        self.unit = unit
        self.handles: dict = {}
        self.entries: dict = {}
        self.get = self.entries.get  # the guard's lookup: one bound method call
        #: Calls the general path handed to this route and the route took (what the route tests count).
        self.taken = 0
        self._lock = threading.Lock()
        if name in ROUTES:
            raise ValueError(f"a route named {name!r} exists already")
        ROUTES[name] = self

    def entry(self, key: tuple):
        """The entry point for ``key``, compiled or loaded from Numba's cache on first use (None under
        ``general_only``). For the general path, which has validated a call of this key."""
        entry = self.entries.get(key)
        if entry is None:
            if _general_only:
                return None
            with self._lock:
                entry = self.entries.get(key)
                if entry is None:
                    arg_types = self.arg_types(*key)
                    handles = ()
                    if self.unit is not None:
                        # the kernel's leading parameters are the handles (int64 arrays): typed before the units
                        # compile, so that a helper process may compile the kernel meanwhile
                        n_units = len(inspect.signature(self.kernel.py_func).parameters) - len(arg_types)
                        arg_types = (HANDLE_TYPE,) * n_units + arg_types
                        handles = self.handles[key] = compile_beside(self.kernel, arg_types, lambda: self.unit(*key))
                        if len(handles) != n_units:
                            raise RuntimeError(f"fastattn internal error: route {self.name} made {len(handles)} "
                                               f"handles for {n_units} handle parameters")
                    else:
                        self.kernel.compile(arg_types)
                    entry = self.kernel.overloads[arg_types].entry_point
                    if handles:
                        entry = functools.partial(entry, *handles)
                    self.entries[key] = entry
        return entry

    def run(self, key: tuple, *args) -> bool:
        """The general path's use: run the call on this route's entry point; False when it declines. (Every key's
        first call in a process comes this way, so a unit handle of the wrong types is found here.)"""
        entry = self.entry(key)
        if entry is None:
            return False
        taken = entry(*args)
        for handle in self.handles.get(key, ()):
            check_unit(handle)
        if not taken:
            return False
        self.taken += 1
        return True


@contextlib.contextmanager
def general_only() -> Iterator[None]:
    """Within the block every call takes its op's general path and general drivers, never a route (the results
    routes must reproduce byte for byte)."""
    global _general_only
    saved = _general_only
    _general_only = True
    for route in ROUTES.values():
        route.get = _no_entry
    try:
        yield
    finally:
        _general_only = saved
        if not saved:
            for route in ROUTES.values():
                route.get = route.entries.get


def forget_routes() -> None:
    """Forget every route's entry points, as a new process would (the compiled code stays in Numba's caches)."""
    for route in ROUTES.values():
        with route._lock:
            route.entries.clear()
            route.handles.clear()


# ---------------------------------------------------------------------------------------------------------------
# Kernel side: the checks np.may_share_memory and _validate make, for the kernels' own use. They take an array's
# ``meta``, whose type is the same for every array of up to META_AXES axes, so each is compiled once for all
# dtypes, layouts and numbers of axes (a kernel helper costs a compilation, ~0.2 s, per argument type).
#: Axes of a ``meta``: an array of fewer is described with leading axes of length 1 and stride 0, which change
#: none of the checks (no bytes spanned, every alignment kept, C order kept).
META_AXES = 4


@intrinsic
def meta(typingctx, a):
    """``(data pointer, shape, strides, itemsize)`` of array ``a``, as integers and tuples of them, shape and
    strides padded in front to META_AXES axes."""
    if not isinstance(a, types.Array):
        raise TypingError("meta: expected an array")
    n_axes = max(META_AXES, a.ndim)
    axes = types.UniTuple(types.intp, n_axes)
    result = types.Tuple((types.intp, axes, axes, types.intp))

    def codegen(context, builder, signature, args):
        ary = context.make_array(a)(context, builder, args[0])
        intp = context.get_value_type(types.intp)
        data = builder.ptrtoint(ary.data, intp)
        pad = n_axes - a.ndim
        shape = [ir.Constant(intp, 1)] * pad + [builder.extract_value(ary.shape, k) for k in range(a.ndim)]
        strides = [ir.Constant(intp, 0)] * pad + [builder.extract_value(ary.strides, k) for k in range(a.ndim)]
        return context.make_tuple(builder, result, (data, context.make_tuple(builder, axes, shape),
                                                    context.make_tuple(builder, axes, strides), ary.itemsize))

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
    """From ``meta(a), meta(b)``: the same view of memory (``_core.validate._same_view``), in-place use."""
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


@kernel(inline=True)
def rows_writable(dst, src, idx):
    """A cache write's checks (the routes of ``set_rows`` and ``apply_rope_cache_set_rows``): ``dst`` (its rows:
    values, or a quantized cache's bytes) and ``src`` have aligned unit-stride rows, ``idx`` is aligned, ``dst``
    overlaps neither ``src`` nor ``idx``, and every index is in [0, dst.shape[0])."""
    md, ms, mi = meta(dst), meta(src), meta(idx)
    if not (unit_rows(md) and unit_rows(ms) and aligned(mi)) or overlaps(md, ms) or overlaps(md, mi):
        return False
    for i in range(idx.shape[0]):
        if idx[i] < 0 or idx[i] >= dst.shape[0]:
            return False
    return True

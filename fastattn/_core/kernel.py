"""Kernel plumbing shared by every fast path: compile flags, dtype conversion, a vectorisable exp.

Numba's CPU target cannot type float16 (or bfloat16) at all, so half-precision arrays travel into kernels as
16-bit integer views and the *integer type names the format*:

    float16  -> ``uint16`` view     widened with LLVM ``fpext half`` (compiles to ``vcvtph2ps``)
    bfloat16 -> ``int16`` view      widened by a 16-bit shift and a bitcast
    float32  -> itself

``to_f32(v)`` widens one element of any of those; ``from_f32(v, arr)`` narrows a float32 to ``arr``'s element
type (round to nearest even, bit-exact with NumPy's ``astype``). Both resolve at compile time, so a kernel written
once serves every format and the contiguous float32 case still vectorises.

``FASTMATH`` is Numba's blanket fast-math set minus ``nnan``/``ninf``: those two let LLVM assume no ``-inf``, which deletes
the ``== -inf`` guards of masked softmax (5 wrong results in 13 online-softmax checks). The set kept still
reassociates reductions and contracts FMAs.
"""
from __future__ import annotations

import inspect
import zlib

import numba
import numpy as np
from llvmlite import ir
from numba import types, typeof
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from . import source_cache as _source_cache

_source_cache.install()  # before any kernel below is decorated: its cache is keyed on the package's sources

from . import notices as _notices  # noqa: F401  (installs the compile notices: one stderr line per first-use compile)
from . import validate as _validate
from .simd import KERNEL_DTYPES, prefetch_line, widen

FASTMATH = frozenset({"contract", "arcp", "reassoc", "nsz", "afn"})


#: No fast-math flag at all: every operation rounds as written (``kernel(fastmath=EXACT)``).
EXACT = frozenset()

#: The options of every kernel: cached, GIL released, safe fastmath, no zero-division checks.
KERNEL_OPTIONS = dict(cache=True, nogil=True, fastmath=set(FASTMATH), error_model="numpy")


def kernel(fn=None, *, parallel: bool = False, inline: bool = False, llvm_inline: bool = False,
           fastmath: frozenset = FASTMATH):
    """``numba.njit`` with ``KERNEL_OPTIONS``; ``parallel=True`` for the ``prange`` drivers; ``inline=True`` for
    small helpers called in hot loops (inlined by Numba: LLVM leaves calls with many array arguments alone, and
    the call costs as much as a short loop); ``llvm_inline=True`` for a helper called from many places of one
    kernel (compiled once, then inlined by LLVM into each call, where Numba would type a copy of it per call:
    ``store_score``, 13 calls in ``group_rows``, took 4 s of a first decode call that way); ``fastmath`` the LLVM
    fast-math flags where a kernel needs fewer than ``FASTMATH``: ``EXACT`` (none) for arithmetic that must round
    as a reference does (no FMA contraction, no reciprocal for a division: the quantizers)."""
    opts = dict(KERNEL_OPTIONS, parallel=parallel, fastmath=set(fastmath))
    if inline:
        opts["inline"] = "always"
    if llvm_inline:
        opts["forceinline"] = True
    if fn is None:
        return lambda f: numba.njit(**opts)(f)
    return numba.njit(**opts)(fn)


# ---------------------------------------------------------------------------------------------------------------
# Python side: how an array of a given dtype is handed to a kernel.
FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
#: dtype -> the integer dtype a kernel sees instead (``_core.validate.half_view``; bfloat16 is told by its name)
HALF_VIEW = _validate.HALF_VIEW
_BFLOAT16_VIEW = _validate.BFLOAT16_VIEW


def kernel_view(a: np.ndarray) -> np.ndarray:
    """The view of ``a`` a kernel can type: float32 as is, float16 as uint16 bits, bfloat16 as int16 bits."""
    dtype = a.dtype
    view = HALF_VIEW.get(dtype)  # one dict probe: this runs several times per decode-sized call
    if view is None:
        if dtype.kind != "V" or not _validate.is_bfloat16(dtype):
            return a
        view = _BFLOAT16_VIEW
    return a.view(view)


# ---------------------------------------------------------------------------------------------------------------
# Kernel side: conversions.
# to_f32 and from_f32 are intrinsics, not inlined overloads: Numba types an inlined overload's implementation
# again at every call site (~13 ms each on the slowest machine measured), and a kernel's inlined helpers hold
# dozens of these calls; an intrinsic's typing is a dictionary lookup, and its code is the same few instructions.
def _widen(builder, value, typ):
    """LLVM float32 of one element ``value`` of Numba type ``typ`` (float16 bits uint16, bfloat16 bits int16 or a
    float)."""
    if typ in KERNEL_DTYPES:
        return widen(builder, value, typ)
    return builder.fptrunc(value, ir.FloatType())


def _narrow(builder, value, typ):
    """LLVM ``typ`` (uint16 float16 bits or int16 bfloat16 bits) of float32 ``value``, rounded to nearest even
    (a bfloat16 NaN stays a quiet NaN)."""
    if typ == types.uint16:
        return builder.bitcast(builder.fptrunc(value, ir.HalfType()), ir.IntType(16))
    i32 = ir.IntType(32)
    bits = builder.bitcast(value, i32)
    lsb = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
    rounded = builder.add(bits, builder.add(lsb, ir.Constant(i32, 0x7FFF)))
    quiet_nan = builder.or_(bits, ir.Constant(i32, 0x400000))
    chosen = builder.select(builder.fcmp_unordered("uno", value, value), quiet_nan, rounded)
    return builder.trunc(builder.lshr(chosen, ir.Constant(i32, 16)), ir.IntType(16))


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    if not (isinstance(bits, types.Integer) and bits.bitwidth == 16):
        raise TypingError("expected 16-bit integer bits")

    def codegen(context, builder, signature, args):
        return _widen(builder, args[0], types.uint16)

    return types.float32(bits), codegen


@intrinsic
def f32_to_f16_bits(typingctx, value):
    if value != types.float32:
        raise TypingError("expected float32")

    def codegen(context, builder, signature, args):
        return _narrow(builder, args[0], types.uint16)

    return types.uint16(value), codegen


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    if not (isinstance(bits, types.Integer) and bits.bitwidth == 16):
        raise TypingError("expected 16-bit integer bits")

    def codegen(context, builder, signature, args):
        return _widen(builder, args[0], types.int16)

    return types.float32(bits), codegen


@intrinsic
def _f32_to_bf16_bits(typingctx, value):
    """Round to nearest even on the upper 16 bits; NaN stays a (quiet) NaN."""
    if value != types.float32:
        raise TypingError("expected float32")

    def codegen(context, builder, signature, args):
        return _narrow(builder, args[0], types.int16)

    return types.int16(value), codegen


@intrinsic
def _pow2i(typingctx, n):
    """2**n as float32 for integer n in [-126, 127], built from the exponent bits."""
    if not isinstance(n, types.Integer):
        raise TypingError("expected an integer")

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = builder.trunc(args[0], i32) if n.bitwidth > 32 else args[0]
        biased = builder.add(v, ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())

    return types.float32(n), codegen


@intrinsic
def to_f32(typingctx, v):
    """Widen one element (float32, float16 bits as uint16, bfloat16 bits as int16) to float32. Kernel-only."""
    if not (v in (types.uint16, types.int16) or isinstance(v, types.Float)):
        raise TypingError(f"to_f32: unsupported element type {v}")

    def codegen(context, builder, signature, args):
        return _widen(builder, args[0], signature.args[0])

    return types.float32(v), codegen


@intrinsic
def from_f32(typingctx, v, like):
    """Narrow ``v`` (as float32: ``np.float32(v)``) to the element type of array ``like`` (round to nearest even;
    a float64 array takes ``np.float64(v)``). Kernel-only."""
    dtype = getattr(like, "dtype", None)
    if not (isinstance(like, types.Array) and dtype in (types.uint16, types.int16, types.float32, types.float64)
            and isinstance(v, types.Number)):
        raise TypingError(f"from_f32: unsupported value {v} or array type {like}")

    def codegen(context, builder, signature, args):
        if dtype == types.float64:
            return context.cast(builder, args[0], v, types.float64)
        value = context.cast(builder, args[0], v, types.float32)
        return value if dtype == types.float32 else _narrow(builder, value, dtype)

    return dtype(v, like), codegen


# ---------------------------------------------------------------------------------------------------------------
# exp: np.exp is a scalar libm call inside Numba here; this polynomial vectorises (~6x faster in loops).
LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
#: fast_exp's polynomial coefficients, highest degree first (``attention.tiled_products._exp_lanes`` too)
EXP_POLYNOMIAL = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                               1.6666665459e-1, 5.0000001201e-1))
EXP_MIN = np.float32(-87.33654)  # below this exp underflows to 0 in float32 (and -inf lands here)
EXP_MAX = np.float32(88.37626)  # largest x whose 2**n scale stays finite


@kernel
def fast_exp(x):
    """float32 exp, relative error < 3e-7, exact 0 at -inf, +inf past overflow. Branch-free, vectorises."""
    x = np.float32(x)
    xc = min(max(x, EXP_MIN), EXP_MAX)
    n = np.floor(xc * LOG2E + np.float32(0.5))
    r = xc - n * LN2_HI
    r = r - n * LN2_LO
    # Cephes expf minimax polynomial on [-ln2/2, ln2/2].
    p = EXP_POLYNOMIAL[0]
    p = p * r + EXP_POLYNOMIAL[1]
    p = p * r + EXP_POLYNOMIAL[2]
    p = p * r + EXP_POLYNOMIAL[3]
    p = p * r + EXP_POLYNOMIAL[4]
    p = p * r + EXP_POLYNOMIAL[5]
    p = p * r * r + r + np.float32(1.0)
    scale = _pow2i(np.int32(n))
    y = p * scale
    if x < EXP_MIN:
        y = np.float32(0.0)
    if x > EXP_MAX:
        y = np.float32(np.inf)
    return y


# ---------------------------------------------------------------------------------------------------------------
# Dynamic scheduling: prange splits its range evenly between threads, so on a shared machine the thread whose core
# is busy elsewhere decides the time. Drivers that run independent units instead start one prange iteration per
# thread and let each take the next unit number from a shared counter until none is left.
@intrinsic
def fetch_add(typingctx, counter):
    """Atomically add 1 to counter[0] (an int64 array) and return its previous value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        raise TypingError("fetch_add: expected an int64 array")

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), codegen


@intrinsic
def use_threads(typingctx, n):
    """``numba.set_num_threads(n)`` from inside a kernel, before its ``prange``: the call on the Python side costs
    1.7 us, 10-15 us right after a large kernel has flushed the caches (docs/rope.md). Numba's own overload of it
    calls through a ctypes pointer, which keeps the kernel from being cached; this calls the threading layer's
    ``set_num_threads`` symbol (registered by Numba when it starts its threads, as for every ``prange`` kernel).
    ``n`` must be in [1, NUMBA_NUM_THREADS]: the caller's ``_core.threads.get_num_threads()``."""
    if not isinstance(n, types.Integer):
        raise TypingError("use_threads: expected an integer")

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i32]),
                                            "set_num_threads")
        builder.call(fn, [builder.trunc(args[0], i32)])
        return context.get_dummy_value()

    return types.none(n), codegen


@kernel
def apply_threads(n):
    """``use_threads(n)`` called from Python: Numba's thread count for the calling thread's next ``prange``
    launches, in 0.2 us (5 us with cold caches) where ``numba.set_num_threads`` takes 1 us (20 us). Numba's
    threads must have been started (``_core.threads.launch_on`` starts them once with ``numba.set_num_threads``)."""
    use_threads(n)


# ---------------------------------------------------------------------------------------------------------------
# Layouts: one compiled variant for contiguous and strided inputs, and unit-stride rows that still vectorise.
@intrinsic
def assume_contiguous(typingctx, row):
    """Retype an any-layout array that is C-contiguous in fact (a 1-D row whose stride is its itemsize, or a 2-D
    block of adjacent rows) as C-contiguous (same data model, nothing copied), so LLVM sees unit stride and
    vectorises loops over it. The caller checks the strides."""
    if not isinstance(row, types.Array):
        raise TypingError("assume_contiguous: expected an array")

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, signature.return_type, args[0])

    return row.copy(layout="C")(row), codegen


@intrinsic
def any_layout(typingctx, a):
    """Retype array ``a`` as any layout ('A'), writeable, as ``call_any_layout`` types a driver's arrays
    (same data model, nothing copied): a kernel that hands a C-contiguous block (a reshaped cache) to a driver
    also called with strided arrays then shares its compiled code instead of compiling a C variant of it."""
    if not isinstance(a, types.Array):
        raise TypingError("any_layout: expected an array")

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, signature.return_type, args[0])

    return a.copy(layout="A", readonly=False)(a), codegen


@intrinsic
def rows_if(typingctx, a, adjacent):
    """``a`` retyped C-contiguous (``assume_contiguous``) when ``adjacent`` is a boolean, as it is when
    ``adjacent`` is None: the Python side passes True after checking that every row's elements are adjacent
    (``adjacent_rows``), so a driver compiled for any-layout arrays compiles only the row code a call runs."""
    if not isinstance(a, types.Array):
        raise TypingError("rows_if: expected an array")
    typ = a if isinstance(adjacent, types.NoneType) else a.copy(layout="C")

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, signature.return_type, args[0])

    return typ(a, adjacent), codegen


def adjacent_rows(*arrays) -> bool | None:
    """True when every array (None: absent) has adjacent elements along its last axis, else None: the
    ``adjacent`` argument of kernels that use ``rows_if``."""
    for a in arrays:
        if a is not None and a.strides[-1] != a.itemsize and a.shape[-1] > 1:  # the shape only on a mismatch
            return None
    return True


def argument_positions(driver, *names: str) -> tuple:
    """The positions of the parameters ``names`` among ``driver``'s arguments after its unit handle (its first
    parameter, ``unit``, when it takes one): what ``call_any_layout``'s ``strided`` and a unit's shared
    arguments index. Raises TypeError (at import, where units and drivers are declared) naming a parameter the
    driver lacks."""
    params = list(inspect.signature(driver.py_func).parameters)
    if params and params[0] == "unit":
        params = params[1:]
    missing = [name for name in names if name not in params]
    if missing:
        raise TypeError(f"{driver.py_func.__qualname__} has no parameter {', '.join(missing)}")
    return tuple(params.index(name) for name in names)


def work_unit(unit_kernel, *drivers, extra: tuple = ()) -> tuple:
    """A work unit as ``call_any_layout(driver, ..., unit=...)`` takes it, declared by the unit's own signature:
    ``(unit_kernel, shared, extra)``. The unit's parameters but its last ``len(extra)`` are the drivers'
    arguments of the same names (``shared``: their positions, the same in every driver); its last ones, of the
    Numba types ``extra`` (a task number, a thread slot), the drivers make themselves. A driver that lacks one of
    the unit's parameters, or has it elsewhere than another driver, raises TypeError at import;
    ``tests/test_package.py`` checks that each driver's ``call_unit`` passes the unit's parameters in order."""
    params = list(inspect.signature(unit_kernel.py_func).parameters)
    shared_names = params[:len(params) - len(extra)]
    positions = {argument_positions(driver, *shared_names) for driver in drivers}
    if len(positions) != 1:
        raise TypeError(f"the drivers of {unit_kernel.py_func.__qualname__} disagree on where its arguments are")
    unit = (unit_kernel, positions.pop(), tuple(extra))
    WORK_UNITS.append((unit, drivers))
    return unit


#: Every ``work_unit`` declared, with its drivers (for the test that checks their calls).
WORK_UNITS: list = []


_any_layout_entries: dict = {}
_ND = np.ndarray


def _arg_key(a, strided: bool):
    """What ``typeof`` reads of one argument: an array's dtype, axes and flags (at a strided position its layout
    and writeability are not part of the key: it is typed 'A' and writeable whatever they are), a tuple's
    class and elements' keys (parameter groups), any other value's class."""
    if isinstance(a, np.ndarray):
        flags = a.flags
        if strided:
            return a.dtype, a.ndim, flags.aligned
        return a.dtype, a.ndim, flags.writeable, flags.aligned, flags.c_contiguous, flags.f_contiguous
    if isinstance(a, tuple):  # a loop, not a generator: a decode call builds the keys of its groups each time
        key = [type(a)]
        for e in a:
            key.append(_arg_key(e, strided))
        return tuple(key)
    return type(a)


def _any_layout_type(t):
    """``t`` with every array in it (a tuple's elements included) typed any layout and writeable."""
    if isinstance(t, types.Array):
        return t.copy(layout="A", readonly=False)
    if isinstance(t, types.BaseTuple):
        return types.BaseTuple.from_types([_any_layout_type(e) for e in t], getattr(t, "instance_class", tuple))
    return t


#: dispatcher -> the argument positions its Python calls type any layout (``_any_layout_dispatch``).
_ANY_LAYOUT_POSITIONS: dict = {}


def _any_layout_dispatch(dispatcher, strided) -> None:
    """Make ``dispatcher``'s calls from Python run its any-layout specialisations: when Numba's C dispatcher meets
    argument types it has no entry for, it asks ``_compile_for_args`` for one; this instance's answer compiles (or
    loads from the cache) the specialisation with the arrays at ``strided`` (and those of any earlier call site)
    typed any layout, and registers it for the exact types met, so that later calls of those types take Numba's C
    fast path straight to it. Kernels that call ``dispatcher`` are typed as before."""
    positions = _ANY_LAYOUT_POSITIONS.get(dispatcher, frozenset()) | frozenset(strided)
    _ANY_LAYOUT_POSITIONS[dispatcher] = positions

    def compile_any_layout(*args, **kwargs):
        exact = [typeof(a) for a in args]
        signature = tuple(_any_layout_type(t) if i in positions else t for i, t in enumerate(exact))
        dispatcher.compile(signature)
        result = dispatcher.overloads[signature]
        dispatcher._insert([t._code for t in exact], result.entry_point, result.objectmode)
        return result.entry_point

    dispatcher._compile_for_args = compile_any_layout


def call_any_layout(dispatcher, strided, *args, unit=None):
    """Call ``dispatcher`` with the arrays at positions ``strided`` (arrays, or tuples holding arrays: parameter
    groups) typed as any layout ('A') and writeable.

    Numba would otherwise compile one specialisation (seconds each) per combination of contiguous and strided
    inputs; kernels that read their inputs through strides need only one per dtype combination. The other
    arrays (scratch the caller allocates) stay C-contiguous so that loops over them vectorise.

    Without a unit the call goes through Numba's own dispatcher (its C fast path: a fraction of a microsecond),
    which ``_any_layout_dispatch`` teaches, at each new combination of argument types, to run the any-layout
    specialisation. ``unit`` = (kernel, shared, extra): ``dispatcher`` is a driver whose first parameter is the
    handle of its work unit (``call_unit``), and the unit takes the driver's arguments at the positions ``shared``
    (of ``args``) followed by arguments of the types ``extra``; the handle is prepended to ``args``, and the
    compiled entry point is looked up here and called directly.
    """
    if unit is None:
        known = _ANY_LAYOUT_POSITIONS.get(dispatcher)
        if known is None or not known.issuperset(strided):
            _any_layout_dispatch(dispatcher, strided)
        return dispatcher(*args)
    key = [dispatcher]
    for i, a in enumerate(args):  # a plain loop, one flags object per array: decode calls build this key each time
        if a.__class__ is _ND:  # _arg_key's first case, inline: the common argument
            flags = a.flags
            key.append((a.dtype, a.ndim, flags.aligned) if i in strided else
                       (a.dtype, a.ndim, flags.writeable, flags.aligned, flags.c_contiguous, flags.f_contiguous))
        else:
            key.append(_arg_key(a, i in strided))
    key = tuple(key)
    cached = _any_layout_entries.get(key)
    if cached is None:
        signature = tuple(_any_layout_type(t) if i in strided else t for i, t in enumerate(map(typeof, args)))
        unit_kernel, shared, extra = unit
        handle = unit_address(unit_kernel, tuple(signature[i] for i in shared) + tuple(extra))
        signature = (HANDLE_TYPE,) + signature
        dispatcher.compile(signature)
        cached = _any_layout_entries[key] = (dispatcher.overloads[signature].entry_point, handle)
    entry, handle = cached
    result = entry(handle, *args)
    check_unit(handle)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Memory: software prefetch for loops whose arithmetic hides too little of the memory latency.
@intrinsic
def prefetch(typingctx, arr, offset):
    """Hint the CPU to bring the cache line holding element ``offset`` of the 1-D array ``arr`` into L1
    (``prefetcht0``). Never faults, so the offset may run past the end of the array."""
    if not (isinstance(arr, types.Array) and isinstance(offset, types.Integer)):
        raise TypingError("prefetch: expected an array and an integer offset")

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        prefetch_line(builder, builder.gep(data, [args[1]]))
        return context.get_dummy_value()

    return types.none(arr, offset), codegen


# ---------------------------------------------------------------------------------------------------------------
# Calls by address: a driver calls its work-unit kernel through the unit's machine-code address instead of linking
# the unit's code into its own. Numba links every callee into each caller and optimises and emits the whole again
# at every level (a parallel driver adds three levels of its own), so a unit of ~600 KB of IR cost ~1 s per level
# and most of a first call's compile time. Called by address, the unit is compiled once per signature and its
# drivers compile in a fraction of a second; the call itself costs what a direct call does.
def _signature_tag(arg_types) -> int:
    """A 62-bit tag of a unit's argument types, the same in every process (the kernel and the Python side agree
    on it before a call is made)."""
    return zlib.crc32(str(types.Tuple(tuple(arg_types))).encode()) | (len(arg_types) << 32)


_unit_addresses: dict = {}


def unit_address(dispatcher, arg_types: tuple) -> np.ndarray:
    """``[address, tag, mismatch flag]`` (int64) of ``dispatcher`` compiled (or loaded from Numba's cache) for
    ``arg_types``, for a driver to hand to ``call_unit``. Computed once per (kernel, signature)."""
    key = (dispatcher, arg_types)
    handle = _unit_addresses.get(key)
    if handle is None:
        handle = np.zeros(3, np.int64)
        _fill_handle(dispatcher, arg_types, handle)
        _unit_addresses[key] = handle
    return handle


#: The Numba type of a handle.
HANDLE_TYPE = types.Array(types.int64, 1, "C")


def _fill_handle(dispatcher, arg_types: tuple, handle: np.ndarray) -> None:
    """Compile ``dispatcher`` for ``arg_types`` (or load it from the cache) and write its address and tag."""
    dispatcher.compile(arg_types)
    result = dispatcher.overloads[arg_types]
    if result.signature.return_type != types.none:  # call_unit's calling convention returns nothing
        raise TypeError(f"a unit kernel must return nothing; {dispatcher.__name__} returns "
                        f"{result.signature.return_type}")
    handle[0] = result.library.get_pointer_to_function(result.fndesc.llvm_func_name)
    handle[1] = _signature_tag(arg_types)


def check_unit(handle: np.ndarray) -> None:
    """Raise if a driver found ``handle`` compiled for other argument types than it passes (a bug: the call was
    not made)."""
    if handle[2]:
        raise RuntimeError("fastattn internal error: a kernel was handed a unit compiled for other argument types")


@intrinsic
def call_unit(typingctx, handle, args):
    """Call the kernel ``handle`` (``unit_address``) holds with the tuple ``args``, through its address. The call
    is made only when the handle's tag matches the types of ``args``; otherwise ``handle[2]`` is set and nothing
    runs (``check_unit`` raises on it). The unit returns nothing; an exception it raises propagates."""
    if not (isinstance(handle, types.Array) and handle.dtype == types.int64 and isinstance(args, types.BaseTuple)):
        raise TypingError("call_unit: expected an int64 handle array and a tuple of arguments")
    arg_types = tuple(args.types)
    tag = _signature_tag(arg_types)

    def codegen(context, builder, signature, llargs):
        i64 = ir.IntType(64)
        data = context.make_array(signature.args[0])(context, builder, llargs[0]).data
        address = builder.load(data)
        matches = builder.icmp_signed("==", builder.load(builder.gep(data, [ir.Constant(i64, 1)])),
                                      ir.Constant(i64, tag))
        with builder.if_else(matches, likely=True) as (then, otherwise):
            with then:
                fnty = context.call_conv.get_function_type(types.none, arg_types)
                callee = builder.inttoptr(address, fnty.as_pointer())
                values = [builder.extract_value(llargs[1], i) for i in range(len(arg_types))]
                status, _ = context.call_conv.call_function(builder, callee, types.none, arg_types, values)
                with cgutils.if_unlikely(builder, status.is_error):
                    context.call_conv.return_status_propagate(builder, status)
            with otherwise:
                builder.store(ir.Constant(i64, 1), builder.gep(data, [ir.Constant(i64, 2)]))
        return context.get_dummy_value()

    return types.none(handle, args), codegen

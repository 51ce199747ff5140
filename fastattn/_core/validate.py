"""Argument checks shared by the reference and the fast paths (NumPy only, no Numba).

Every check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, value or range) with a
message that names the argument and says what was expected. Ops run all their checks before they write anything,
so a rejected call leaves its outputs untouched.
"""
from __future__ import annotations

import math
import sys
from typing import Iterable

import numpy as np

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
FLOAT64 = np.dtype(np.float64)
#: The largest finite float32: scalars the kernels use in float32 must stay within it.
FLOAT32_MAX = float(np.finfo(np.float32).max)
#: The storage dtypes NumPy itself has. ml_dtypes' bfloat16 is a storage dtype too, recognised by ``is_bfloat16``:
#: fastattn does not import ml_dtypes, whose import takes over a second (most of ``import fastattn`` else).
STORAGE_FLOATS: tuple[np.dtype, ...] = (FLOAT32, FLOAT16)
#: STORAGE_FLOATS as a set, for the parsers' one-probe checks (a miss goes on to the full check).
STORAGE_FLOAT_SET: frozenset[np.dtype] = frozenset(STORAGE_FLOATS)
#: dtype -> the integer dtype a kernel sees instead (``_core.kernel.kernel_view``): float16 as uint16 bits
#: (bfloat16, recognised by ``is_bfloat16``, as int16 bits); float32 and other Numba-typable dtypes are absent.
HALF_VIEW: dict[np.dtype, np.dtype] = {FLOAT16: np.dtype(np.uint16)}
#: The integer dtype a kernel sees for bfloat16.
BFLOAT16_VIEW = np.dtype(np.int16)


def bfloat16() -> np.dtype | None:
    """ml_dtypes' bfloat16 once something has imported ml_dtypes, else None (fastattn never imports it)."""
    module = sys.modules.get("ml_dtypes")
    return None if module is None else np.dtype(module.bfloat16)


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` (a numpy.dtype) is ml_dtypes' bfloat16, told from its kind, name and size without
    importing ml_dtypes (no bfloat16 array exists before something else has imported it)."""
    return getattr(dtype, "kind", None) == "V" and dtype.name == "bfloat16" and dtype.itemsize == 2


def half_view(dtype: np.dtype) -> np.dtype | None:
    """The integer dtype a kernel sees for ``dtype`` (float16: uint16, bfloat16: int16), None for the others."""
    view = HALF_VIEW.get(dtype)
    if view is None and dtype.kind == "V" and is_bfloat16(dtype):
        return BFLOAT16_VIEW
    return view


INDEX_INTS = (np.dtype(np.int32), np.dtype(np.int64))


def _names(dtypes: Iterable[np.dtype]) -> str:
    names = [str(np.dtype(d)) for d in dtypes]
    if dtypes is STORAGE_FLOATS:
        names.append("bfloat16")  # accepted too (``is_bfloat16``)
    return " or ".join(names)


def array(name: str, a, *, dtypes: Iterable[np.dtype], ndim: int | None = None, min_ndim: int | None = None
          ) -> np.ndarray:
    """``a`` must be an ndarray of one of ``dtypes`` with ``ndim`` (or at least ``min_ndim``) axes."""
    # ``dtype in dtypes`` compares with ==, which takes dtype-likes (np.float32) as well as np.dtype objects: no
    # conversion up front, as every op runs several of these checks on each call
    if not isinstance(dtypes, (tuple, list)):
        dtypes = tuple(dtypes)
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of {_names(dtypes)}, got {type(a).__name__}")
    if a.dtype not in dtypes and not (dtypes is STORAGE_FLOATS and is_bfloat16(a.dtype)):
        raise TypeError(f"{name} must have dtype {_names(dtypes)}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} axes, got shape {a.shape}")
    if min_ndim is not None and a.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} axes, got shape {a.shape}")
    return a


def out_array(name: str, out, *, shape: tuple[int, ...], dtypes: Iterable[np.dtype]) -> np.ndarray:
    """A caller's ``out=`` must be a writeable ndarray of exactly ``shape`` and one of ``dtypes``."""
    array(name, out, dtypes=dtypes)
    if out.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {out.shape}")
    if not out.flags.writeable:
        raise ValueError(f"{name} must be writeable")
    return out


def scalar(value):
    """The element of a 0-d ndarray (a NumPy scalar), else ``value`` itself. A 0-d array is what a 0-d torch
    tensor becomes (``_tensors.accept_tensors``) and what NumPy reductions return: it is read as the number it
    holds. Arrays with axes stay arrays, for the caller's TypeError."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value[()]
    return value


def scalar_type(value) -> str:
    """The type named in a scalar check's TypeError (an array's shape too: (1,) is not a scalar)."""
    if isinstance(value, np.ndarray):
        return f"an ndarray of shape {value.shape} (a scalar, or a 0-d array, is expected)"
    return type(value).__name__


def real(name: str, value, *, minimum: float | None = None, maximum: float | None = None) -> float:
    """A finite real scalar (Python or NumPy, or a 0-d array), optionally bounded; returned as a Python float."""
    if value.__class__ is not float:  # a Python float (the usual case) needs neither check nor conversion
        value = scalar(value)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a real number, got {scalar_type(value)}")
        value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer scalar (Python or NumPy, or a 0-d array; not bool), optionally bounded; returned as a Python
    int."""
    if value.__class__ is not int:  # a Python int (the usual case) needs neither check nor conversion
        value = scalar(value)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {scalar_type(value)}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def may_share_write(name: str, out: np.ndarray, *inputs: tuple[str, np.ndarray]) -> None:
    """Refuse an ``out`` that overlaps an input without being exactly that input (a partial alias)."""
    for input_name, a in inputs:
        if a is None or out is a:
            continue
        if np.may_share_memory(out, a) and not _same_view(out, a):
            raise ValueError(f"{name} overlaps {input_name} without being the same view; pass {input_name} "
                             f"itself for in-place use or a separate array")


def disjoint(name: str, out: np.ndarray, *inputs: tuple[str, np.ndarray | None]) -> None:
    """Refuse an ``out`` that shares any memory with an input it is not allowed to alias (an index array, a
    table, a weight read for every row): the op would read what it has already overwritten."""
    for input_name, a in inputs:
        if a is not None and np.may_share_memory(out, a):
            raise ValueError(f"{name} overlaps {input_name}; pass separate arrays")


def _same_view(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides and a.dtype.itemsize == b.dtype.itemsize)

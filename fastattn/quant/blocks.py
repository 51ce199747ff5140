"""``Quantized``: ggml's quantized blocks (Q8_0, Q4_0) in a uint8 array, shared by ``fastattn`` and the reference.

Blocks of ``BLOCK`` = 32 values, byte for byte ggml's layout (little-endian):

    q8_0  34 bytes   d: float16 | q[0..31]: int8                          value j = q[j] * d
    q4_0  18 bytes   d: float16 | qs[0..15]: low nibble value j,          value j      = (qs[j] & 15) - 8) * d
                                              high nibble value j + 16     value j + 16 = (qs[j] >> 4) - 8) * d

A ``Quantized`` holds ``data``, a uint8 array (..., n_blocks * block_bytes) whose last axis is contiguous (its
other axes may have any strides: a slice or a transpose of a cache), and ``qtype``; its logical ``shape`` is
``data.shape[:-1] + (n_blocks * 32,)``. NumPy only: importing this never loads Numba.
"""
from __future__ import annotations

import numpy as np

#: Values per block, in every type.
BLOCK = 32
#: Bytes per block of each type.
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
#: The kernels' code for each type.
QTYPE_CODES = {"q8_0": 0, "q4_0": 1}
QTYPES = tuple(BLOCK_BYTES)


class Quantized:
    """A quantized array: ``data`` uint8 (..., n_blocks * block_bytes), ``qtype`` "q8_0" or "q4_0".

    ``shape`` is the logical shape (the last axis counted in values), ``ndim`` its length. The last axis of
    ``data`` must be contiguous; the others may be strided views of a larger cache.
    """

    __slots__ = ("data", "qtype")

    def __init__(self, data: np.ndarray, qtype: str):
        if not isinstance(qtype, str) or qtype not in BLOCK_BYTES:
            raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
        if not isinstance(data, np.ndarray):
            raise TypeError(f"data must be a numpy.ndarray of uint8, got {type(data).__name__}")
        if data.dtype != np.uint8:
            raise TypeError(f"data must have dtype uint8 (ggml's block bytes), got {data.dtype}")
        if data.ndim < 1:
            raise ValueError("data must have at least one axis (the blocks' bytes)")
        width = BLOCK_BYTES[qtype]
        if data.shape[-1] % width:
            raise ValueError(f"data's last axis must be a whole number of {qtype} blocks ({width} bytes each), "
                             f"got {data.shape[-1]} bytes")
        # an empty array has no bytes out of place (NumPy may give it any strides, 0 included)
        if data.size and data.shape[-1] > 1 and data.strides[-1] != 1:
            raise ValueError(f"data's last axis must be contiguous (stride 1), got stride {data.strides[-1]}")
        self.data = data
        self.qtype = qtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape[:-1] + (self.data.shape[-1] // BLOCK_BYTES[self.qtype] * BLOCK,)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    def __repr__(self) -> str:
        return f"Quantized(qtype={self.qtype!r}, shape={self.shape})"


def empty(shape: tuple[int, ...], qtype: str) -> Quantized:
    """A new ``Quantized`` of logical ``shape`` (last axis a multiple of 32), its bytes zero (all values 0)."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    if shape[-1] % BLOCK:
        raise ValueError(f"the last axis must be a multiple of {BLOCK}, got shape {shape}")
    return Quantized(np.zeros(tuple(shape[:-1]) + (shape[-1] // BLOCK * BLOCK_BYTES[qtype],), np.uint8), qtype)


def values_array(name: str, x) -> np.ndarray:
    """The float32/float16 array ``quantize`` takes: (..., n) with n a multiple of 32."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32 or float16, got {type(x).__name__}")
    if x.dtype not in (np.float32, np.float16):
        raise TypeError(f"{name} must have dtype float32 or float16, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"{name}'s last axis must be a multiple of {BLOCK} (whole blocks), got shape {x.shape}")
    return x


def quantized_array(name: str, a) -> Quantized:
    if not isinstance(a, Quantized):
        raise TypeError(f"{name} must be a fastattn.Quantized, got {type(a).__name__}")
    return a

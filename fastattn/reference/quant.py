"""Reference Q8_0 / Q4_0 quantization: ggml's reference quantizers (``quantize_row_q8_0_ref``,
``quantize_row_q4_0_ref``) and dequantizers, block by block in NumPy.

Unlike the other references this one computes in float32, because the definition is ggml's float32 arithmetic:
the scale ``d``, its inverse and the scaled values are float32 (float16 input is widened exactly first), and the
stored ``d`` is ``d`` rounded to float16 (nearest even). The bytes then equal ggml's and the ``gguf`` package's.

    q8_0: d = amax / 127;  q[j] = roundf(x[j] · (1/d))      (half away from zero; d == 0: all zero)
    q4_0: d = m / -8, m the value of largest magnitude (the first on ties; +0 for a block of zeros, so its
          d is -0.0); q[j] = min(15, trunc(x[j] · (1/d) + 8.5))  (d == 0: every q is 8, the value 0)
"""
from __future__ import annotations

import numpy as np

from ..quant.blocks import BLOCK, BLOCK_BYTES, Quantized, quantized_array, values_array

_F32 = np.float32


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf: to nearest, halves away from zero (exact: v - trunc(v) is exact in float32)."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= _F32(0.5), np.sign(v), _F32(0.0)).astype(_F32)


def _inverse(d: np.ndarray) -> np.ndarray:
    safe = np.where(d != 0, d, _F32(1.0))
    return np.where(d != 0, _F32(1.0) / safe, _F32(0.0)).astype(_F32)


def quantize(x: np.ndarray, qtype: str) -> Quantized:
    """Quantize float32/float16 ``x`` (..., n), n % 32 == 0, into a new ``Quantized`` of ``qtype``."""
    x = values_array("x", x)
    if not isinstance(qtype, str) or qtype not in BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {tuple(BLOCK_BYTES)}, got {qtype!r}")
    blocks = x.astype(_F32).reshape(-1, BLOCK)
    # a block holding inf or NaN gets an inf or NaN scale and codes cast from NaN, and a scale past float16's range
    # is stored as inf: ggml's float arithmetic does the same (these bytes match gguf's), so NumPy's warnings are off
    with np.errstate(over="ignore", invalid="ignore"):
        d, body = _quantize_blocks(blocks, qtype)
        d_bytes = d.astype(np.float16).astype("<f2").view(np.uint8).reshape(-1, 2)
    data = np.concatenate([d_bytes, body], axis=1)
    return Quantized(data.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK * BLOCK_BYTES[qtype],)), qtype)


def _quantize_blocks(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(d (n_blocks,) float32, the code bytes (n_blocks, 16 or 32)) of float32 ``blocks`` (n_blocks, 32)."""
    if qtype == "q8_0":
        amax = np.abs(blocks).max(axis=1) if blocks.size else np.zeros(0, _F32)
        d = (amax / _F32(127.0)).astype(_F32)
        q = _roundf(blocks * _inverse(d)[:, None]).astype(np.int8)
        body = q.view(np.uint8)
    else:
        first = np.argmax(np.abs(blocks), axis=1) if blocks.size else np.zeros(0, np.int64)
        m = blocks[np.arange(blocks.shape[0]), first]
        m = np.where(m == 0, _F32(0.0), m)  # ggml starts m at +0 and keeps it for a block of zeros (of any sign)
        d = (m / _F32(-8.0)).astype(_F32)
        scaled = blocks * _inverse(d)[:, None]
        q = np.minimum(15, np.trunc(scaled + _F32(8.5))).astype(np.uint8)
        body = q[:, :BLOCK // 2] | (q[:, BLOCK // 2:] << 4)
    return d, body


def dequantize(a: Quantized) -> np.ndarray:
    """The float32 values of ``a`` (its logical shape): q · d per block, as ggml's dequantizers."""
    a = quantized_array("a", a)
    width = BLOCK_BYTES[a.qtype]
    blocks = np.ascontiguousarray(a.data).reshape(-1, width)
    d = blocks[:, :2].copy().view("<f2").astype(_F32)  # (n_blocks, 1)
    if a.qtype == "q8_0":
        q = blocks[:, 2:].view(np.int8).astype(_F32)
    else:
        nibbles = blocks[:, 2:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=1).astype(_F32) - _F32(8.0)
    with np.errstate(invalid="ignore"):  # an inf scale times a code of 0 is NaN, as in ggml's dequantizers
        return (q * d).astype(_F32).reshape(a.shape)

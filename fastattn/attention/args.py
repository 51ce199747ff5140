"""Argument parsing for ``flash_attn_ext`` (shared by the reference and the fast paths)."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .._core import validate as v
from ..quant.blocks import Quantized

PATHS = ("auto", "one_chunk", "tiled", "split_kv")
#: The kernels compute in float32: scalars beyond its range would turn into inf there (NaN or zero outputs).
FLOAT32_MAX = v.FLOAT32_MAX
#: More query or KV heads than any model has: such a count is the token axis of a token-major (B, N, H, D) array
#: read as (B, H, N, D), which would give wrong numbers silently whenever the counts happen to divide.
MAX_HEADS = 256
#: The smallest positive logit_softcap: below it float32 rounds the cap to 0, which the kernels read as "off".
SOFTCAP_MIN = float(np.finfo(np.float32).smallest_subnormal)


def default_scale(DK: int) -> float:
    """``scale`` when none is given: DK^-0.5, as torch's scaled_dot_product_attention and FlashAttention."""
    return DK ** -0.5


class AttentionArgs(NamedTuple):
    q: np.ndarray  # (B, Hq, Nq, DK) float32
    k: np.ndarray | Quantized  # (Bk, Hkv, Nkv, DK) float32 / float16 / bfloat16, or Q8_0 / Q4_0 blocks
    v: np.ndarray | Quantized  # (Bk, Hkv, Nkv, DV)
    mask: np.ndarray | None  # (Bm, Hm, Nm, Nkv) float32 / float16: always 4-D here (a view, no copy)
    scale: float
    max_bias: float
    logit_softcap: float
    sinks: np.ndarray | None  # (Hq,) float32
    path: str
    out: np.ndarray | None  # (B, Nq, Hq, DV)
    out_shape: tuple[int, int, int, int]


def parse(q, k, vv, mask, scale, max_bias, logit_softcap, sinks, path, out, *, out_dtypes) -> AttentionArgs:
    v.array("q", q, dtypes=(v.FLOAT32,), ndim=4)
    _kv_array("k", k)
    _kv_array("v", vv)
    B, Hq, Nq, DK = q.shape
    Bk, Hkv, Nkv, DKk = k.shape
    DV = vv.shape[3]
    if min(q.shape) < 1 or min(k.shape) < 1 or min(vv.shape) < 1:
        raise ValueError(f"q, k and v must have no empty axis, got q {q.shape}, k {k.shape}, v {vv.shape}")
    if Hq > MAX_HEADS or Hkv > MAX_HEADS:
        raise ValueError(f"q and k must have at most {MAX_HEADS} heads on axis 1, got q.shape {q.shape} and k.shape "
                         f"{k.shape}: {_TOKEN_MAJOR}")
    if isinstance(out, np.ndarray) and out.shape == (B, Hq, Nq, DV) and Hq != Nq:
        # out reads as (B, Hq, Nq, DV): either q, k, v are token-major and out is in their layout, or out alone
        # is in torch's (B, H, N, D) layout; nothing here tells which, so the message gives both fixes
        raise ValueError(f"out must have shape (B, Nq, Hq, DV) = {(B, Nq, Hq, DV)} (ggml's permuted output), got "
                         f"{out.shape}, which swaps Hq = {Hq} and Nq = {Nq}. Either q, k and v are token-major: "
                         f"{_TOKEN_MAJOR}; or out is in torch's (B, H, N, D) output layout; pass "
                         f"out.transpose(0, 2, 1, 3), a view that writes the same array")
    if DKk != DK:
        raise ValueError(f"k must have head size DK = q.shape[3] = {DK}, got k.shape {k.shape}")
    if vv.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must match k in (batch, heads, rows) {k.shape[:3]}, got v.shape {vv.shape}")
    if Hq % Hkv:
        raise ValueError(f"k heads ({Hkv}) must divide q heads ({Hq}) for GQA{_token_major_hint(q, k)}")
    if B % Bk:
        raise ValueError(f"k batch ({Bk}) must divide q batch ({B})")
    if mask is not None:
        if isinstance(mask, np.ndarray) and mask.dtype == np.bool_:
            raise TypeError("mask must be additive (float32 or float16, -inf hides a key), got a boolean mask; "
                            "torch's boolean mask (True takes part) is np.where(mask, 0, -np.inf)"
                            ".astype(np.float32)")
        v.array("mask", mask, dtypes=(v.FLOAT32, v.FLOAT16))
        if not 2 <= mask.ndim <= 4:
            raise ValueError(f"mask must have 2 to 4 axes (..., Nq, Nkv), got shape {mask.shape}")
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape) if mask.ndim < 4 else mask
        Bm, Hm, Nm, Nkm = mask.shape
        if Nkm != Nkv:
            raise ValueError(f"mask must have exactly Nkv = {Nkv} columns, got shape {mask.shape}"
                             f"{_token_major_hint(q, k) if Nkm == k.shape[1] else ''}")
        if Nm < Nq:
            raise ValueError(f"mask must have at least Nq = {Nq} rows, got shape {mask.shape}")
        if Bm < 1 or Hm < 1 or Hq % Hm or B % Bm:
            raise ValueError(f"mask's head axis must divide Hq = {Hq} and its batch axis B = {B}, "
                             f"got shape {mask.shape}")
    scale = default_scale(DK) if scale is None else v.real("scale", scale)
    if not abs(scale) <= FLOAT32_MAX:
        raise ValueError(f"scale must be in float32's range [-{FLOAT32_MAX}, {FLOAT32_MAX}], got {scale}")
    max_bias = v.real("max_bias", max_bias)
    if not 0.0 <= max_bias <= FLOAT32_MAX:
        raise ValueError(f"max_bias must be in [0, {FLOAT32_MAX}], got {max_bias}")
    logit_softcap = v.real("logit_softcap", logit_softcap)
    if not (logit_softcap == 0.0 or SOFTCAP_MIN <= logit_softcap <= FLOAT32_MAX):
        raise ValueError(f"logit_softcap must be 0 (off) or in [{SOFTCAP_MIN}, {FLOAT32_MAX}] (float32's range), "
                         f"got {logit_softcap}")
    if sinks is not None:
        v.array("sinks", sinks, dtypes=(v.FLOAT32,), ndim=1)
        if sinks.shape[0] != Hq:
            raise ValueError(f"sinks must have shape (Hq,) = ({Hq},), got {sinks.shape}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    out_shape = (B, Nq, Hq, DV)
    if out is not None:
        v.out_array("out", out, shape=out_shape, dtypes=out_dtypes)
        for name, a in (("q", q), ("k", _memory(k)), ("v", _memory(vv)), ("mask", mask), ("sinks", sinks)):
            if a is not None and np.may_share_memory(out, a):
                raise ValueError(f"out must not overlap {name}")
    return AttentionArgs(q, k, vv, mask, scale, max_bias, logit_softcap, sinks, path, out, out_shape)


def _kv_array(name: str, a) -> None:
    """K or V: a 4-axis float32/float16/bfloat16 ndarray, or a ``Quantized`` of 4 logical axes."""
    if isinstance(a, Quantized):
        if a.ndim != 4:
            raise ValueError(f"{name} must have 4 axes (Bk, Hkv, Nkv, D), got the Quantized shape {a.shape}")
        return
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of {v._names(v.STORAGE_FLOATS)} or a "
                        f"fastattn.Quantized, got {type(a).__name__}")
    v.array(name, a, dtypes=v.STORAGE_FLOATS, ndim=4)


def _memory(a):
    """The array holding ``a``'s memory (a ``Quantized``'s bytes)."""
    return a.data if isinstance(a, Quantized) else a


_TOKEN_MAJOR = ("q, k and v must be (B, H, N, D), as torch's scaled_dot_product_attention takes them; token-major "
                "(B, N, H, D) arrays (FlashAttention's layout) can be passed as x.transpose(0, 2, 1, 3), a view "
                "(no copy)")


def _token_major_hint(q: np.ndarray, k: np.ndarray) -> str:
    """A hint when q and k read as token-major (B, N, H, D) (flash-attn's, llama.cpp's) would be valid."""
    if q.shape[2] % k.shape[2] == 0:
        return (f"; q {q.shape} and k {k.shape} look token-major (B, N, H, D): flash_attn_ext takes "
                f"(B, H, N, D), as torch's scaled_dot_product_attention and transformers do: pass "
                f"q.transpose(0, 2, 1, 3) and the same for k, v (views, nothing is copied)")
    return ""


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ggml's ALiBi slope per head (float64); all ones when ``max_bias`` is 0.

    n_head_log2 is the largest power of two <= n_head; heads below it get m0**(h+1), the rest
    m1**(2(h - n_head_log2) + 1), with m0 = 2**(-max_bias/n_head_log2) and m1 = 2**(-max_bias/2/n_head_log2).
    """
    if max_bias <= 0.0:
        return np.ones(n_head)
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)  # 0.0 for a large max_bias: slopes of 0 (a -inf mask still hides)
    m1 = 2.0 ** (-max_bias / 2.0 / n_head_log2)
    h = np.arange(n_head)
    low = h < n_head_log2
    slopes = np.empty(n_head)
    # each formula only on its own heads: the other's negative powers of m1 = 0 would divide by zero
    with np.errstate(under="ignore"):
        slopes[low] = m0 ** (h[low] + 1)
        slopes[~low] = m1 ** (2 * (h[~low] - n_head_log2) + 1)
    return slopes

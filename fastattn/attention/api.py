"""``flash_attn_ext``: attention with ggml's semantics, three fast paths and ggml's selection rule.

    out[b, i, h] = softmax_j(scale q_i.k_j [softcap] + slope_h mask[b % Bm, h % Hm, i, j], sink_h) V

with GQA (query head h reads KV head h // (Hq // Hkv)) and K/V batch broadcast (query batch b reads K/V batch
b // (B // Bk)). The output is (B, Nq, Hq, DV) float32, ggml's permuted layout.

This module parses the arguments (``fastattn.attention.args``, shared with the reference), turns K, V and the
mask into kernel views (float16 as uint16 bits, bfloat16 as int16 bits: nothing is copied or widened up front),
computes the ALiBi slopes, allocates ``out`` when needed, and hands everything to one path module:

- ``one_chunk`` (``attention.one_chunk``): per query row, online softmax over the whole KV range;
- ``tiled`` (``attention.tiled``): Q tiles x KV tiles, for prefill;
- ``split_kv`` (``attention.split_kv``): decode, KV chunks reduced in a fixed order (thread-count independent).

``flash_attn_ext_slopes`` is the same call with the caller's ALiBi slopes (FlashAttention's ``alibi_slopes``) in
place of ggml's max_bias; ``flash_attn_ext_checked`` runs it without the checks, for FlashAttention's API, which
has checked its own arguments (``attention.flash_args``).

``auto`` follows ggml, except that decode keeps one_chunk on one thread and while its KV heads keep the threads
evenly busy (see ``choose_path`` and docs/attention.md for why).
"""
from __future__ import annotations

import functools

import numpy as np

from .._core import threads as _threads
from . import args as _args
from .one_chunk import run_one_chunk
from .paged import Pages
from .split_kv import run_split_kv
from .tiled import Q_TILE, run_tiled
from .._core.kernel import FLOAT16, FLOAT32, kernel_view
from ..quant.blocks import Quantized
from ..quant.api import bytes_view

#: Nkv from which ``auto`` takes split_kv for decode (ggml's threshold).
SPLIT_KV_MIN_NKV = 512
#: ``auto`` keeps one_chunk for decode when its (batch, KV head) units share evenly among the threads or there are
#: at least this many per thread: with 2, 4 or 8 KV heads on 2 threads, and on one thread, one_chunk ran faster
#: than split_kv side by side (docs/attention.md, "`auto`").
ONE_CHUNK_MIN_UNITS_PER_THREAD = 4


def choose_path(B: int, Nq: int, Hkv: int, Nkv: int, k_dtype, v_dtype, n_threads: int = 1) -> str:
    """The path ``auto`` takes for these sizes, K/V storage types (a dtype, or "q8_0" / "q4_0") and thread count.

    split_kv for decode (Nq == 1, B == 1, K and V of one type among float32, float16 (ggml's rule), q8_0 and q4_0,
    Nkv >= SPLIT_KV_MIN_NKV) on several threads when the (batch, KV head) units would keep them unevenly busy (not
    a multiple of the thread count, and fewer than ONE_CHUNK_MIN_UNITS_PER_THREAD per thread); tiled when Nq
    reaches the tiled path's Q tile; one_chunk otherwise.
    """
    units = B * Hkv  # one_chunk's decode units: one per (batch, KV head)
    if (Nq == 1 and B == 1 and Nkv >= SPLIT_KV_MIN_NKV and n_threads > 1 and units % n_threads != 0
            and units < ONE_CHUNK_MIN_UNITS_PER_THREAD * n_threads and _split_storage(k_dtype, v_dtype)):
        return "split_kv"
    if Nq >= Q_TILE:
        return "tiled"
    return "one_chunk"


#: The storage types ``auto`` splits decode for: ggml's float32 and float16, and the quantized types (ggml reads
#: those only on one_chunk; here every path reads them).
_SPLIT_STORAGES = (FLOAT32, FLOAT16, "q8_0", "q4_0")


def _split_storage(k_storage, v_storage) -> bool:
    """K and V of one storage type split_kv is chosen for."""
    return k_storage == v_storage and k_storage in _SPLIT_STORAGES


def _storage(a):
    """The storage type of K or V: its dtype, or its qtype when quantized."""
    return a.qtype if a.__class__ is Quantized else a.dtype


def _kv_kernel_view(a):
    """K or V as the kernels read it: ``kernel_view``, or a quantized array's bytes (``quant.bytes_view``)."""
    return bytes_view(a) if a.__class__ is Quantized else kernel_view(a)


@functools.lru_cache(maxsize=64)
def _slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ALiBi slopes as float32, computed once per (heads, max_bias); kernels only read them."""
    return _args.alibi_slopes(n_head, max_bias).astype(FLOAT32)


def _runner(path: str):
    if path == "one_chunk":
        return run_one_chunk
    if path == "split_kv":
        return run_split_kv
    return run_tiled


def flash_attn_ext(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                   scale: float | None = None, max_bias: float = 0.0, logit_softcap: float = 0.0,
                   sinks: np.ndarray | None = None, path: str = "auto", out: np.ndarray | None = None
                   ) -> np.ndarray:
    """softmax(scale·QKᵀ [softcap] + slope·mask, sinks) V; returns ``out`` (B, Nq, Hq, DV) float32.

    q (B, Hq, Nq, DK) float32; k (Bk, Hkv, Nkv, DK) and v (Bk, Hkv, Nkv, DV) float32, float16 or bfloat16
    ndarrays or ``Quantized`` (Q8_0 / Q4_0, D a multiple of 32, read as their dequantized values), with
    Hq % Hkv == 0 and B % Bk == 0 (at most 256 heads: more raise ValueError, as a token-major (B, N, H, D) call
    would give them; pass such arrays as ``x.transpose(0, 2, 1, 3)``); ``scale`` defaults to DK^-0.5; mask
    float32/float16 with 2 to 4 axes (..., >= Nq rows, Nkv columns), its head and batch axes dividing Hq and B
    (applied modulo, as ggml); ``-inf`` masks. ``max_bias`` > 0 multiplies the mask by ggml's ALiBi slope of each
    head; ``logit_softcap`` > 0 applies softcap·tanh(s/softcap) before the mask; ``sinks`` (Hq,) float32 joins
    each head's softmax denominator. ``path``: "auto", "one_chunk", "tiled" or "split_kv" (Nq == 1 only). Every
    input may be a strided view; ``out`` (float32, any strides, not overlapping an input) is written in full. Rows
    with every score masked give zeros.
    """
    a = _args.parse(q, k, v, mask, scale, max_bias, logit_softcap, sinks, path, out, out_dtypes=(FLOAT32,))
    return _run(a, q, k, v, _slopes(q.shape[1], a.max_bias), out)


def flash_attn_ext_slopes(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                          slopes: np.ndarray, *, scale: float | None = None, logit_softcap: float = 0.0,
                          path: str = "auto", out: np.ndarray | None = None) -> np.ndarray:
    """``flash_attn_ext`` with the caller's ALiBi slopes: softmax(scale·QKᵀ [softcap] + slopes[h]·mask) V.

    ``slopes`` (Hq,) float32, finite (FlashAttention's ``alibi_slopes`` are given, not derived from a max_bias);
    a ``-inf`` mask entry hides its key whatever the slope, 0 included. The other arguments as ``flash_attn_ext``
    (no sinks). Returns ``out`` (B, Nq, Hq, DV) float32."""
    a = _args.parse(q, k, v, mask, scale, 0.0, logit_softcap, None, path, out, out_dtypes=(FLOAT32,))
    if not (isinstance(slopes, np.ndarray) and slopes.dtype == FLOAT32 and slopes.shape == (q.shape[1],)):
        raise ValueError(f"slopes must be a ({q.shape[1]},) float32 array (one per query head), got "
                         f"{getattr(slopes, 'shape', type(slopes).__name__)} {getattr(slopes, 'dtype', '')}")
    if not np.isfinite(slopes).all():
        raise ValueError("slopes must be finite")
    if out is not None and np.may_share_memory(out, slopes):
        raise ValueError("out must not overlap slopes")
    # contiguous and writeable, as _slopes' arrays: the kernels are compiled for that array type only
    return _run(a, q, k, v, slopes if slopes.flags.c_contiguous and slopes.flags.writeable else slopes.copy(), out)


def flash_attn_ext_checked(q: np.ndarray, k, v, mask: np.ndarray | None, slopes: np.ndarray, scale: float,
                           logit_softcap: float, path: str, out: np.ndarray, pages: Pages | None = None) -> None:
    """``flash_attn_ext_slopes`` without the argument checks, for a caller whose arguments are valid by
    construction (``fastattn.integrations.flash_attn``, after ``fastattn.attention.flash_args`` checked them): q
    (B, Hq, Nq, DK) float32, k/v as ``flash_attn_ext`` takes them, no axis empty, mask None or (Nq, Nkv)
    float32/float16, slopes (Hq,) float32 contiguous and writeable, scale and logit_softcap in float32's range,
    ``path`` valid for Nq, out (B, Nq, Hq, DV) float32 overlapping no input. The checks cost a decode-sized
    call several microseconds; invalid arguments here are undefined behaviour.

    With ``pages`` (``attention.paged.Pages``, table entries valid pages, live rows within the table), k/v are
    paged caches as (num_pages, Hkv, P, DK|DV) views and batch entry b attends over its live rows read through the
    table (Nkv, the mask's columns: the longest live range). ``auto`` chooses as for contiguous K/V of that Nkv,
    with one_chunk where that would be tiled (tiled does not read pages); ``tiled`` is not a paged path."""
    a = _args.AttentionArgs(q, k, v, None if mask is None else mask[None, None], scale, 0.0, logit_softcap, None,
                            path, out, out.shape)
    _run(a, q, k, v, slopes, out, pages)


def _run(a: _args.AttentionArgs, q, k, v, slopes: np.ndarray, out, pages: Pages | None = None) -> np.ndarray:
    """Choose the path of a parsed call and run it with ``slopes`` (Hq,) float32 (and ``pages``, see
    ``flash_attn_ext_checked``)."""
    B, Hq, Nq, _ = q.shape
    Nkv = k.shape[2] if pages is None else int((pages.ends - pages.starts).max())
    if a.path == "auto":
        name = choose_path(B, Nq, k.shape[1], Nkv, _storage(k), _storage(v), _threads.get_num_threads())
    else:
        name = a.path
    if name == "split_kv" and Nq != 1:
        raise ValueError(f"path 'split_kv' is for decode: q must have Nq = 1 query row, got q.shape {q.shape}")
    result = np.empty(a.out_shape, FLOAT32) if out is None else out
    args = (q, _kv_kernel_view(k), _kv_kernel_view(v), None if a.mask is None else kernel_view(a.mask), slopes,
            a.sinks, a.scale, a.logit_softcap, result)
    if pages is None:
        _runner(name)(*args)
    else:
        (run_split_kv if name == "split_kv" else run_one_chunk)(*args, pages)
    return result

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

``auto`` follows ggml, except that decode keeps one_chunk on one thread and while its KV heads keep the threads
evenly busy (see ``choose_path`` and docs/attention.md for why).

Decode calls that run one_chunk without mask, sinks, ALiBi or softcap take the route ``attention.decode``
(``_core.dispatch``): ``attention.one_chunk.decode_fast``, checks in the kernel.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
from numba import types

from .._core import threads as _threads
from . import args as _args
from .layout import no_sinks
from .group import group_rows_handle, stream_rows_handle
from .one_chunk import STREAM_UNIT, UNIT, decode_fast, run_one_chunk, splits_decode
from .split_kv import run_split_kv
from .tiled import Q_TILE, run_tiled
from .._core.dispatch import Route, array_type
from .._core.kernel import HALF_VIEW, FLOAT16, FLOAT32, kernel_view, unit_address
from ..quant.blocks import Quantized
from ..quant.api import bytes_view

#: Nkv from which ``auto`` takes split_kv for decode (ggml's threshold).
SPLIT_KV_MIN_NKV = 512
#: ``auto`` keeps one_chunk for decode when its (batch, KV head) units share evenly among the threads or there are
#: at least this many per thread: with 2, 4 or 8 KV heads on 2 threads, and on one thread, one_chunk ran faster
#: than split_kv side by side (docs/attention.md, "`auto`").
ONE_CHUNK_MIN_UNITS_PER_THREAD = 4
_ND = np.ndarray
_F64 = np.float64  # 1 / np.sqrt(DK): a scale the fast path takes as it is


def choose_path(B: int, Nq: int, Hkv: int, Nkv: int, k_dtype, v_dtype, n_threads: int = 1) -> str:
    """The path ``auto`` takes for these sizes, K/V storage types (a dtype, or "q8_0" / "q4_0") and thread count.

    split_kv for decode (Nq == 1, B == 1, K and V of one type among float32, float16 (ggml's rule), q8_0 and q4_0,
    Nkv >= SPLIT_KV_MIN_NKV) on several threads when the (batch, KV head) units would keep them unevenly busy (not
    a multiple of the thread count, and fewer than ONE_CHUNK_MIN_UNITS_PER_THREAD per thread); tiled when Nq
    reaches the tiled path's Q tile; one_chunk otherwise.
    """
    if splits_decode(B, Nq, Hkv, Nkv, _split_storage(k_dtype, v_dtype), n_threads, SPLIT_KV_MIN_NKV,
                     ONE_CHUNK_MIN_UNITS_PER_THREAD):
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
    if (mask is None and sinks is None and (scale.__class__ is float or scale.__class__ is _F64 or scale is None)
            and max_bias.__class__ is float
            and logit_softcap.__class__ is float and max_bias == 0.0 and logit_softcap == 0.0
            and path.__class__ is str and (path == "auto" or path == "one_chunk") and q.__class__ is _ND
            and k.__class__ is _ND and v.__class__ is _ND and q.ndim == 4 and k.ndim == 4 and v.ndim == 4
            and q.dtype is FLOAT32 and (out is None or (out.__class__ is _ND and out.ndim == 4
                                                        and out.dtype is FLOAT32 and out.flags.writeable))):
        entry = _decode_route.get((k.dtype, v.dtype))  # the route (see _dispatch)
        if entry is not None and q.shape[2] == 1:  # decode only: no wasted out for a prefill call
            Hq = q.shape[1]
            if scale is None:  # the parser's default; an empty head (DK 0) is declined by the entry, then refused
                scale = _args.default_scale(q.shape[3]) if q.shape[3] else 1.0
            result = np.empty((q.shape[0], 1, Hq, v.shape[3]), FLOAT32) if out is None else out
            n_threads = _threads.get_num_threads()
            with _decode_team(q, k, v, n_threads) as launch:
                if entry(q, k, v, result, _slopes(Hq, 0.0), no_sinks(Hq), scale,
                         path == "auto" and _split_storage(k.dtype, v.dtype), SPLIT_KV_MIN_NKV,
                         ONE_CHUNK_MIN_UNITS_PER_THREAD, _threads.PARALLEL_MIN_BYTES, n_threads, launch.n):
                    return result
                launch.cancel()
    a = _args.parse(q, k, v, mask, scale, max_bias, logit_softcap, sinks, path, out, out_dtypes=(FLOAT32,))
    B, Hq, Nq, _ = q.shape
    Nkv = k.shape[2]
    if a.path == "auto":
        name = choose_path(B, Nq, k.shape[1], Nkv, _storage(k), _storage(v), _threads.get_num_threads())
    else:
        name = a.path
    if name == "split_kv" and Nq != 1:
        raise ValueError(f"path 'split_kv' is for decode: q must have Nq = 1 query row, got q.shape {q.shape}")
    result = np.empty(a.out_shape, FLOAT32) if out is None else out
    slopes = _slopes(Hq, a.max_bias)
    if (name == "one_chunk" and Nq == 1 and mask is None and sinks is None and a.max_bias == 0.0
            and a.logit_softcap == 0.0 and k.__class__ is _ND and v.__class__ is _ND):
        n_threads = _threads.get_num_threads()
        with _decode_team(q, k, v, n_threads) as launch:
            if _decode_route.run((k.dtype, v.dtype), q, k, v, result, slopes, no_sinks(Hq), a.scale, False,
                                 SPLIT_KV_MIN_NKV, ONE_CHUNK_MIN_UNITS_PER_THREAD, _threads.PARALLEL_MIN_BYTES,
                                 n_threads, launch.n):
                return result
            launch.cancel()
    _runner(name)(q, _kv_kernel_view(k), _kv_kernel_view(v), None if a.mask is None else kernel_view(a.mask), slopes,
                  a.sinks, a.scale, a.logit_softcap, result)
    return result


def _decode_team(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_threads: int) -> _threads.Launch:
    """The measured team of a decode route call (``_core.threads.team``): K/V bytes as ``decode_fast`` counts them."""
    nbytes = q.shape[0] * k.shape[1] * k.shape[2] * (k.shape[3] * k.itemsize + v.shape[3] * v.itemsize)
    return _threads.team("decode", nbytes, n_threads if nbytes >= _threads.PARALLEL_MIN_BYTES else 1)


def _route_types(k_dtype, v_dtype) -> tuple:
    vector = array_type(FLOAT32, 1)
    return (array_type(FLOAT32, 4), array_type(k_dtype, 4), array_type(v_dtype, 4), array_type(FLOAT32, 4), vector,
            vector, types.float64, types.boolean, types.int64, types.int64, types.int64, types.int64, types.int64)


def _route_unit(k_dtype, v_dtype) -> tuple:
    """The handles ``decode_fast`` takes: one_chunk's unit (float32 K/V: its streaming variant) for the argument
    types ``decode_fast`` passes it (no mask, contiguous slopes and sinks, no per-head mask), and ``group_rows``'
    (float32 K/V: ``stream_rows``', which the streaming unit calls)."""
    a4 = array_type(FLOAT32, 4)
    c1 = types.Array(types.float32, 1, "C")
    streaming = k_dtype == FLOAT32 and v_dtype == FLOAT32
    rows = stream_rows_handle() if streaming else group_rows_handle(HALF_VIEW.get(k_dtype, k_dtype),
                                                       HALF_VIEW.get(v_dtype, v_dtype), None, None)
    unit = unit_address(STREAM_UNIT if streaming else UNIT[0],
                        (a4, array_type(k_dtype, 4), array_type(v_dtype, 4), types.none, c1, c1, types.float32,
                         types.float32, a4, types.Array(types.int64, 4, "C"), types.none, numba.typeof(rows),
                         types.int64))
    return unit, rows


#: Decode calls on one_chunk without mask, sinks, ALiBi or softcap, keyed on (k, v) dtypes (read-only K/V fit it
#: too: only the static typing differs; bfloat16 travels as its int16 view, float16 as uint16).
_decode_route = Route("attention.decode", decode_fast, _route_types, _route_unit)

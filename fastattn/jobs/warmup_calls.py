"""What each warm-up unit calls: every public op on decode-sized and large inputs of one dtype.

The calls go through the public ops (``fastattn.X``) only, so they warm whichever kernels the ops pick, however
they are written: small inputs (serial kernels, the decode fast paths) and inputs moving >= 1 MiB (the parallel
kernels, at more than one thread), contiguous arrays and strided views (a fused QKV projection's Q, a KV cache
read through a transposed view), in place and out of place. Attention also runs a prefill of >= 64 query rows
(the tiled path), decode with Nkv >= 512 (split_kv), and each path by name. Every call is made twice: a first
call through an op's general path records the fast path's entry point, which the second call takes.

A quantized type ("q8_0", "q4_0") names a KV cache stored in that type: its units write such caches
(``quantize``, ``set_rows``, ``rope_set_rows``) and read them (``flash_attn_ext`` with ``Quantized`` K and V);
the norms take no quantized input, so they have no unit for it.

A combination an op does not support (it raises ``TypeError`` for the dtype) is skipped: there is nothing of it
to compile.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

#: rows x 1024 columns: 512 rows move >= 1 MiB in every dtype (the parallel kernels), 1 row is a decode step.
_WIDTH = 1024
_LARGE_ROWS = 512
_HEADS, _HEADS_KV, _HEAD_DIM = 8, 2, 128
#: The quantized KV cache types a unit can be for.
QUANTIZED = ("q8_0", "q4_0")


def dtype_of(name: str) -> np.dtype | str:
    """float32, float16 or bfloat16 (ml_dtypes) by name, or a quantized type's name (``QUANTIZED``) as is;
    ``ValueError`` for anything else."""
    if name in QUANTIZED:
        return name
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("dtypes: bfloat16 needs ml_dtypes (python -m pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    if name in ("float32", "float16"):
        return np.dtype(name)
    raise ValueError(f"dtypes: expected float32, float16, bfloat16, q8_0 or q4_0, got {name!r}")


class _Calls:
    """Makes calls, twice each, counting those an op rejected for their dtypes."""

    def __init__(self) -> None:
        self.made = 0
        self.skipped = 0

    def __call__(self, fn: Callable[[], object]) -> None:
        try:
            fn()
            fn()
            self.made += 1
        except TypeError:
            self.skipped += 1


def _data(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def norm(dtype: np.dtype, call: _Calls) -> None:
    import fastattn

    rng = np.random.default_rng(0)
    for w_dtype in dict.fromkeys((dtype, np.dtype(np.float32))):
        w = (1 + 0.1 * rng.standard_normal(_WIDTH)).astype(w_dtype)
        for rows in (1, 4, _LARGE_ROWS):
            x, residual = _data(rng, (rows, _WIDTH), dtype), _data(rng, (rows, _WIDTH), dtype)
            wide = _data(rng, (rows, 3 * _WIDTH), dtype)
            view = wide[:, _WIDTH:2 * _WIDTH]  # a strided view (rows of a wider buffer)
            out = np.empty_like(x)
            call(lambda: fastattn.rms_norm(x, 1e-5))
            call(lambda: fastattn.rms_norm_mul(x, w, 1e-5))
            call(lambda: fastattn.rms_norm_mul(x, w, 1e-5, out=out))
            call(lambda: fastattn.rms_norm_mul(view, w, 1e-5, out=view))
            call(lambda: fastattn.rms_norm_mul(x[None], w, 1e-5))
            call(lambda: fastattn.add_rms_norm_mul(x, residual, w, 1e-5))
            call(lambda: fastattn.add_rms_norm_mul(view, residual, w, 1e-5, out=out, sum_out=view))


def _cache(shape, dtype):
    """A zeroed KV cache of ``shape`` (logical: values) in ``dtype``: an ndarray, or a ``Quantized`` of that type."""
    import fastattn

    if isinstance(dtype, str):
        return fastattn.quantize(np.zeros(shape, np.float32), dtype)
    return np.zeros(shape, dtype)


def _activations(dtype) -> tuple[np.dtype, ...]:
    """The source dtypes written into a cache of ``dtype``: float32, and the cache's own float dtype (a quantized
    cache: float16 as well)."""
    return tuple(dict.fromkeys((np.dtype(np.float32), np.dtype(np.float16) if isinstance(dtype, str) else dtype)))


def set_rows(dtype: np.dtype | str, call: _Calls) -> None:
    import fastattn

    rng = np.random.default_rng(0)
    cache = _cache((2 * _LARGE_ROWS, _WIDTH), dtype)
    for src_dtype in _activations(dtype):
        if isinstance(dtype, str):
            for rows in (1, _LARGE_ROWS):
                x = _data(rng, (rows, _WIDTH), src_dtype)
                call(lambda: fastattn.dequantize(fastattn.quantize(x, dtype)))
        for rows in (1, _LARGE_ROWS):
            src = _data(rng, (rows, _WIDTH), src_dtype)
            wide = _data(rng, (rows, 3 * _WIDTH), src_dtype)
            for idx_dtype in (np.int32, np.int64):
                idx = np.arange(rows, dtype=idx_dtype) + 3
                call(lambda: fastattn.set_rows(cache, src, idx))
                call(lambda: fastattn.set_rows(cache, wide[:, _WIDTH:2 * _WIDTH], idx))


def rope(dtype: np.dtype | str, call: _Calls) -> None:
    """rope_ext / apply_rope_cache of x in ``dtype`` (float dtypes), and K rotated into a cache of ``dtype``: at
    512 tokens with 2 KV heads (below the parallel size: the serial table path) and 8 (the fused parallel path)."""
    import fastattn

    rng = np.random.default_rng(0)
    h, d = _HEADS, _HEAD_DIM
    if not isinstance(dtype, str):
        _rope_activations(dtype, call, rng)
    neox = dict(n_dims=d, mode=fastattn.ROPE_NEOX, freq_base=500000.0)
    normal = dict(n_dims=d, mode=fastattn.ROPE_NORMAL, freq_base=10000.0)
    for n, h_kv in ((1, _HEADS_KV), (_LARGE_ROWS, _HEADS_KV), (_LARGE_ROWS, 4 * _HEADS_KV)):
        pos = np.arange(n, dtype=np.int32) + 7
        kv = _cache((2 * _LARGE_ROWS, h_kv, d), dtype)
        flat = _cache((2 * _LARGE_ROWS, h_kv * d), dtype)
        for x_dtype in _activations(dtype):
            qkv_k = _data(rng, (n, (h + 2 * h_kv) * d), x_dtype)
            k = qkv_k[:, h * d:(h + h_kv) * d].reshape(n, h_kv, d)
            k_contiguous = np.ascontiguousarray(k)
            for idx_dtype in (np.int32, np.int64):
                idx = np.arange(n, dtype=idx_dtype) + 5
                for kwargs in (neox, normal):
                    cache = fastattn.rope_cache(pos, **kwargs)
                    call(lambda: fastattn.rope_set_rows(kv, k, pos, idx, **kwargs))
                    call(lambda: fastattn.rope_set_rows(kv, k_contiguous, pos, idx, **kwargs))
                    call(lambda: fastattn.rope_set_rows(flat, k_contiguous, pos, idx, **kwargs))
                    call(lambda: fastattn.apply_rope_cache_set_rows(flat, k_contiguous, cache, idx))
                    call(lambda: fastattn.apply_rope_cache_set_rows(kv, k, cache, idx))


def _rope_activations(dtype: np.dtype, call: _Calls, rng: np.random.Generator) -> None:
    import fastattn

    h, d = _HEADS, _HEAD_DIM
    neox = dict(n_dims=d, mode=fastattn.ROPE_NEOX, freq_base=500000.0)
    normal = dict(n_dims=d, mode=fastattn.ROPE_NORMAL, freq_base=10000.0)
    mrope = dict(n_dims=d, mode=fastattn.ROPE_MROPE, freq_base=1e6, sections=[16, 24, 24, 0])
    for n in (1, _LARGE_ROWS):
        pos = np.arange(n, dtype=np.int32) + 7
        # x in this unit's dtype: rope_ext and apply_rope_cache, out of place, in place, on a fused QKV view
        x = _data(rng, (n, h, d), dtype)
        qkv = _data(rng, (n, (h + 2 * _HEADS_KV) * d), dtype)
        q = qkv[:, :h * d].reshape(n, h, d)
        out = np.empty_like(x)
        for kwargs in (neox, normal):
            call(lambda: fastattn.rope_ext(x, pos, **kwargs))
            call(lambda: fastattn.rope_ext(x, pos, **kwargs, out=out))
            call(lambda: fastattn.rope_ext(q, pos, **kwargs, out=q))
            cache = fastattn.rope_cache(pos, **kwargs)
            call(lambda: fastattn.apply_rope_cache(x, cache))
            call(lambda: fastattn.apply_rope_cache(q, cache, out=q))
        pos4 = np.stack([pos, pos // 4, pos % 4, np.zeros_like(pos)])
        call(lambda: fastattn.rope_ext(x, pos4, **mrope))
        call(lambda: fastattn.apply_rope_cache(q, fastattn.rope_cache(pos4, **mrope), out=q))


def _causal(n_q: int, n_kv: int, dtype) -> np.ndarray:
    return np.where(np.arange(n_kv)[None, :] > np.arange(n_q)[:, None] + (n_kv - n_q), -np.inf, 0.0).astype(dtype)


def _kv(rng: np.random.Generator, shape, dtype):
    """K or V values of ``shape`` stored in ``dtype``: an ndarray, or a ``Quantized`` of that type."""
    import fastattn

    values = _data(rng, shape, np.float32 if isinstance(dtype, str) else dtype)
    return fastattn.quantize(values, dtype) if isinstance(dtype, str) else values


def _token_major(cache):
    """K and V as (1, Hkv, Nkv, D) views of a token-major cache (2, Nkv, Hkv, D) (an ndarray or a Quantized)."""
    import fastattn

    if isinstance(cache, fastattn.Quantized):
        return tuple(fastattn.Quantized(c.transpose(1, 0, 2)[None], cache.qtype) for c in cache.data)
    return tuple(c.transpose(1, 0, 2)[None] for c in cache)


def _attention(dtype: np.dtype | str, call: _Calls, shapes: list[tuple[int, int, int]],
               paths: tuple[str, ...]) -> None:
    """flash_attn_ext on (Nq, Nkv, Hkv) shapes: K/V stored in ``dtype``, no mask / float16 / float32 causal masks,
    contiguous and as transposed views of a token-major cache, each of ``paths``."""
    import fastattn

    rng = np.random.default_rng(0)
    d = _HEAD_DIM
    for n_q, n_kv, h_kv in shapes:
        h = 4 * h_kv
        q = _data(rng, (1, h, n_q, d), np.float32)
        q_view = _data(rng, (n_q, h, d), np.float32).transpose(1, 0, 2)[None]  # (1, H, Nq, D) of token-major Q
        k, v = _kv(rng, (1, h_kv, n_kv, d), dtype), _kv(rng, (1, h_kv, n_kv, d), dtype)
        k_view, v_view = _token_major(_kv(rng, (2, n_kv, h_kv, d), dtype))  # (1, Hkv, Nkv, D) views of a cache
        out = np.empty((1, n_q, h, d), np.float32)
        masks = [None] + [_causal(n_q, n_kv, m) for m in (np.float16, np.float32)]
        for path in paths:
            if path == "split_kv" and n_q != 1:
                continue
            for mask in masks:
                call(lambda: fastattn.flash_attn_ext(q, k, v, mask, scale=d ** -0.5, path=path))
                call(lambda: fastattn.flash_attn_ext(q, k, v, mask, scale=d ** -0.5, path=path, out=out))
                call(lambda: fastattn.flash_attn_ext(q_view, k_view, v_view, mask, scale=d ** -0.5, path=path))


def attention_prefill(dtype: np.dtype, call: _Calls) -> None:
    """Prefill: 4 query rows (one_chunk), 256 (tiled, >= 1 MiB of Q)."""
    _attention(dtype, call, [(4, 64, _HEADS_KV), (256, 256, _HEADS_KV)], ("auto", "one_chunk", "tiled"))


def attention_decode(dtype: np.dtype, call: _Calls) -> None:
    """Decode: Nkv 64 (serial), Nkv 2048 with 2 and 8 KV heads, on every path (``auto`` picks by thread count)."""
    _attention(dtype, call, [(1, 64, _HEADS_KV), (1, 2048, _HEADS_KV), (1, 2048, 4 * _HEADS_KV)],
               ("auto", "one_chunk", "split_kv"))


#: Warm-up functions by unit group; the ``--ops`` names of the main job map onto them (``GROUPS``).
CALLS: dict[str, Callable[[np.dtype, _Calls], None]] = {
    "norm": norm, "set_rows": set_rows, "rope": rope,
    "attention prefill": attention_prefill, "attention decode": attention_decode,
}
#: The main job's op groups -> warm-up unit groups (in the order the units are handed out: slowest first).
#: ``quant`` (quantize, dequantize) is warmed by the set_rows units of the quantized types, which call both.
GROUPS = {"attention": ("attention prefill", "attention decode"), "rope": ("rope",), "norm": ("norm",),
          "set_rows": ("set_rows",), "quant": ("set_rows",)}


def warm(group: str, dtype_name: str, thread_counts: list[int]) -> tuple[int, int]:
    """Run unit ``group`` for ``dtype_name`` at each thread count; returns (calls made, combinations skipped)."""
    import fastattn

    dtype = dtype_of(dtype_name)
    call = _Calls()
    for n in thread_counts:
        with fastattn.num_threads(n):
            CALLS[group](dtype, call)
    return call.made, call.skipped

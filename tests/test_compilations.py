"""Kernels that several paths call are typed alike by each of them, so they compile once.

A second specialisation of a kernel that differs only in an array's layout or writeability, or in a literal
argument, compiles the same machine code again: seconds of a user's first call and of a cold test run. Each test
makes the calls of two paths that share a kernel and checks that the kernel holds one specialisation per element
type (whatever other tests of the process compiled before).
"""
from __future__ import annotations

import numpy as np
from numba import types

import fastattn
from fastattn.attention import layout as _attention_layout
from fastattn.attention import softmax as _attention_softmax
from fastattn.rope import cache as _rope_cache
from fastattn.rows import api as rows


def _element_types(t):
    """A Numba type with layouts, writeability and literal values left out."""
    t = types.unliteral(t)
    if isinstance(t, types.Array):
        return ("array", str(t.dtype), t.ndim)
    if isinstance(t, types.BaseTuple):
        return tuple(_element_types(x) for x in t.types)
    return str(t)


def _signatures(dispatcher) -> set:
    """Every signature ``dispatcher`` was compiled for with the current sources: in this process, and in any
    process, as listed by its on-disk cache index (a kernel called by a kernel loaded from the cache is not
    compiled here, and Numba's index is the only record of it; the index is dropped when the source changes)."""
    found = set(dispatcher.signatures)
    try:
        index = dispatcher._cache._cache_file._load_index()  # Numba's cache: {(signature, target, flags): file}
    except AttributeError:  # a Numba without this cache layout: this process's compilations only
        index = {}
    found.update(key[0] for key in index)
    return found


def _assert_compiled_once_per_element_types(dispatcher) -> None:
    signatures = _signatures(dispatcher)
    assert signatures, f"{dispatcher.__name__} was not compiled"
    seen: dict = {}
    for signature in signatures:
        seen.setdefault(tuple(_element_types(t) for t in signature), []).append(signature)
    for variants in seen.values():
        assert len(variants) == 1, f"{dispatcher.__name__} compiled {len(variants)} times: {variants}"


def test_rope_table_builder_and_fused_driver_share_cache_block():
    # a prebuilt table (build_cs, from ndarrays) and a prefill rope_ext on threads (the fused driver, from the
    # parameters' plan) both compute cos/sin blocks
    n_tokens = 8 * _rope_cache.CACHE_BLOCK
    pos = np.arange(n_tokens, dtype=np.int32)
    params = dict(n_dims=128, mode=2, freq_base=500000.0)
    table = fastattn.rope_cache(pos, **params)
    x = np.random.default_rng(0).standard_normal((n_tokens, 8, 128)).astype(np.float32)
    with fastattn.num_threads(2):
        fused = fastattn.rope_ext(x, pos, **params)
    np.testing.assert_array_equal(fused, fastattn.apply_rope_cache(x, table))
    _assert_compiled_once_per_element_types(_rope_cache.cache_block)


def test_one_chunk_and_split_kv_share_their_row_helpers():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 96, 64)).astype(np.float16)
    v = rng.standard_normal((1, 2, 96, 64)).astype(np.float16)
    results = [fastattn.flash_attn_ext(q, k, v, scale=0.125, path=path) for path in ("one_chunk", "split_kv")]
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)
    _assert_compiled_once_per_element_types(_attention_softmax.finalize)
    _assert_compiled_once_per_element_types(_attention_layout.live_range)


def test_quantized_set_rows_compiles_once_for_contiguous_and_strided_caches():
    rng = np.random.default_rng(2)
    src = rng.standard_normal((2, 3, 64)).astype(np.float32)
    idx = np.array([5, 0, 2], np.int64)
    contiguous = fastattn.quantize(np.zeros((2, 8, 64), np.float32), "q8_0")
    strided = fastattn.Quantized(np.zeros((2, 16, 68), np.uint8)[:, ::2], "q8_0")
    with fastattn.num_threads(1):
        fastattn.set_rows(contiguous, src, idx)
        fastattn.set_rows(strided, src, idx)
    np.testing.assert_array_equal(fastattn.dequantize(contiguous), fastattn.dequantize(strided))
    _assert_compiled_once_per_element_types(rows._set_quantized_serial)

"""Every route (``fastattn/_core/dispatch.py``) against its op's general path, through the public test hooks.

For each route, drawn calls (layouts, dtypes, in place or not, thread counts):

- give the general path's bytes (``general_only``), outputs and the buffers around every view alike;
- the first such call after ``forget_routes()`` (a new process) is handed to the route by the general path
  (``taken`` grows by one) wherever the route takes that layout, and an identical second call is taken at the
  guard: the general path does not run again (``taken`` stays);
- bad calls, once the route holds an entry point, raise the general path's error (type and message) and write
  nothing.

``ROUTE_CASES`` must cover every registered route: a new route without cases fails
``test_every_route_is_tested``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import ROPE_MODES, StridedView, dims, positions, rope_configs, seeds, strided

import fastattn
from fastattn._core import threads as _threads
from fastattn import reference as ref
from fastattn.testing import forget_routes, general_only, parallel_min_bytes, routes
from fastattn.rope.cache import CACHE_BLOCK
from fastattn._core.validate import FLOAT16, FLOAT32
from strategies import BFLOAT16, STORAGE_FLOATS

INT32, INT64 = np.dtype(np.int32), np.dtype(np.int64)
NEOX = fastattn.ROPE_NEOX
#: Bytes per 32-value block of each quantized type.
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


@dataclass
class Case:
    """A drawn call: ``call()`` runs it on ``views`` (restored to their drawn values first) and returns the
    arrays to compare; ``taken``: whether the route takes this call (its layout and sizes)."""

    call: Callable[[], object]
    views: list[StridedView]
    taken: bool
    threads: int = 1
    parallel_from: int | None = None  # PARALLEL_MIN_BYTES for the call (None: the default)

    def run(self) -> tuple[list[bytes], list[bytes]]:
        for view in self.views:
            view.parent[...] = view.snapshot
        with fastattn.num_threads(min(self.threads, _threads.max_threads())), parallel_min_bytes(
                _threads.PARALLEL_MIN_BYTES if self.parallel_from is None else self.parallel_from):
            result = self.call()
        results = result if isinstance(result, tuple) else (result,)
        return [np.ascontiguousarray(r).tobytes() for r in results], [v.parent.tobytes() for v in self.views]


def unit_rows(*arrays: np.ndarray) -> bool:
    return all(a.strides[-1] == a.itemsize for a in arrays)


def _out(data, shape, dtype, x: StridedView, where: str):
    """(out argument, its view or None) for ``where`` in new / view / in place."""
    if where == "in place":
        return x.array, None
    if where == "view":
        view = data.draw(strided(shape, dtype))
        return view.array, view
    return None, None


# ---------------------------------------------------------------------------------------------------------------
# Cases per route.
@st.composite
def norm_rows(draw):
    op = draw(st.sampled_from(("rms_norm", "rms_norm_mul")))
    dtype = draw(st.sampled_from(STORAGE_FLOATS))
    shape = (draw(st.integers(1, 3)), draw(dims(1, 300)))
    x = draw(strided(shape, dtype))
    w = draw(strided(shape[-1:], draw(st.sampled_from(STORAGE_FLOATS)))) if op == "rms_norm_mul" else None
    where = draw(st.sampled_from(("new", "view", "in place")))
    out, out_view = _out(_Drawer(draw), shape, dtype, x, where)
    eps = draw(st.sampled_from((1e-5, 0.0, 1e-6)))
    views = [x] + [v for v in (w, out_view) if v is not None]

    def call():
        if w is None:
            return fastattn.rms_norm(x.array, eps, out=out)
        return fastattn.rms_norm_mul(x.array, w.array, eps, out=out)
    arrays = [x.array] + ([w.array] if w is not None else []) + ([out] if out is not None else [])
    return Case(call, views, unit_rows(*arrays))


@st.composite
def set_rows_rows(draw):
    dst_dtype, src_dtype = draw(st.sampled_from(STORAGE_FLOATS)), draw(st.sampled_from(STORAGE_FLOATS))
    n_rows, n, d = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(dims(1, 200))
    dst = draw(strided((n_rows, d), dst_dtype))
    src = draw(strided((n, d), src_dtype))
    idx = np.array(draw(st.lists(st.integers(0, n_rows - 1), min_size=n, max_size=n)),
                   draw(st.sampled_from((INT32, INT64))))  # duplicates: the last row wins
    return Case(lambda: fastattn.set_rows(dst.array, src.array, idx), [dst, src], unit_rows(dst.array, src.array))


@st.composite
def quantized_bytes(draw, shape):
    """A ``StridedView`` of random bytes of ``shape`` as a ``Quantized`` holds them: the last axis contiguous, the
    others padded and stepped inside a larger parent."""
    lo = [draw(st.sampled_from((0, 1, 3))) for _ in shape]
    hi = [draw(st.sampled_from((0, 2))) for _ in shape[:-1]] + [draw(st.sampled_from((1, 5)))]
    step = [draw(st.sampled_from((1, 2))) for _ in shape[:-1]] + [1]
    parent = np.random.default_rng(draw(seeds)).integers(0, 256, [s * k + a + b for s, k, a, b in zip(
        shape, step, lo, hi)], dtype=np.uint8)
    index = tuple(slice(a, a + s * k, k) for s, k, a in zip(shape, step, lo))
    inside = np.zeros(parent.shape, bool)
    inside[index] = True
    return StridedView(parent[index], parent, inside, parent.copy())


@st.composite
def set_rows_quantized(draw):
    qtype = draw(st.sampled_from(tuple(BLOCK_BYTES)))
    n_rows, n, d = draw(st.integers(1, 6)), draw(st.integers(1, 4)), 32 * draw(st.integers(1, 4))
    data = draw(quantized_bytes((n_rows, d // 32 * BLOCK_BYTES[qtype])))
    src = draw(strided((n, d), draw(st.sampled_from(STORAGE_FLOATS))))
    idx = np.array(draw(st.lists(st.integers(0, n_rows - 1), min_size=n, max_size=n)),
                   draw(st.sampled_from((INT32, INT64))))  # duplicates: the last row wins
    return Case(lambda: fastattn.set_rows(fastattn.Quantized(data.array, qtype), src.array, idx).data, [data, src],
                unit_rows(src.array))


@st.composite
def rope_cached_quantized(draw):
    """``apply_rope_cache_set_rows`` into a quantized cache (R, H·D) or (R, H, D): D a whole number of blocks."""
    kwargs, d, streams = draw(rope_configs(mode=draw(st.sampled_from(ROPE_MODES[:-1]))))  # VISION: D = 2 n_dims
    d = 32 * -(-d // 32)
    n, h = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    cache = fastattn.rope_cache(positions(streams, n, rng, "large"), **kwargs)
    qtype = draw(st.sampled_from(tuple(BLOCK_BYTES)))
    x = draw(strided((n, h, d), draw(st.sampled_from((FLOAT32, FLOAT16)))))
    n_rows, row_bytes = draw(st.integers(n, 6)), d // 32 * BLOCK_BYTES[qtype]
    data = draw(quantized_bytes((n_rows, h * row_bytes) if draw(st.booleans()) else (n_rows, h, row_bytes)))
    idx = rng.integers(0, n_rows, n).astype(draw(st.sampled_from((INT32, INT64))))
    return Case(lambda: fastattn.apply_rope_cache_set_rows(fastattn.Quantized(data.array, qtype), x.array, cache,
                                                           idx).data, [x, data], unit_rows(x.array))


@st.composite
def rope_cached(draw):
    kwargs, d, streams = draw(rope_configs())
    n, h = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    cache = fastattn.rope_cache(positions(streams, n, rng, "large"), **kwargs)
    if draw(st.booleans()):  # apply_rope_cache
        dtype = draw(st.sampled_from((FLOAT32, FLOAT16)))
        x = draw(strided((n, h, d), dtype))
        out, out_view = _out(_Drawer(draw), (n, h, d), dtype, x, draw(st.sampled_from(("new", "view", "in place"))))
        views = [x] + ([out_view] if out_view is not None else [])
        arrays = [x.array] + ([out] if out is not None else [])
        return Case(lambda: fastattn.apply_rope_cache(x.array, cache, out=out), views, unit_rows(*arrays))
    x = draw(strided((n, h, d), draw(st.sampled_from((FLOAT32, FLOAT16)))))  # apply_rope_cache_set_rows
    n_rows = draw(st.integers(n, 6))
    dst_shape = (n_rows, h * d) if draw(st.booleans()) else (n_rows, h, d)
    dst = draw(strided(dst_shape, draw(st.sampled_from(STORAGE_FLOATS)), contiguous_ok=True))
    idx = rng.integers(0, n_rows, n).astype(draw(st.sampled_from((INT32, INT64))))
    return Case(lambda: fastattn.apply_rope_cache_set_rows(dst.array, x.array, cache, idx), [x, dst],
                unit_rows(x.array, dst.array))


@st.composite
def rope_cached_prefill(draw):
    kwargs, d, streams = draw(rope_configs())
    n, h = draw(st.integers(2, 40)), draw(st.integers(1, 4))
    cache = fastattn.rope_cache(positions(streams, n, np.random.default_rng(draw(st.integers(0, 2**16))), "large"),
                                **kwargs)
    dtype = draw(st.sampled_from((FLOAT32, FLOAT16)))
    x = draw(strided((n, h, d), dtype))
    out, out_view = _out(_Drawer(draw), (n, h, d), dtype, x, draw(st.sampled_from(("new", "view", "in place"))))
    views = [x] + ([out_view] if out_view is not None else [])
    return Case(lambda: fastattn.apply_rope_cache(x.array, cache, out=out), views, True,
                draw(st.sampled_from((1, 2))), 0)


@st.composite
def rope_fused(draw):
    mode = draw(st.sampled_from((fastattn.ROPE_NORMAL, NEOX)))
    kwargs, d, _ = draw(rope_configs(mode=mode))
    # decode steps (on the calling thread) and prefills (on threads from PARALLEL_MIN_BYTES)
    n = draw(st.one_of(st.integers(1, 3), st.integers(2 * CACHE_BLOCK, 2 * CACHE_BLOCK + 70)))
    h = draw(st.integers(1, 3))
    pos = positions(1, n, np.random.default_rng(draw(st.integers(0, 2**16))), draw(
        st.sampled_from(("small", "large", "runs"))))
    threads = draw(st.sampled_from((1, 2)))
    x = draw(strided((n, h, d), draw(st.sampled_from((FLOAT32, FLOAT16)))))
    if draw(st.booleans()):  # rope_ext
        dtype = x.array.dtype
        out, out_view = _out(_Drawer(draw), (n, h, d), dtype, x, draw(st.sampled_from(("new", "view", "in place"))))
        views = [x] + ([out_view] if out_view is not None else [])
        return Case(lambda: fastattn.rope_ext(x.array, pos, out=out, **kwargs), views, True, threads, 0)
    dst_shape = (n + 7, h * d) if draw(st.booleans()) else (n + 7, h, d)  # rope_set_rows into a C-contiguous cache
    dst = draw(strided(dst_shape, draw(st.sampled_from(STORAGE_FLOATS)), contiguous_ok=True))
    gaps = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    idx = np.cumsum(gaps).astype(draw(st.sampled_from((INT32, INT64))))
    idx += np.int64(7 - idx[-1]) if idx[-1] < 7 else 0
    takes = dst.array.flags.c_contiguous and bool(np.all(np.diff(idx) > 0))
    return Case(lambda: fastattn.rope_set_rows(dst.array, x.array, pos, idx, **kwargs), [x, dst], takes, threads,
                0)


@st.composite
def attention_decode(draw):
    k_dtype, v_dtype = draw(st.sampled_from([(FLOAT16, FLOAT16), (FLOAT32, FLOAT32), (FLOAT16, FLOAT32)] + (
        [(BFLOAT16, BFLOAT16)] if BFLOAT16 is not None else [])))
    B, Hkv, ratio = draw(st.sampled_from((1, 2))), draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 2, 4)))
    Nkv = draw(st.one_of(st.sampled_from((1, 600)), dims(1, 80)))
    DK, DV = draw(st.sampled_from(((64, 64), (40, 72), (128, 128))))
    Hq = Hkv * ratio
    q = draw(strided((B, Hq, 1, DK), FLOAT32))
    k = draw(strided((B, Hkv, Nkv, DK), k_dtype))
    v = draw(strided((B, Hkv, Nkv, DV), v_dtype))
    out = draw(strided((B, 1, Hq, DV), FLOAT32)) if draw(st.booleans()) else None
    threads = draw(st.sampled_from((1, 2)))
    views = [q, k, v] + ([out] if out is not None else [])

    def call():
        return fastattn.flash_attn_ext(q.array, k.array, v.array, scale=1.0 / np.sqrt(DK), path="one_chunk",
                                       out=None if out is None else out.array)
    return Case(call, views, True, threads, 0 if threads > 1 else None)


class _Drawer:
    """``data.draw`` for helpers shared with composite strategies (which only have ``draw``)."""

    def __init__(self, draw):
        self.draw = draw


# Bad calls, made after valid calls have given the route its entry points: (the calls, the arrays they must leave
# untouched).
def _norm_bad():
    x = np.ones((2, 16), np.float32)
    w = np.ones(16, np.float32)
    fastattn.rms_norm_mul(x, w, 1e-5)
    fastattn.rms_norm(x, 1e-5)
    buf = np.ones((2, 24), np.float32)
    return [lambda: fastattn.rms_norm_mul(buf[:, :16], w, 1e-5, out=buf[:, 8:]),
            lambda: fastattn.rms_norm_mul(x, np.ones(15, np.float32), 1e-5),
            lambda: fastattn.rms_norm_mul(x, w, -1.0, out=buf[:, :16]),
            lambda: fastattn.rms_norm(x, float("nan"), out=buf[:, :16]),
            lambda: fastattn.rms_norm(x, 1e-5, out=np.ones((2, 15), np.float32)),
            lambda: fastattn.rms_norm_mul(x, x[0], 1e-5, out=x)], [x, w, buf]


def _set_rows_bad():
    dst = np.zeros((4, 8), np.float16)
    src = np.ones((2, 8), np.float32)
    fastattn.set_rows(dst, src, np.array([0, 1]))
    return [lambda: fastattn.set_rows(dst, src, np.array([0, 4])),
            lambda: fastattn.set_rows(dst, src, np.array([-1, 0])),
            lambda: fastattn.set_rows(dst, src[:, :7], np.array([0, 1])),
            lambda: fastattn.set_rows(dst, dst[:2].astype(np.float32), np.array([0])),
            lambda: fastattn.set_rows(dst, dst[:2], np.array([2, 3])),
            lambda: fastattn.set_rows(dst, src, np.array([0.0, 1.0])),
            lambda: fastattn.set_rows(dst, src, np.array([0, 1], np.uint64))], [dst, src]


def _rope_cached_bad():
    x = np.ones((1, 2, 16), np.float32)
    kv = np.zeros((4, 32), np.float32)
    cache = fastattn.rope_cache(np.zeros(1, np.int32), n_dims=16, mode=NEOX)
    fastattn.apply_rope_cache(x, cache)
    fastattn.apply_rope_cache_set_rows(kv, x, cache, np.array([0]))
    vision = fastattn.rope_cache(np.zeros((4, 1), np.int32), n_dims=4, mode=fastattn.ROPE_VISION,
                                 sections=[1, 1, 0, 0])
    two = fastattn.rope_cache(np.zeros(2, np.int32), n_dims=16, mode=NEOX)
    wide = fastattn.rope_cache(np.zeros(1, np.int32), n_dims=32, mode=NEOX)
    buf = np.ones((1, 2, 24), np.float32)
    return [lambda: fastattn.apply_rope_cache(x, vision, out=x),
            lambda: fastattn.apply_rope_cache(x, two),
            lambda: fastattn.apply_rope_cache(x, wide),
            lambda: fastattn.apply_rope_cache(buf[..., :16], cache, out=buf[..., 8:]),
            lambda: fastattn.apply_rope_cache(x, cache, out=np.ones((1, 2, 8), np.float32)),
            lambda: fastattn.apply_rope_cache_set_rows(kv, kv[:1].reshape(1, 2, 16), cache, np.array([2])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, x, cache, np.array([4])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, x, cache, np.array([0, 1])),
            lambda: fastattn.apply_rope_cache_set_rows(kv[:, :16], x, cache, np.array([0])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, x, cache, np.array([0.0])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, x, cache, np.array([0], np.uint64))], [x, kv, buf]


def _set_rows_quantized_bad():
    data = np.zeros((8, 2 * 34), np.uint8)
    dst = fastattn.Quantized(data, "q8_0")
    src = np.ones((2, 64), np.float32)
    fastattn.set_rows(dst, src, np.array([0, 1]))
    fastattn.set_rows(dst, src.astype(np.float16), np.array([0, 1]))
    read_only = fastattn.Quantized(data.copy(), "q8_0")
    read_only.data.flags.writeable = False
    inside = data.reshape(-1).view(np.float32)[:128].reshape(2, 64)  # src rows in the cache's own bytes
    return [lambda: fastattn.set_rows(dst, src, np.array([0, 8])),
            lambda: fastattn.set_rows(dst, src, np.array([-1, 0])),
            lambda: fastattn.set_rows(dst, src[:, :32], np.array([0, 1])),
            lambda: fastattn.set_rows(dst, src.astype(np.float64), np.array([0, 1])),
            lambda: fastattn.set_rows(dst, src, np.array([0.0, 1.0])),
            lambda: fastattn.set_rows(read_only, src, np.array([0, 1])),
            lambda: fastattn.set_rows(fastattn.Quantized(data, "q4_0"), src, np.array([0, 1])),
            lambda: fastattn.set_rows(dst, inside, np.array([6, 7]))], [data, src]


def _rope_cached_quantized_bad():
    x = np.ones((1, 2, 32), np.float32)
    data = np.zeros((8, 2 * 34), np.uint8)
    kv = fastattn.Quantized(data, "q8_0")
    cache = fastattn.rope_cache(np.zeros(1, np.int32), n_dims=16, mode=NEOX)
    fastattn.apply_rope_cache_set_rows(kv, x, cache, np.array([0]))
    fastattn.apply_rope_cache_set_rows(fastattn.Quantized(data.reshape(8, 2, 34), "q8_0"), x, cache, np.array([1]))
    two = fastattn.rope_cache(np.zeros(2, np.int32), n_dims=16, mode=NEOX)
    wide = fastattn.rope_cache(np.zeros(1, np.int32), n_dims=64, mode=NEOX)
    inside = data.reshape(-1).view(np.float32)[:64].reshape(1, 2, 32)  # x in the cache's own bytes
    return [lambda: fastattn.apply_rope_cache_set_rows(kv, x, cache, np.array([8])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, x, cache, np.array([0, 1])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, x, two, np.array([0])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, x, wide, np.array([0])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, x[..., :16], cache, np.array([0])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, x.astype(np.float64), cache, np.array([0])),
            lambda: fastattn.apply_rope_cache_set_rows(fastattn.Quantized(data[:, :34], "q8_0"), x, cache,
                                                       np.array([0])),
            lambda: fastattn.apply_rope_cache_set_rows(kv, inside, cache, np.array([7]))], [x, data]


def _rope_cached_prefill_bad():
    x = np.ones((4, 2, 16), np.float32)
    cache = fastattn.rope_cache(np.arange(4, dtype=np.int32), n_dims=16, mode=NEOX)
    fastattn.apply_rope_cache(x, cache)
    wide = fastattn.rope_cache(np.arange(4, dtype=np.int32), n_dims=32, mode=NEOX)
    buf = np.ones((4, 2, 24), np.float32)
    return [lambda: fastattn.apply_rope_cache(x[:3], cache),
            lambda: fastattn.apply_rope_cache(x, wide),
            lambda: fastattn.apply_rope_cache(buf[..., :16], cache, out=buf[..., 8:]),
            lambda: fastattn.apply_rope_cache(x, cache, out=np.ones((4, 2, 8), np.float32)),
            lambda: fastattn.apply_rope_cache(x.astype(np.float64), cache)], [x, buf]


def _rope_fused_bad():
    n = 2 * CACHE_BLOCK
    kwargs = dict(n_dims=16, mode=NEOX, freq_base=500000.0)
    pos = np.arange(n, dtype=np.int32)
    buf = np.ones((n, 2, 32), np.float32)
    kv = np.zeros((n + 2, 64), np.float16)
    idx = np.arange(n, dtype=np.int64)
    with parallel_min_bytes(0):
        fastattn.rope_ext(buf.copy(), pos, **kwargs)
        fastattn.rope_set_rows(kv, buf, pos, idx, **kwargs)
    read_only = buf.copy()
    read_only.flags.writeable = False
    # int32 indices inside the cache's own memory: the route takes int64 copies of int32 indices, so this overlap
    # must still be found (the general path's error)
    idx_in_kv = kv.reshape(-1).view(np.int32)[-n:]
    idx_in_kv[:] = np.arange(n)
    return [lambda: fastattn.rope_ext(buf, pos, out=np.ones((n, 2, 16), np.float32), **kwargs),
            lambda: fastattn.rope_ext(buf[..., :16], pos, out=buf[..., 8:24], **kwargs),
            lambda: fastattn.rope_ext(buf[..., :8], pos, **kwargs),
            lambda: fastattn.rope_ext(buf, pos[:-1], out=buf, **kwargs),
            lambda: fastattn.rope_ext(read_only, pos, out=read_only, **kwargs),
            lambda: fastattn.rope_ext(buf, pos, out=buf, **{**kwargs, "n_dims": 16.0}),
            lambda: fastattn.rope_ext(buf, pos, out=buf, **{**kwargs, "freq_factors": np.zeros(8, np.float32)}),
            lambda: fastattn.rope_ext(buf, pos, out=buf, **{**kwargs, "freq_factors": np.ones(7)}),
            lambda: fastattn.rope_set_rows(kv, buf, pos, idx + 3, **kwargs),
            lambda: fastattn.rope_set_rows(kv, buf, pos, idx[:-1], **kwargs),
            lambda: fastattn.rope_set_rows(kv, kv[:n, :64].reshape(n, 2, 32), pos, idx, **kwargs),
            lambda: fastattn.rope_set_rows(kv, buf, pos, idx, **{**kwargs, "backward": 1}),
            lambda: fastattn.rope_set_rows(kv, buf, pos, idx_in_kv, **kwargs),
            # index dtypes other than int32/int64 are refused, not converted (a float index was written before)
            lambda: fastattn.rope_set_rows(kv, buf, pos, idx.astype(np.float64), **kwargs),
            lambda: fastattn.rope_set_rows(kv, buf, pos, idx.astype(np.uint64), **kwargs),
            lambda: fastattn.rope_set_rows(kv, buf, pos, idx.astype(np.int16), **kwargs),
            lambda: fastattn.rope_set_rows(kv, buf, pos, idx.astype(bool), **kwargs),
            lambda: fastattn.rope_set_rows(kv, buf, pos.astype(np.float32), idx, **kwargs),
            # parameters valid on their own (remembered by the general path's parse) for a head they exceed: the
            # route must not build their table (2**39 pairs) before the head-dim check
            lambda: fastattn.rope_ext(buf, pos, out=buf, **{**kwargs, "n_dims": 2**40}),
            lambda: fastattn.rope_set_rows(kv, buf, pos, idx, **{**kwargs, "n_dims": 2**40})], [buf, kv]


def _attention_decode_bad():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float16)
    v = rng.standard_normal((1, 2, 5, 8)).astype(np.float16)
    fastattn.flash_attn_ext(q, k, v, scale=1.0)
    out = np.full((1, 1, 4, 8), 7.0, np.float32)
    shared = np.zeros((1, 4, 1, 16), np.float32)
    return [lambda: fastattn.flash_attn_ext(q, k[..., :4], v, scale=1.0, out=out),
            lambda: fastattn.flash_attn_ext(q[:, :3], k, v, scale=1.0, out=out),
            lambda: fastattn.flash_attn_ext(q, k, v[:, :, :4], scale=1.0, out=out),
            lambda: fastattn.flash_attn_ext(q, k, v, scale=1.0, out=np.zeros((1, 1, 4, 9), np.float32)),
            lambda: fastattn.flash_attn_ext(q, k, v, scale=float("nan"), out=out),
            lambda: fastattn.flash_attn_ext(q, k, v, scale=1e39, out=out),
            lambda: fastattn.flash_attn_ext(q.astype(np.float16), k, v, scale=1.0, out=out),
            lambda: fastattn.flash_attn_ext(shared[..., :8], k, v, scale=1.0,
                                            out=shared[..., 8:].transpose(0, 2, 1, 3))], [q, k, v, out, shared]


ROUTE_CASES = {
    "norm.rows": (norm_rows(), _norm_bad),
    "set_rows.rows": (set_rows_rows(), _set_rows_bad),
    "set_rows.quantized": (set_rows_quantized(), _set_rows_quantized_bad),
    "rope.cached_quantized": (rope_cached_quantized(), _rope_cached_quantized_bad),
    "rope.cached": (rope_cached(), _rope_cached_bad),
    "rope.fused": (rope_fused(), _rope_fused_bad),
    "rope.cached_prefill": (rope_cached_prefill(), _rope_cached_prefill_bad),
    "attention.decode": (attention_decode(), _attention_decode_bad),
}


ROUTES = routes()


def test_every_route_is_tested():
    assert set(ROUTES) == set(ROUTE_CASES)


@pytest.mark.parametrize("name", sorted(ROUTE_CASES))
@given(data=st.data())
def test_route_gives_the_general_paths_bytes_from_its_first_call(name, data):
    case = data.draw(ROUTE_CASES[name][0])
    with general_only():
        expected = case.run()
    route = ROUTES[name]
    forget_routes()  # as in a new process: the general path hands the first call over
    before = route.taken
    assert case.run() == expected
    assert route.taken == before + case.taken
    after_first = route.taken
    assert case.run() == expected  # the guard's call
    if case.taken:
        assert route.taken == after_first, "the general path ran again for a call the route takes"


@pytest.mark.parametrize("name", sorted(ROUTE_CASES))
def test_route_declines_bad_calls_with_the_general_paths_error(name):
    """At sizes the route takes (parallel kernels from 0 bytes, for the prefill route)."""
    with parallel_min_bytes(0 if name in ("rope.fused", "rope.cached_prefill") else _threads.PARALLEL_MIN_BYTES):
        bad_calls, watched = ROUTE_CASES[name][1]()  # after its valid calls: the route holds entry points
        assert ROUTES[name].entries
        before = [a.tobytes() for a in watched]
        for i, call in enumerate(bad_calls):
            with general_only():
                expected = _error_of(call)
            got = _error_of(call)
            assert expected is not None, f"bad call {i} of {name} did not raise"
            assert got == expected, f"bad call {i} of {name}"
            assert [a.tobytes() for a in watched] == before, f"bad call {i} of {name} wrote"


def _error_of(call) -> tuple[type, str] | None:
    try:
        call()
    except (ValueError, TypeError) as error:
        return type(error), str(error)
    return None


# ---------------------------------------------------------------------------------------------------------------
# A route and the general path share their compiled kernels: the general drivers type their arrays any-layout as
# the entry points do, so a call of one after a call of the other compiles nothing new.
def _signature_counts(kernels) -> list[int]:
    return [len(k.signatures) for k in kernels]


def _share_rope_fused():
    from fastattn.rope import drivers as _rope_drivers
    n, h, d = 2 * CACHE_BLOCK, 2, 64
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, h, d)).astype(np.float32)
    pos = np.arange(n, dtype=np.int32)
    kwargs = dict(n_dims=d, mode=NEOX, freq_base=10000.0)
    dst = np.zeros((n + 4, h, d), np.float16)
    idx = np.arange(n, dtype=np.int64) + 2
    return (_rope_drivers._fused_tasks, _rope_drivers.drive_fused), [
        lambda: fastattn.rope_ext(x, pos, **kwargs), lambda: fastattn.rope_set_rows(dst, x, pos, idx, **kwargs)]


def _share_rope_cached_prefill():
    from fastattn.rope import drivers as _rope_drivers
    n, h, d = 2 * CACHE_BLOCK, 2, 64
    x = np.random.default_rng(4).standard_normal((n, h, d)).astype(np.float16)
    cache = fastattn.rope_cache(np.arange(n, dtype=np.int32), n_dims=d, mode=NEOX)
    return (_rope_drivers._cached_tasks, _rope_drivers.drive_parallel), [lambda: fastattn.apply_rope_cache(x, cache)]


def _share_norm():
    from fastattn.norm import api as norm
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float16)
    return (norm._norm_vec,), [lambda: fastattn.rms_norm_mul(x, w, 1e-5), lambda: fastattn.rms_norm(x, 1e-5)]


def _share_set_rows():
    from fastattn.rows import api as rows
    rng = np.random.default_rng(6)
    dst = np.zeros((16, 64), np.float16)
    src = rng.standard_normal((4, 64)).astype(np.float32)
    idx = np.array([3, 1, 8, 2], np.int32)
    return (rows._copy_row,), [lambda: fastattn.set_rows(dst, src, idx)]


@pytest.mark.parametrize("make", [_share_rope_fused, _share_rope_cached_prefill, _share_norm, _share_set_rows],
                         ids=["rope.fused", "rope.cached_prefill", "norm.rows", "set_rows.rows"])
def test_a_route_and_the_general_path_share_their_compiled_kernels(make):
    kernels, calls = make()
    with fastattn.num_threads(min(2, _threads.max_threads())), parallel_min_bytes(0):
        with general_only():
            for call in calls:
                call()
        compiled = _signature_counts(kernels)
        forget_routes()
        for call in calls:
            call()  # the route's entry points, compiled now, call the kernels the general path compiled
    assert _signature_counts(kernels) == compiled


def test_row_sliced_views_share_the_contiguous_rows_kernels():
    """A view whose rows lie apart but whose elements are adjacent runs the same compiled row code as a
    C-contiguous array (and vectorises)."""
    from fastattn.norm import api as norm
    from fastattn.rows import api as rows
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w = np.ones(64, np.float32)
    dst = np.zeros((32, 64), np.float32)
    idx = np.arange(8, dtype=np.int64)
    with general_only():
        fastattn.rms_norm_mul(x[:8], w, 1e-5)
        fastattn.set_rows(dst[:16], x[:8], idx)
        compiled = _signature_counts((norm._norm_serial, norm._norm_vec, rows._set_rows_serial, rows._copy_row))
        got = fastattn.rms_norm_mul(x[::2], w, 1e-5)
        fastattn.set_rows(dst[::2], x[::2], idx)
    assert _signature_counts((norm._norm_serial, norm._norm_vec, rows._set_rows_serial, rows._copy_row)) == compiled
    np.testing.assert_array_equal(got, fastattn.rms_norm_mul(np.ascontiguousarray(x[::2]), w, 1e-5))
    np.testing.assert_array_equal(dst[::2][:8], x[::2])


@pytest.mark.parametrize("n", [2, 2 * CACHE_BLOCK])
def test_fused_route_leaves_an_output_overlapping_freq_factors_to_the_general_path(n):
    """The route reads freq_factors' copy in the parameters' plan; the contract still refuses the overlap."""
    h, d = 2, 32
    kwargs = dict(n_dims=d, mode=NEOX, freq_base=500000.0)
    x = np.random.default_rng(8).standard_normal((n, h, d)).astype(np.float32)
    pos = np.arange(n, dtype=np.int32)
    idx = np.arange(n, dtype=np.int64)
    with parallel_min_bytes(0):
        fastattn.rope_ext(x, pos, freq_factors=np.ones(d // 2, np.float32), **kwargs)  # entries and known params
        fastattn.rope_set_rows(np.zeros((n, h, d), np.float32), x, pos, idx,
                               freq_factors=np.ones(d // 2, np.float32), **kwargs)
        for call in ("rope_ext", "rope_set_rows"):
            out = np.zeros((n, h, d), np.float32)
            factors = out.reshape(-1)[:d // 2]
            factors[:] = 1.0
            before = out.copy()
            with pytest.raises(ValueError, match="freq_factors"):
                if call == "rope_ext":
                    fastattn.rope_ext(x, pos, freq_factors=factors, out=out, **kwargs)
                else:
                    fastattn.rope_set_rows(out, x, pos, idx, freq_factors=factors, **kwargs)
            np.testing.assert_array_equal(out, before)


def test_fused_route_knows_parameters_by_the_objects_passed():
    """The route's parameter lookup remembers the last arguments by identity: the same values of another class
    (16.0 for 16, 0 for False) still take the general path and its error; a new parameter set is parsed anew."""
    x = np.random.default_rng(9).standard_normal((1, 2, 16)).astype(np.float32)
    pos = np.array([3], np.int32)
    for _ in range(3):  # the first call is handed over; then the route and the remembered arguments
        fastattn.rope_ext(x, pos, n_dims=16, mode=NEOX, out=np.empty_like(x))
    with pytest.raises(TypeError, match="n_dims"):
        fastattn.rope_ext(x, pos, n_dims=16.0, mode=NEOX)
    with pytest.raises(TypeError, match="backward"):
        fastattn.rope_ext(x, pos, n_dims=16, mode=NEOX, backward=0)
    for base in (10000.0, 500000.0):
        got = fastattn.rope_ext(x, pos, n_dims=16, mode=NEOX, freq_base=base)
        np.testing.assert_allclose(got, ref.rope_ext(x, pos, n_dims=16, mode=NEOX, freq_base=base), rtol=0,
                                   atol=1e-6)

"""Every op that writes, called with an output that shares memory with one of its other arguments.

Each case places the written array and one argument in one byte buffer so that they overlap (a partial overlap
for the in-place-capable pairs, any overlap for the others: index arrays, positions, tables, weights), fills the
argument with values that are valid on their own (indices in range, positions, finite floats), and asserts that
the op raises ``ValueError`` naming that argument and leaves the buffer untouched, on the fast side and the
reference alike. A valid call with the same dtypes and sizes runs first, so the fast paths that record an entry
point after a first call are exercised too, at decode and prefill sizes.

Without these checks some of these calls write out of bounds (an index array overwritten by the rows it
places), so ``test_aliasing.py`` runs this module in a subprocess.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fastattn
from fastattn import reference

F32, F16, I32, I64 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32), np.dtype(np.int64)


class Arena:
    """Arrays for one call. ``take(name, shape, dtype)`` returns a fresh array, except for ``shared`` (the argument
    under test), which starts inside the memory of ``written`` (taken before it), one element past a drawn
    offset (so never the same view), and may run on into spare bytes after it."""

    SPARE = 1 << 22  # bytes after the written array, room for a larger shared argument

    def __init__(self, written: str, shared: str | None, offset_fraction: float):
        self.written, self.shared, self.fraction = written, shared, offset_fraction
        self.buffer: np.ndarray | None = None

    def take(self, name: str, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        if name == self.shared:
            assert self.buffer is not None, "the written array is taken first"
            written_bytes = self.buffer.nbytes - self.SPARE
            start = (int(self.fraction * (written_bytes - 2 * dtype.itemsize)) // 8) * 8 + dtype.itemsize
            assert start + size <= self.buffer.nbytes
            return self.buffer[start:start + size].view(dtype).reshape(shape)
        raw = np.zeros(size + (self.SPARE if name == self.written else 0), np.uint8)
        if name == self.written:
            self.buffer = raw
        return raw[:size].view(dtype).reshape(shape)


def _floats(a: np.ndarray, rng) -> np.ndarray:
    a[...] = rng.standard_normal(a.shape).astype(a.dtype)
    return a


def _positions(a: np.ndarray, rng) -> np.ndarray:
    a[...] = rng.integers(0, 1000, a.shape)
    return a


def _rows(a: np.ndarray, n_rows: int, rng) -> np.ndarray:
    a[...] = rng.permutation(n_rows)[:a.shape[0]]
    return a


# Each builder takes (lib, arena, rng, n) and returns the call to make; the written argument is taken first.
def set_rows_case(lib, arena, rng, n):
    dst = arena.take("dst", (max(2 * n, 8), 64), F16)
    src = _floats(arena.take("src", (n, 64), F32), rng)
    idx = _rows(arena.take("idx", (n,), I64), dst.shape[0], rng)
    return lambda: lib.set_rows(dst, src, idx)


ROPE = dict(n_dims=64, mode=fastattn.ROPE_NEOX)


def rope_ext_case(lib, arena, rng, n):
    out = arena.take("out", (n, 4, 64), F32)
    x = _floats(arena.take("x", (n, 4, 64), F32), rng)
    pos = _positions(arena.take("pos", (n,), I32), rng)
    ff = arena.take("freq_factors", (32,), F32)
    ff[...] = 1.0 + rng.random(32)
    return lambda: lib.rope_ext(x, pos, freq_factors=ff, out=out, **ROPE)


def rope_in_place_case(lib, arena, rng, n):
    x = _floats(arena.take("x", (n, 4, 64), F32), rng)
    pos = _positions(arena.take("pos", (n,), I32), rng)
    return lambda: lib.rope_ext(x, pos, out=x, **ROPE)


def _cache_overlapping(lib, arena, rng, n, written: str, shape, dtype):
    """A rope cache whose table is, when ``cache`` is under test, the written array's memory."""
    pos = _positions(np.empty(n, I32), rng)
    cache = lib.rope_cache(pos, n_dims=64, mode=fastattn.ROPE_NORMAL)
    if arena.shared != "cache":
        return arena.take(written, shape, dtype), cache
    table = cache.cs if lib is fastattn else cache.cos
    arena.buffer = table.reshape(-1).view(np.uint8)
    return arena.buffer[:int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape), cache


def apply_rope_cache_case(lib, arena, rng, n):
    out, cache = _cache_overlapping(lib, arena, rng, n, "out", (n, 1, 64), F32)
    x = _floats(arena.take("x", (n, 1, 64), F32), rng)
    return lambda: lib.apply_rope_cache(x, cache, out=out)


def rope_set_rows_case(lib, arena, rng, n):
    dst = arena.take("dst", (2 * n, 4 * 64), F16)
    x = _floats(arena.take("x", (n, 4, 64), F32), rng)
    pos = _positions(arena.take("pos", (n,), I32), rng)
    idx = _rows(arena.take("idx", (n,), I32), dst.shape[0], rng)
    return lambda: lib.rope_set_rows(dst, x, pos, idx, **ROPE)


def apply_rope_cache_set_rows_case(lib, arena, rng, n):
    dst, cache = _cache_overlapping(lib, arena, rng, n, "dst", (n, 64), F32)
    x = _floats(arena.take("x", (n, 1, 64), F32), rng)
    idx = _rows(arena.take("idx", (n,), I64), dst.shape[0], rng)
    return lambda: lib.apply_rope_cache_set_rows(dst, x, cache, idx)


def rms_norm_mul_case(lib, arena, rng, n):
    out = arena.take("out", (n, 1024), F32)
    x = _floats(arena.take("x", (n, 1024), F32), rng)
    w = _floats(arena.take("w", (1024,), F32), rng)
    return lambda: lib.rms_norm_mul(x, w, 1e-5, out=out)


def add_rms_norm_mul_case(written):
    def case(lib, arena, rng, n):
        first = arena.take(written, (n, 1024), F32)
        x = _floats(arena.take("x", (n, 1024), F32), rng)
        residual = _floats(arena.take("residual", (n, 1024), F32), rng)
        w = _floats(arena.take("w", (1024,), F32), rng)
        other = arena.take("sum_out" if written == "out" else "out", (n, 1024), F32)
        out, sum_out = (first, other) if written == "out" else (other, first)
        return lambda: lib.add_rms_norm_mul(x, residual, w, 1e-5, out=out, sum_out=sum_out)
    return case


def flash_attn_case(lib, arena, rng, n):
    nq = 1 if n < 64 else 64
    out = arena.take("out", (1, nq, 8, 64), F32)
    q = _floats(arena.take("q", (1, 8, nq, 64), F32), rng)
    k = _floats(arena.take("k", (1, 2, 256, 64), F16), rng)
    v = _floats(arena.take("v", (1, 2, 256, 64), F16), rng)
    mask = arena.take("mask", (nq, 256), F32)
    mask[...] = 0.0
    sinks = _floats(arena.take("sinks", (8,), F32), rng)
    return lambda: lib.flash_attn_ext(q, k, v, mask, scale=0.125, sinks=sinks, out=out)


CASES = {
    "set_rows": (set_rows_case, "dst", ["src", "idx"]),
    "rope_ext": (rope_ext_case, "out", ["x", "pos", "freq_factors"]),
    "rope_ext in place": (rope_in_place_case, "x", ["pos"]),
    "apply_rope_cache": (apply_rope_cache_case, "out", ["x", "cache"]),
    "rope_set_rows": (rope_set_rows_case, "dst", ["x", "pos", "idx"]),
    "apply_rope_cache_set_rows": (apply_rope_cache_set_rows_case, "dst", ["x", "idx", "cache"]),
    "rms_norm_mul": (rms_norm_mul_case, "out", ["x", "w"]),
    "add_rms_norm_mul out": (add_rms_norm_mul_case("out"), "out", ["x", "residual", "w", "sum_out"]),
    "add_rms_norm_mul sum_out": (add_rms_norm_mul_case("sum_out"), "sum_out", ["x", "residual", "w"]),
    "flash_attn_ext": (flash_attn_case, "out", ["q", "k", "v", "mask", "sinks"]),
}
PAIRS = [(op, arg) for op, (_, _, args) in CASES.items() for arg in args]


@pytest.mark.parametrize("op,arg", PAIRS, ids=[f"{op}-{arg}" for op, arg in PAIRS])
@given(n=st.sampled_from((1, 3, 256)), threads=st.sampled_from((1, 2)),
       fraction=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_an_output_sharing_memory_with_an_argument_raises_before_writing(op, arg, n, threads, fraction, seed):
    build, written, _ = CASES[op]
    for lib in (fastattn, reference):
        rng = np.random.default_rng(seed)
        with fastattn.num_threads(threads):
            build(lib, Arena(written, None, 0.0), rng, n)()  # a valid call first: fast paths record entry points
            arena = Arena(written, arg, fraction)
            call = build(lib, arena, rng, n)
            before = arena.buffer.copy()
            with pytest.raises(ValueError, match=arg.replace("cache", "(cache|out|dst)")):
                call()
            assert np.array_equal(arena.buffer, before), f"{lib.__name__}.{op}: written before raising"

"""The machine's roofs, measured in a fraction of a second: copy and DRAM-read bandwidth, float32 FMA peak.

These are what `python -m fastattn bench` compares each op's achieved GB/s or GFLOP/s against. The buffers are
larger than any L3 here (256 MiB), so the bandwidths are DRAM bandwidths; the FMA loop keeps 64 float32
accumulators (8 ymm registers) in flight per thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numba import prange

from .._core.kernel import kernel

BUFFER_BYTES = 256 << 20
FMA_ITERATIONS = 20_000_000
_LANES = 64


@kernel(parallel=True)
def _copy(src, dst, n_chunks):
    step = (src.size + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        lo = c * step
        a = src[lo:lo + step]
        b = dst[lo:lo + step]
        for i in range(a.size):
            b[i] = a[i]


@kernel(parallel=True)
def _read(src, n_chunks):
    step = (src.size + n_chunks - 1) // n_chunks
    partial = np.zeros(n_chunks, np.float32)
    for c in prange(n_chunks):
        a = src[c * step:(c + 1) * step]
        s = np.float32(0.0)
        for i in range(a.size):
            s += a[i]
        partial[c] = s
    return partial.sum()


@kernel(parallel=True)
def _fma(n_threads, iterations):
    partial = np.zeros(n_threads, np.float32)
    for t in prange(n_threads):
        acc = np.arange(_LANES, dtype=np.float32)
        a = np.float32(0.999999) + np.float32(t) * np.float32(1e-9)
        b = np.float32(1e-7)
        for _ in range(iterations):
            for j in range(_LANES):
                acc[j] = acc[j] * a + b
        partial[t] = acc.sum()
    return partial.sum()


@dataclass
class Roofs:
    threads: int
    copy_gbs: float  # (read + write) bytes / s of a large copy
    read_gbs: float  # bytes / s of a large read-only reduction
    fma_gflops: float  # float32 FMA peak, 2 flops per FMA


def _best_seconds(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(threads: int) -> Roofs:
    """Measure the three roofs on ``threads`` threads (about 1 s, 512 MiB of memory)."""
    import numba

    numba.set_num_threads(threads)
    n = BUFFER_BYTES // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    chunks = 16 * threads
    copy_s = _best_seconds(lambda: _copy(src, dst, chunks))
    read_s = _best_seconds(lambda: _read(src, chunks))
    iterations = FMA_ITERATIONS // _LANES * 8
    fma_s = _best_seconds(lambda: _fma(threads, iterations), repeats=2)
    return Roofs(threads, 2 * BUFFER_BYTES / copy_s / 1e9, BUFFER_BYTES / read_s / 1e9,
                 2 * _LANES * iterations * threads / fma_s / 1e9)

"""The machine's roofs, measured in about a second: copy and DRAM-read bandwidth, the copy bandwidth of a working
set that stays in cache, float32 FMA peak.

These are what `python -m fastattn bench` compares each op's achieved GB/s or GFLOP/s against. The DRAM buffers
(256 MiB) are larger than the L3 of most CPUs, so those bandwidths are DRAM bandwidths. The main job's timing
repeats each call on the same buffers, so an op whose working set fits the last-level cache reads it from there,
faster than DRAM: such an op is compared against a copy of a working set of its size (the next power of 2:
``copy_at``, or ``CACHE_BYTES`` where none was measured) on the same threads, copied many times, and an op too
small to run on threads against a one-thread copy of ``SERIAL_BYTES``. The FMA loop keeps 64 float32
accumulators (8 ymm registers) in flight per thread.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import prange

from .._core import threads as _threads
from .._core.kernel import kernel
from .timing import fastest_call, per_second

BUFFER_BYTES = 256 << 20
#: The one-thread in-cache copy's working set: the size below which the ops run serially
#: (``_threads.PARALLEL_MIN_BYTES``), so theirs is smaller (inside the L2 of current server CPUs).
SERIAL_BYTES = _threads.PARALLEL_MIN_BYTES
#: What the roofs printed by ``bench`` mean for the rates in the table.
NOTE = ("(the timing repeats each call on the same buffers: an op whose working set fits the CPU's caches reads it "
        "from there,\n so its GB/s can exceed the DRAM copy: its roof is a copy of a working set of its size, on one "
        "thread for the ops too small to run on threads)")
#: The in-cache copy's working set (source and destination together): inside the L3 of current server CPUs.
CACHE_BYTES = 8 << 20
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
    cache_copy_gbs: float = 0.0  # (read + write) bytes / s of a copy whose working set (CACHE_BYTES) stays in cache
    cache_bytes: int = CACHE_BYTES
    #: the same on one thread for a working set of SERIAL_BYTES: the roof of the ops too small to run on threads
    serial_copy_gbs: float = 0.0
    serial_bytes: int = 0
    last_level_cache_bytes: int | None = None  # the size sysfs reports (None: unknown)
    #: copy bandwidth by working set (bytes, a power of 2): measured for the working sets of the ops (``measure``)
    copy_at: dict = field(default_factory=dict)


def size_class(nbytes: float) -> int:
    """The working set ``copy_at`` measures for ``nbytes``: the next power of 2, at least ``SERIAL_BYTES``."""
    return max(SERIAL_BYTES, 1 << max(0, math.ceil(math.log2(max(nbytes, 1)))))


def measure(threads: int, working_sets=()) -> Roofs:
    """Measure the roofs on ``threads`` threads (about 1 s, 512 MiB of memory); ``working_sets``: bytes per call
    of ops, for each of whose ``size_class`` that fits the last-level cache a copy is measured (``copy_at``)."""
    import numba

    numba.set_num_threads(threads)
    n = BUFFER_BYTES // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    chunks = 16 * threads
    copy_s = fastest_call(lambda: _copy(src, dst, chunks))
    read_s = fastest_call(lambda: _read(src, chunks))
    iterations = FMA_ITERATIONS // _LANES * 8
    fma_s = fastest_call(lambda: _fma(threads, iterations), repeats=2)
    small = np.ones(CACHE_BYTES // 8, np.float32)
    small_dst = np.empty_like(small)
    cache_s = fastest_call(lambda: _copy(small, small_dst, chunks), repeats=50)
    numba.set_num_threads(1)
    tiny, tiny_dst = small[:SERIAL_BYTES // 8], small_dst[:SERIAL_BYTES // 8]
    serial_s = fastest_call(lambda: _copy(tiny, tiny_dst, 1), repeats=200)
    numba.set_num_threads(threads)
    from .machine import last_level_cache_bytes

    llc = last_level_cache_bytes()
    copy_at = {}
    for size in sorted({size_class(w) for w in working_sets if w <= (llc or CACHE_BYTES)}):
        if size <= BUFFER_BYTES:
            a, b = src[:size // 8], dst[:size // 8]
            copy_at[size] = per_second(size, fastest_call(lambda: _copy(a, b, chunks), repeats=30))
    return Roofs(threads, per_second(2 * BUFFER_BYTES, copy_s), per_second(BUFFER_BYTES, read_s),
                 per_second(2 * _LANES * iterations * threads, fma_s), per_second(CACHE_BYTES, cache_s), CACHE_BYTES,
                 per_second(SERIAL_BYTES, serial_s), SERIAL_BYTES, llc, copy_at)

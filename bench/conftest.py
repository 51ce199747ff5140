"""Shared pieces of the benchmarks (pytest-benchmark).

Run: ``python -m pytest bench --benchmark-columns=median,iqr,rounds --benchmark-group-by=group``.
Each benchmark is parametrised over implementation (reference / fast paths / torch) and thread count, put in one
group per op and shape, and records its achieved GB/s or GFLOP/s in ``extra_info`` from the median time.
pytest-benchmark times each benchmark; the paired ones (``paired``) also time their calls side by side inside each
of its rounds with the main job's timing module (``fastattn.jobs.timing``), whose ``per_second`` gives every rate.
"""
from __future__ import annotations

import numpy as np
import pytest
import threadpoolctl

import fastattn
from fastattn._core import threads as _threads
from fastattn.jobs.timing import Rounds, per_second

THREADS = [1, 2]

# Each benchmark times its kernels at the thread count it names (bench_layer.py measures the default rule).
_threads.set_thread_rule("fixed")

# The references' matmuls would leave OpenBLAS workers spinning on the cores our prange workers need; torch's
# own threads are set per benchmark below.
threadpoolctl.threadpool_limits(1, user_api="blas")


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


def measure(benchmark, fn, *, group: str, threads: int, nbytes: float = 0.0, flops: float = 0.0,
            rounds: int | None = None):
    """Time ``fn`` on ``threads`` threads under ``group``; record GB/s (nbytes) or GFLOP/s (flops)."""
    benchmark.group = group
    benchmark.extra_info["threads"] = threads
    torch = torch_or_none()
    if torch is not None:
        torch.set_num_threads(threads)
    with fastattn.num_threads(threads):
        fn()  # compile / warm up outside the timing
        if rounds:
            result = benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
        else:
            result = benchmark(fn)
    if benchmark.stats is None:  # --benchmark-disable: fn ran once, untimed; nothing to record
        return result
    median = benchmark.stats.stats.median
    if nbytes:
        benchmark.extra_info["GB/s"] = round(per_second(nbytes, median), 2)
    if flops:
        benchmark.extra_info["GFLOP/s"] = round(per_second(flops, median), 2)
    benchmark.extra_info["median_us"] = round(median * 1e6, 2)
    return result


def paired(benchmark, calls: dict, *, group: str, threads: int, nbytes: float = 0.0, rounds: int | None = None,
           skip: int = 1, arguments=None) -> dict[str, float] | None:
    """Time ``calls`` (name -> function) side by side: each round of ``measure`` calls each once, in an order that
    rotates from round to round (``Rounds.run``, ``arguments`` as there). Returns each name's median seconds past
    the first ``skip`` rounds (the first is ``measure``'s warm-up call), or None under --benchmark-disable."""
    timed = Rounds(calls)
    measure(benchmark, lambda: timed.run(calls, arguments), group=group, threads=threads, nbytes=nbytes,
            rounds=rounds)
    if benchmark.stats is None:  # --benchmark-disable: one untimed round, no medians to record
        return None
    return timed.medians(skip)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def copy_baseline(nbytes: float):
    """A memory-bound baseline: ``fn()`` copying float32 arrays so that ``nbytes`` are read + written in total.
    Numba loops, by the ops' own rule: serial below 1 MiB, else prange on ``fastattn.get_num_threads()``
    threads. Compare an op's GB/s with this one's."""
    copy_serial, copy_parallel = _copy_kernels()
    src = np.ones((max(1, int(nbytes) // 8 // 1024), 1024), np.float32)
    dst = np.empty_like(src)

    def run():
        (copy_serial if _threads.threads_for(nbytes) == 1 else copy_parallel)(src, dst)
    return run


def _copy_kernels():
    from numba import prange

    from fastattn._core.kernel import kernel

    @kernel
    def copy_serial(src, dst):
        for i in range(src.shape[0]):
            dst[i] = src[i]

    @kernel(parallel=True)
    def copy_parallel(src, dst):
        for i in prange(src.shape[0]):
            dst[i] = src[i]

    return copy_serial, copy_parallel

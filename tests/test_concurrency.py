"""Calls from several Python threads at once (kernels release the GIL) give the same results as one at a time."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import fastattn
from fastattn._core import threads as _threads

N_THREADS = 4
CALLS = 25


def _worker(seed: int, rows: int, cache_rows: int) -> list[bytes]:
    """One Python thread's calls on its own inputs and outputs; returns every result, as bytes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 1024)).astype(np.float32)
    w = rng.standard_normal(1024).astype(np.float32)
    out = np.empty_like(x)
    cache = np.zeros((cache_rows, 1024), np.float16)
    got = []
    with fastattn.num_threads(2):
        for k in range(CALLS):
            idx = rng.integers(0, cache_rows, rows)
            fastattn.rms_norm_mul(x, w, 1e-5, out=out)
            fastattn.set_rows(cache, out, idx)
            got += [out.tobytes(), cache.tobytes()]
            x[:, k % 1024] += 1.0  # change the input between calls
    return got


def _run_all(rows: int, cache_rows: int, parallel: bool) -> list[list[bytes]]:
    if not parallel:
        return [_worker(seed, rows, cache_rows) for seed in range(N_THREADS)]
    with ThreadPoolExecutor(N_THREADS) as pool:
        return list(pool.map(lambda seed: _worker(seed, rows, cache_rows), range(N_THREADS)))


@pytest.mark.parametrize("rows, cache_rows", [(1, 64), (300, 512)], ids=["serial-kernels", "prange-kernels"])
def test_threads_calling_at_once_match_one_at_a_time(rows, cache_rows):
    moved = rows * 1024 * (4 + 4)
    assert (moved >= _threads.PARALLEL_MIN_BYTES) == (rows > 1)
    assert _run_all(rows, cache_rows, parallel=True) == _run_all(rows, cache_rows, parallel=False)

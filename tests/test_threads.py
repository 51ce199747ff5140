"""Thread control: the process-wide count, the per-thread override, and the serial rule for small work."""
import threading

import pytest

import fastattn
from fastattn import _threads


def test_set_and_get_num_threads_round_trip():
    before = fastattn.get_num_threads()
    try:
        fastattn.set_num_threads(1)
        assert fastattn.get_num_threads() == 1
    finally:
        fastattn.set_num_threads(before)


def test_context_manager_overrides_this_thread_only():
    outer = fastattn.get_num_threads()
    seen = {}
    with fastattn.num_threads(1):
        assert fastattn.get_num_threads() == 1
        other = threading.Thread(target=lambda: seen.setdefault("n", fastattn.get_num_threads()))
        other.start()
        other.join()
    assert seen["n"] == outer
    assert fastattn.get_num_threads() == outer


@pytest.mark.parametrize("bad", [0, -1, 10**6])
def test_bad_thread_counts_raise_value_error(bad):
    with pytest.raises(ValueError, match="n must be"):
        fastattn.set_num_threads(bad)
    with pytest.raises(ValueError, match="n must be"):
        with fastattn.num_threads(bad):
            pass


def test_thread_count_must_be_an_integer():
    with pytest.raises(TypeError, match="n must be an integer"):
        fastattn.set_num_threads(1.5)


def test_small_work_runs_serially_large_work_in_parallel():
    with fastattn.num_threads(2):
        assert _threads.threads_for(4096 * 4) == 1  # one decode row
        assert _threads.threads_for(_threads.PARALLEL_MIN_BYTES) == min(2, _threads.max_threads())
    with fastattn.num_threads(1):
        assert _threads.threads_for(1 << 30) == 1


def test_override_stays_in_its_asyncio_task():
    import asyncio

    outer = fastattn.get_num_threads()
    seen = {}

    async def inside():
        with fastattn.num_threads(1):
            await asyncio.sleep(0.01)  # the other task runs meanwhile
            seen["inside"] = fastattn.get_num_threads()

    async def beside():
        await asyncio.sleep(0.005)
        seen["beside"] = fastattn.get_num_threads()

    async def main():
        await asyncio.gather(inside(), beside())
        seen["after"] = fastattn.get_num_threads()

    asyncio.run(main())
    assert seen == {"inside": 1, "beside": outer, "after": outer}


CONCURRENT_CALLS = """
import sys, threading
import numpy as np
import fastattn
from fastattn import _threads

rng = np.random.default_rng(0)
x = rng.standard_normal((512, 1024)).astype(np.float32)
w = rng.standard_normal(1024).astype(np.float32)
q = rng.standard_normal((1, 8, 64, 64)).astype(np.float32)
k = rng.standard_normal((1, 2, 512, 64)).astype(np.float16)
pos = np.arange(512, dtype=np.int32)
xr = rng.standard_normal((512, 8, 64)).astype(np.float32)
calls = [lambda: fastattn.rms_norm_mul(x, w, 1e-5),
         lambda: fastattn.flash_attn_ext(q, k, k, scale=0.125, path="tiled"),
         lambda: fastattn.rope_ext(xr, pos, n_dims=64, mode=fastattn.ROPE_NEOX),
         lambda: fastattn.set_rows(np.zeros((1024, 1024), np.float16), x, np.arange(512))]
with fastattn.num_threads(2):
    expected = [c() for c in calls]
different = []

def work(t):
    with fastattn.num_threads(2):
        for i in range(8):
            c = (t + i) % len(calls)
            got = calls[c]()
            if not np.array_equal(got, expected[c]):
                different.append(c)

threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(_threads.threading_layer(), len(different))
"""


def _layers() -> list[str]:
    layers = ["omp", "workqueue"]
    try:  # tbb only where its library loads
        import numba.np.ufunc.tbbpool  # noqa: F401
        layers.append("tbb")
    except ImportError:
        pass
    return layers


@pytest.mark.parametrize("layer", _layers())
def test_concurrent_parallel_calls_under_each_threading_layer(layer):
    """Four Python threads launching parallel kernels at once: under workqueue (not thread-safe) the launches
    are serialised instead of aborting the process; every result equals the single-threaded one."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_THREADING_LAYER=layer)
    run = subprocess.run([sys.executable, "-c", CONCURRENT_CALLS], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [layer, "0"]

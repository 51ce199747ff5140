"""Thread control: the process-wide count, the per-thread override, the serial rule for small work and the
measured choice between all threads and one."""
import threading

import numpy as np

import pytest

import fastattn
from fastattn._core import threads as _threads


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
from fastattn._core import threads as _threads

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


# ---------------------------------------------------------------------------------------------------------------
# The measured rule: a call site runs its prange kernel on all threads or on one, whichever it has timed faster.
@pytest.fixture
def measured_rule():
    saved = _threads.get_thread_rule()
    _threads.set_thread_rule("measured")
    _threads._sites.clear()
    try:
        yield
    finally:
        _threads.set_thread_rule(saved)
        _threads._sites.clear()


class _Clock:
    """Stands in for ``time`` in ``_core.threads`` during ``_timed_calls``: a timed block lasts exactly the seconds the
    test gives it, however busy the machine is (sleeps of 2.0 and 2.2 ms overshoot by more than their difference
    on a loaded machine)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _timed_calls(n_calls: int, seconds_on: dict[int, float], op: str = "test_op") -> list[int]:
    """n_calls launches of one call site whose block takes ``seconds_on[launch.n]``; the thread counts used."""
    used = []
    clock, saved = _Clock(), _threads.time
    _threads.time = clock
    try:
        for _ in range(n_calls):
            with _threads.team(op, 1 << 22, 2) as launch:
                clock.now += seconds_on[launch.n]
            used.append(launch.n)
    finally:
        _threads.time = saved
    return used


def test_measured_rule_tries_both_then_takes_the_faster_and_retries_the_other(measured_rule):
    used = _timed_calls(2 * _threads.RETRY_EVERY + 1, {1: 0.0005, 2: 0.004})
    tries = _threads.TRIES
    assert used[:2 * tries] == [2] * tries + [1] * tries  # each choice TRIES times (the first not counted)
    later = used[2 * tries:]
    # one thread was far faster: it runs, but for a retry of two threads once every RETRY_EVERY calls
    assert later.count(2) == sum(1 for c in range(2 * tries + 1, len(used) + 1) if c % _threads.RETRY_EVERY == 0)
    assert later.count(2) >= 1


def test_measured_rule_retries_more_often_when_the_choices_are_close(measured_rule):
    used = _timed_calls(2 * _threads.TRIES + 4 * _threads.RETRY_CLOSE, {1: 0.002, 2: 0.0022})
    later = used[2 * _threads.TRIES:]
    assert later.count(2) == 4 and later.count(1) == len(later) - 4


def test_measured_rule_keeps_all_threads_when_they_are_faster(measured_rule):
    used = _timed_calls(_threads.RETRY_EVERY + 8, {1: 0.004, 2: 0.0005})
    later = used[2 * _threads.TRIES:]
    assert later.count(1) == 1 and later.count(2) == len(later) - 1


def test_measured_rule_follows_a_change_of_surroundings(measured_rule):
    _timed_calls(10, {1: 0.0005, 2: 0.004})
    used = _timed_calls(4 * _threads.RETRY_EVERY, {1: 0.004, 2: 0.0005})  # now all threads are faster
    # all threads again, but for the retries of one thread (one per RETRY_EVERY calls)
    assert used[-2 * _threads.RETRY_EVERY:].count(1) == 2


def test_long_calls_always_run_on_all_threads(measured_rule, monkeypatch):
    monkeypatch.setattr(_threads, "ALWAYS_PARALLEL_S", 0.001)
    assert _timed_calls(8, {1: 0.0001, 2: 0.002}) == [2] * 8


def test_failed_launches_are_not_counted(measured_rule):
    with pytest.raises(RuntimeError):
        with _threads.team("test_op", 1 << 22, 2):
            raise RuntimeError("kernel failed")
    site = _threads._sites[("test_op", 2, 23)]
    assert site.tries == [0, 0]


def test_fixed_rule_and_the_test_hook_launch_on_every_thread(measured_rule):
    with _threads.parallel_min_bytes(0):
        assert _timed_calls(8, {1: 0.0, 2: 0.001}) == [2] * 8
    _threads.set_thread_rule("fixed")
    assert _timed_calls(8, {1: 0.0, 2: 0.001}) == [2] * 8
    assert _threads.team("test_op", 1 << 22, 1).n == 1


def test_set_thread_rule_refuses_an_unknown_rule():
    with pytest.raises(ValueError, match="rule must be one of"):
        fastattn.set_thread_rule("fastest")


def _ops_above_the_size_rule():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, 1024)).astype(np.float32)
    w = rng.standard_normal(1024).astype(np.float32)
    rows = rng.standard_normal((512, 8, 128)).astype(np.float32)
    pos = np.arange(512, dtype=np.int32)
    q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    kv = rng.standard_normal((2, 1, 8, 1024, 128)).astype(np.float16)
    qp = rng.standard_normal((1, 4, 96, 64)).astype(np.float32)
    kp = rng.standard_normal((1, 2, 1024, 64)).astype(np.float32)
    return {
        "rms_norm_mul": lambda: fastattn.rms_norm_mul(x, w, 1e-5),
        "set_rows": lambda: fastattn.set_rows(np.zeros((2048, 1024), np.float16), x, np.arange(600) * 3),
        "rope_ext": lambda: fastattn.rope_ext(rows, pos, n_dims=128, mode=fastattn.ROPE_NEOX),
        "rope_set_rows": lambda: fastattn.rope_set_rows(np.zeros((1024, 8, 128), np.float16), rows, pos, pos * 2,
                                                        n_dims=128, mode=fastattn.ROPE_NEOX),
        "decode": lambda: fastattn.flash_attn_ext(q, kv[0], kv[1], scale=0.088, path="one_chunk"),
        "split_kv": lambda: fastattn.flash_attn_ext(q, kv[0], kv[1], scale=0.088, path="split_kv"),
        "tiled": lambda: fastattn.flash_attn_ext(qp, kp, kp, scale=0.125, path="tiled"),
    }


@pytest.mark.parametrize("op", list(_ops_above_the_size_rule()))
def test_both_measured_choices_give_the_same_result(measured_rule, op):
    """A call site's first calls run on 2 threads, the next ones on 1: the outputs are identical."""
    call = _ops_above_the_size_rule()[op]
    with fastattn.num_threads(2):
        first = call()
        for _ in range(2 * _threads.TRIES - 1):
            assert np.array_equal(call(), first)
    sites = [site for key, site in _threads._sites.items() if key[1] == 2]
    assert sites and all(site.tries[0] >= _threads.TRIES and site.tries[1] >= _threads.TRIES for site in sites)


@pytest.mark.parametrize("op, module, parallel_kernel", [
    ("set_rows", "fastattn.rows.api", "_set_rows_parallel"), ("rms_norm_mul", "fastattn.norm.api", "_norm_parallel"),
    ("split_kv", "fastattn.attention.split_kv", "_parallel"), ("tiled", "fastattn.attention.tiled", "_run_parallel")])
def test_the_one_thread_choice_runs_the_serial_kernel(measured_rule, monkeypatch, op, module, parallel_kernel):
    """When a call site's measured choice is one thread, the op runs the code a 1-thread call runs (its serial
    kernel), not its prange kernel on one thread."""
    import importlib

    call = _ops_above_the_size_rule()[op]
    with fastattn.num_threads(1):
        expected = call()

    def refused(*args, **kwargs):
        raise AssertionError(f"{parallel_kernel} launched for a one-thread choice")

    monkeypatch.setattr(importlib.import_module(module), parallel_kernel, refused)
    monkeypatch.setattr(_threads._Site, "choose", lambda site: 0)
    with fastattn.num_threads(2):
        assert np.array_equal(call(), expected)
    assert any(site.tries[0] == 1 for key, site in _threads._sites.items() if key[1] == 2)

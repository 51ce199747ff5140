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

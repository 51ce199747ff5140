"""Thread control and the rule for when a kernel runs in parallel.

A ``prange`` launch is cheap back to back (2-6 us) but costs 0.1-0.6 ms when the pool has been idle
(MEASURED.md), which is more than a whole decode-sized op takes. So every op estimates the bytes it moves and
runs its serial kernel below ``PARALLEL_MIN_BYTES``; above it, its ``prange`` kernel on ``get_num_threads()``
threads.

The thread count is process-wide (``set_num_threads``) with a per-Python-thread override
(``with num_threads(n):``). Numba's own setting is per calling thread, so it is applied at each parallel launch.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from . import _validate

#: Below this many bytes read + written, an op runs serially on the calling thread.
PARALLEL_MIN_BYTES = 1 << 20


class _Local(threading.local):
    n: int | None = None  # a class default: a missing attribute would cost a raised AttributeError (~1 us)


_local = _Local()
_default: int | None = None


def max_threads() -> int:
    """The size of Numba's thread pool (``NUMBA_NUM_THREADS``, by default the number of CPUs)."""
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (1 <= n <= ``max_threads()``) for large ops from now on, in every Python thread."""
    global _default
    _default = _validate.integer("n", n, minimum=1, maximum=max_threads())


def get_num_threads() -> int:
    """The thread count large ops use in the calling Python thread."""
    override = _local.n
    if override is not None:
        return override
    return _default if _default is not None else max_threads()


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[int]:
    """``with num_threads(2): ...`` runs the block's ops on ``n`` threads (this Python thread only)."""
    n = _validate.integer("n", n, minimum=1, maximum=max_threads())
    previous = _local.n
    _local.n = n
    try:
        yield n
    finally:
        _local.n = previous


def threads_for(nbytes: int) -> int:
    """How many threads an op moving ``nbytes`` should use; applies the count to Numba when > 1."""
    if nbytes < PARALLEL_MIN_BYTES:  # tested first: the decode-sized calls it short-cuts are the hot ones
        return 1
    n = get_num_threads()
    if n == 1:
        return 1
    import numba

    numba.set_num_threads(n)
    return n



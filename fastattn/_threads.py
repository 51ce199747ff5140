"""Thread control and the rule for when a kernel runs in parallel.

A ``prange`` launch is cheap back to back (2-6 us) but costs 0.1-0.6 ms when the pool has been idle,
which is more than a whole decode-sized op takes. So every op estimates the bytes it moves and
runs its serial kernel below ``PARALLEL_MIN_BYTES``; above it, its ``prange`` kernel on ``get_num_threads()``
threads.

The thread count is process-wide (``set_num_threads``) with an override for a block of code
(``with num_threads(n):``), held in a ``contextvars.ContextVar``: it covers the calling Python thread and, under
asyncio, only the task that set it. Numba's own setting is per calling thread, so it is applied at each parallel
launch.

Concurrent calls from several Python threads are safe under Numba's ``omp`` and ``tbb`` threading layers. Its
``workqueue`` layer (what Numba falls back to when neither is available) aborts the process when two threads
launch parallel kernels at once, so under it every public op holds one process-wide lock (``guard``): calls from
different Python threads then run one at a time.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from typing import Callable, Iterator

from . import _validate

#: Below this many bytes read + written, an op runs serially on the calling thread.
PARALLEL_MIN_BYTES = 1 << 20

#: The ``num_threads`` override of the current context (None: the process-wide count).
_override: contextvars.ContextVar[int | None] = contextvars.ContextVar("fastattn_num_threads", default=None)
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
    override = _override.get()
    if override is not None:
        return override
    return _default if _default is not None else max_threads()


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[int]:
    """``with num_threads(2): ...`` runs the block's ops on ``n`` threads (in this Python thread, or this asyncio
    task, only)."""
    n = _validate.integer("n", n, minimum=1, maximum=max_threads())
    token = _override.set(n)
    try:
        yield n
    finally:
        _override.reset(token)


@contextlib.contextmanager
def parallel_min_bytes(nbytes: int) -> Iterator[int]:
    """Within the block, ops run in parallel from ``nbytes`` moved (a test hook: the parallel kernels on small
    shapes). Process-wide: not for use while other threads run ops."""
    global PARALLEL_MIN_BYTES
    saved = PARALLEL_MIN_BYTES
    PARALLEL_MIN_BYTES = _validate.integer("nbytes", nbytes, minimum=0)
    try:
        yield PARALLEL_MIN_BYTES
    finally:
        PARALLEL_MIN_BYTES = saved


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




# ---------------------------------------------------------------------------------------------------------------
# Threading layers: which one Numba runs, and the lock that makes the workqueue layer safe.
_THREAD_SAFE_LAYERS = ("omp", "tbb")
_layer: str | None = None
_layer_lock = threading.Lock()
#: Held around every public op when the threading layer is not thread-safe.
_launch_lock = threading.RLock()


def threading_layer() -> str:
    """The threading layer Numba runs parallel kernels on ("omp", "tbb" or "workqueue"), starting its thread
    pool if it has not started yet (Numba chooses the layer then)."""
    global _layer
    if _layer is None:
        with _layer_lock:
            if _layer is None:
                import numba
                from numba.np.ufunc import parallel

                parallel._launch_threads()
                _layer = numba.threading_layer()
    return _layer


def guard(op: Callable) -> Callable:
    """``op`` itself under a thread-safe layer; under another, ``op`` holding the process-wide launch lock."""
    if threading_layer() in _THREAD_SAFE_LAYERS:
        return op

    @functools.wraps(op)
    def serialised(*args, **kwargs):
        with _launch_lock:
            return op(*args, **kwargs)

    return serialised

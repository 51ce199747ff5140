"""Thread control and the rule for when a kernel runs in parallel.

A ``prange`` launch is cheap back to back (2-6 us) but costs far more when the pool has been idle or when another
library's threads hold the cores: on a 2-vCPU machine, with OpenMP's default wait policy, 0.05 ms after 10 ms
idle and 2-8 ms after 30 ms or more; 0.05-0.15 ms always under ``OMP_WAIT_POLICY=PASSIVE``; 1-3 ms right after a
NumPy matmul whose BLAS threads still spin (``bench/bench_layer.py::test_pool_wake``). So the rule has two parts:

1. **Size.** Every op estimates the bytes it moves and runs its serial kernel below ``PARALLEL_MIN_BYTES``
   (``threads_for``): that work is shorter than any wake-up.
2. **Measured launches** (``team``). Above it the op runs its ``prange`` kernel on ``get_num_threads()``
   threads, or its serial kernel on the calling thread (the code a 1-thread call runs, so that the one-thread
   choice costs what ``num_threads(1)`` costs), whichever has been faster *where the op runs*: per call site (op,
   thread count, size class: a power of two of bytes) the rule keeps a running mean of the wall time of each
   choice, tries each ``TRIES`` times first (the first try of each is not counted: it may compile), then takes
   the faster (all threads only when at least ``PARALLEL_GAIN`` faster) and tries the other once every
   ``RETRY_EVERY`` calls, every ``RETRY_CLOSE`` while the two are within ``CLOSE`` of each other, so it follows
   a program whose surroundings change.
   A call whose parallel time exceeds ``ALWAYS_PARALLEL_S`` always runs parallel, without trying a whole call on
   one thread.

Results never depend on the choice: every op and every forced attention path gives the same bits on any number
of threads, and ``auto``'s path choice reads ``get_num_threads()``, never the measured team. The call sites'
records are shared by the process's Python threads; a lost update under a race only changes a timing.
``set_thread_rule("fixed")`` (or ``FASTATTN_THREAD_RULE=fixed``) turns part 2 off: the ``prange`` kernels then
always run on ``get_num_threads()`` threads, as benchmarks and tests want.

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
import os
import threading
import time
from typing import Callable, Iterator

from . import validate as _validate

#: Below this many bytes read + written, an op runs serially on the calling thread.
PARALLEL_MIN_BYTES = 1 << 20

#: The ``num_threads`` override of the current context (None: the process-wide count).
_override: contextvars.ContextVar[int | None] = contextvars.ContextVar("fastattn_num_threads", default=None)
_default: int | None = None
#: True inside ``parallel_min_bytes``: launches take get_num_threads() threads, not the measured choice
_forced = False


def cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
    """Within the block, ops run in parallel from ``nbytes`` moved, on ``get_num_threads()`` threads (a test hook:
    the parallel kernels on small shapes; no measured choice). Process-wide: not for use while other threads run
    ops."""
    global PARALLEL_MIN_BYTES, _forced
    saved = PARALLEL_MIN_BYTES, _forced
    PARALLEL_MIN_BYTES = _validate.integer("nbytes", nbytes, minimum=0)
    _forced = True  # the kernels the block asks for, not the measured choice
    try:
        yield PARALLEL_MIN_BYTES
    finally:
        PARALLEL_MIN_BYTES, _forced = saved


def threads_for(nbytes: int) -> int:
    """How many threads an op moving ``nbytes`` should use (the launch applies it to Numba: ``launch_on``)."""
    if nbytes < PARALLEL_MIN_BYTES:  # tested first: the decode-sized calls it short-cuts are the hot ones
        return 1
    return get_num_threads()


#: ``_core.kernel.apply_threads`` once Numba's threads have been started (``launch_on``)
_apply_threads = None


def launch_on(n: int) -> None:
    """Numba's thread count for the calling thread's next ``prange`` launches: ``n`` (> 1). Called once per
    parallel launch and never for a serial kernel. ``numba.set_num_threads`` costs 1 us back to back and about
    20 us where the caches are cold, as between a model's matmuls; after the first launch a compiled call sets
    the count instead (0.2 us, 5 us cold)."""
    global _apply_threads
    if _apply_threads is not None:
        _apply_threads(n)
        return
    import numba

    numba.set_num_threads(n)  # starts Numba's threads, which the compiled call needs
    from .kernel import apply_threads

    _apply_threads = apply_threads


# ---------------------------------------------------------------------------------------------------------------
# Measured launches: the prange kernel on n threads or on one, whichever has been faster at this call site.
#: Tries of each choice before the first comparison (the first is not counted).
TRIES = 4
#: A call site tries the choice it does not hold once every this many calls; every RETRY_CLOSE calls while that
#: choice's mean is within CLOSE times the held one's (the means are noisy there; a retry costs at most a quarter
#: of a call, under 2% spread over the calls between retries).
RETRY_EVERY = 32
RETRY_CLOSE = 16
CLOSE = 1.25
#: Calls whose parallel time is above this always run parallel. Not lower: right after a 2-thread matmul
#: OpenBLAS's spinning worker shares the second core for about 0.1 s, and a 21 ms prefill attention (one thread)
#: took 21-25 ms on two there.
ALWAYS_PARALLEL_S = 0.05
#: All threads are chosen when their mean time is at least this fraction below one thread's: a core is left to
#: the rest of the program when using it gains nothing measurable.
PARALLEL_GAIN = 0.05
#: Weight of a new time in a choice's running mean.
MEAN_WEIGHT = 0.25
_RULES = ("measured", "fixed")
_rule = os.environ.get("FASTATTN_THREAD_RULE", "measured")
if _rule not in _RULES:
    _rule = "measured"
#: (op, threads, size class) -> _Site; bounded (cleared when it grows past _MAX_SITES)
_sites: dict = {}
_MAX_SITES = 4096


def set_thread_rule(rule: str) -> None:
    """"measured" (the default): each call site above ``PARALLEL_MIN_BYTES`` runs its ``prange`` kernel on
    ``get_num_threads()`` threads or on the calling thread, whichever it has measured faster; "fixed": always on
    ``get_num_threads()`` threads."""
    global _rule
    if rule not in _RULES:
        raise ValueError(f"rule must be one of {_RULES}, got {rule!r}")
    _rule = rule


def get_thread_rule() -> str:
    """The rule in force: "measured" or "fixed" (``set_thread_rule``)."""
    return _rule


@contextlib.contextmanager
def thread_rule(rule: str) -> Iterator[str]:
    """``set_thread_rule(rule)`` for the block (process-wide), the previous rule restored after."""
    saved = _rule
    set_thread_rule(rule)
    try:
        yield rule
    finally:
        set_thread_rule(saved)


class _Site:
    """The running mean wall time of a call site's two choices: index 0 one thread, 1 all threads."""

    __slots__ = ("calls", "tries", "mean")

    def __init__(self):
        self.calls = 0
        self.tries = [0, 0]
        self.mean = [0.0, 0.0]

    def choose(self) -> int:
        self.calls += 1
        if self.tries[1] < TRIES:  # parallel first (the first try may compile; it is not counted)
            return 1
        if self.mean[1] > ALWAYS_PARALLEL_S:
            return 1
        if self.tries[0] < TRIES:
            return 0
        best = 1 if self.mean[1] < (1.0 - PARALLEL_GAIN) * self.mean[0] else 0
        close = self.mean[1 - best] < CLOSE * self.mean[best]
        return 1 - best if self.calls % (RETRY_CLOSE if close else RETRY_EVERY) == 0 else best

    def record(self, choice: int, seconds: float) -> None:
        tries = self.tries[choice] = self.tries[choice] + 1
        if tries == 2:
            self.mean[choice] = seconds
        elif tries > 2:
            self.mean[choice] += MEAN_WEIGHT * (seconds - self.mean[choice])


class Team:
    """A ``prange`` launch of a call site on ``n`` threads, timed (see ``team``)."""

    __slots__ = ("_site", "_choice", "_start", "n")

    def __init__(self, site: _Site, n: int):
        self._site = site
        self._choice = site.choose()
        self.n = n if self._choice else 1
        if self._choice:
            launch_on(n)

    def __enter__(self) -> "Team":
        self._start = time.perf_counter()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self._site.record(self._choice, time.perf_counter() - self._start)


class FixedTeam:
    """A launch on ``n`` threads, not timed: the fixed rule, the test hook, or one thread."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n
        if n > 1:
            launch_on(n)

    def __enter__(self) -> "FixedTeam":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        pass


_ONE = FixedTeam(1)
#: What ``team`` returns
Launch = Team | FixedTeam


def team(op: str, nbytes: int, n: int) -> Launch:
    """``with team("op", nbytes, n) as launch:`` run the op's ``prange`` kernel on ``launch.n`` threads when it
    is above 1, else its serial kernel: ``n`` (``threads_for``'s count) or 1, the call site's faster choice so
    far; Numba's count is set to it when it is above 1 (``launch_on``). The block's wall time is recorded for the
    call site, unless it raises."""
    if n <= 1:
        return _ONE
    if _rule != "measured" or _forced:
        return FixedTeam(n)
    key = (op, n, int(nbytes).bit_length())
    site = _sites.get(key)
    if site is None:
        if len(_sites) >= _MAX_SITES:
            _sites.clear()
        site = _sites[key] = _Site()
    return Team(site, n)


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

"""The main job's compile-ahead phase: the cases' first calls, in worker processes on all cores, before timing.

Numba compiles on the calling thread, so a job that compiles its cases' kernels as it reaches them uses one core for
most of its first run. Here the cases are handed to a pool of fresh processes as tasks: one per case, except that
the cases of an op group sharing their kernels (``Case.kernels``) form one task, so they are compiled once. Tasks go
out by op group, the slowest to compile first, and a free worker takes the next, so the cores stay busy until the
last ones. A worker builds the task's op group as the job does (once per group) and, case by case at every thread
count of the run, makes the first fast call (timed: the "1st call" figure, compilation included) and two more (the
calls after a first one take the ops' compiled fast paths, which may compile too), reporting each case as it
finishes. The kernels land in Numba's on-disk cache, so the job's own process then only loads them, and times with
the cores otherwise idle. The workers start (a fresh interpreter importing fastattn) while the job builds its cases;
with a warm cache the phase costs that start-up and the loads.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import queue as queue_module
import time
from dataclasses import dataclass

from .._core import helper_compile as _helper_compile
from .progress import Progress, elapsed

#: Op groups in the order their tasks are handed out: the slowest to compile first, so no worker is left with a
#: long one at the end.
ORDER = ("attention", "rope", "quant", "norm", "set_rows")


@dataclass(frozen=True)
class FirstCall:
    """What a case's first fast call did in a fresh process, at one thread count."""

    ms: float
    compiled: bool
    compile_s: float


_reports = None  # per worker process: the queue its finished cases go to (set by the pool's initializer)
#: Per worker process: the op groups' cases it has built, by (op group, config). A worker takes several tasks of
#: a group; building the group's inputs and float32 baselines once saves it seconds.
_built: dict = {}


def _set_queue(reports) -> None:
    global _reports
    _reports = reports
    os.environ[_helper_compile.ENV] = "0"  # the workers keep every core compiling: no helper processes of their own


def tasks(cases) -> list[tuple[str, list[int]]]:
    """The compile-ahead tasks of ``cases``, in the order they are handed out, as (op group, case indices): one
    per case, one per set of cases of an op group with the same ``kernels``; op groups in ``ORDER``."""
    grouped: dict[tuple[str, object], list[int]] = {}
    rank = {op: i for i, op in enumerate(ORDER)}
    for case in sorted(cases, key=lambda c: (rank.get(c.op_group, len(ORDER)), c.op_group, c.index)):
        grouped.setdefault((case.op_group, case.kernels or case.index), []).append(case.index)
    return [(op, indices) for (op, _), indices in grouped.items()]


def _start() -> None:
    """A no-op task: makes the pool start a worker (and import fastattn) before the real tasks are known."""
    from .._core import notices as _notices  # noqa: F401


def first_calls(op: str, indices: list[int], thread_counts: list[int], config) -> None:
    """The worker's task: the cases of ``op`` at ``indices`` at each thread count; each reported as it finishes."""
    from .._core import notices as _notices
    from .._core import threads as _threads
    from . import build, select_ops
    from .progress import CompileWatch

    _notices.LOGGER.propagate = False  # the parent process shows the progress
    if (op, config) not in _built:  # each case is first called by one task only, so the group's are reusable
        _built[op, config] = build(select_ops([op]), config)
    with CompileWatch() as watch:  # a handler on the notices' logger: none is printed here
        for case in _built[op, config]:
            if case.index not in indices:
                continue
            done = {}
            for n in thread_counts:
                with _threads.num_threads(n), _threads.thread_rule("fixed"):
                    started, seconds = watch.started, watch.seconds
                    start = time.perf_counter()
                    case.fast()
                    ms = (time.perf_counter() - start) * 1e3
                    done[n] = FirstCall(ms, watch.started > started, watch.seconds - seconds)
                    case.fast()
                    case.fast()
            _reports.put((op, case.index, case.label, done))


class Ahead:
    """The phase: its workers started before the job builds its own cases, the cases handed out once built
    (``submit``), their first calls waited for after (``wait``)."""

    def __init__(self, thread_counts: list[int], config, workers: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.reports = context.Queue()
        self.start = time.perf_counter()
        self.workers = workers
        self.thread_counts = thread_counts
        self.config = config
        self.pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_set_queue,
                                                           initargs=(self.reports,))
        self.futures = [self.pool.submit(_start) for _ in range(workers)]

    def submit(self, cases) -> None:
        """Hand out the first calls of ``cases`` (the job's, as ``build`` made them) as ``tasks``."""
        self.futures += [self.pool.submit(first_calls, op, indices, self.thread_counts, self.config)
                         for op, indices in tasks(cases)]

    def close(self) -> None:
        """Stop early: cancel the tasks not started, wait for the workers."""
        self.pool.shutdown(cancel_futures=True)

    def wait(self, total: int, progress: Progress | None) -> dict[tuple[str, int, int], FirstCall]:
        """The first calls by (op group, index, thread count), as workers report them (``total`` cases). A
        task whose worker fails keeps the cases it did not report: the job runs them itself and reports any
        error."""
        results: dict[tuple[str, int, int], FirstCall] = {}
        k = 0
        try:
            while True:
                try:
                    op, index, label, done = self.reports.get(timeout=0.2)
                except queue_module.Empty:
                    if all(f.done() for f in self.futures) and self.reports.empty():
                        break
                    continue
                k += 1
                for n, first in done.items():
                    results[(op, index, n)] = first
                if progress:
                    seconds = sum(f.compile_s for f in done.values())
                    progress.ahead(k, total, label, f"compiled {seconds:.1f} s" if seconds else "cached")
        finally:
            self.pool.shutdown()
        if progress:
            progress.ahead_done(k, self.workers, elapsed(time.perf_counter() - self.start))
        return results

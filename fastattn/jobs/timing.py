"""Timing for the main job, its roofs and the benchmarks (bench/): how calls are timed, and the figures made
of them.

``time_rounds`` is the main job's. One number from one stretch of calls is easily off by a factor of several on
a shared machine (the same op has read 0.75 ms in one run and 7.99 ms in another), so each figure is ``rounds``
rounds of back-to-back calls; a round's figure is its mean time per call, and the job reports the minimum (the
machine at its quietest) and the median over rounds. A wide gap between the two says the machine was busy.

``Rounds`` is the paired benchmarks': single calls of several named functions, timed side by side round by round
(each inside a pytest-benchmark round), each name's figure the median of its calls; a ratio of two such medians
does not depend on when each side was timed. ``fastest_call`` is the roofs' (``roofs``): the best of a few calls.
``per_second`` turns an amount (bytes, flops) and seconds into the GB/s or GFLOP/s every report gives.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

#: At most this many calls per round (decode-sized calls take microseconds).
MAX_CALLS_PER_ROUND = 10_000


#: How many seconds of calls (as the sizing call measured them) go between two readings of the clock in a round.
CLOCK_EVERY_S = 2e-5


@dataclass(frozen=True)
class Timing:
    """Per-call milliseconds: the fastest round and the median round, over ``rounds`` rounds of ``calls``."""

    min_ms: float
    median_ms: float
    rounds: int
    calls: int


def time_rounds(fn: Callable[[], Any], budget_s: float, rounds: int, once_s: float | None = None) -> Timing:
    """Time ``fn``: ``rounds`` rounds of ``calls`` calls each, ``calls`` chosen so that all rounds together take
    about ``budget_s`` (at least one call per round, whatever the budget; a round that runs past twice its share
    ends early, its figure the mean of the calls it made). ``once_s``: the time of a call just
    made, to size the rounds by; when None, one untimed call measures it (and warms the caches)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if once_s is None:
        t0 = time.perf_counter()
        fn()
        once_s = time.perf_counter() - t0
    once = max(once_s, 1e-7)
    calls = int(min(MAX_CALLS_PER_ROUND, max(1, budget_s / rounds / once)))
    # A round stops once it has run twice its share of the budget: calls slower than the one that sized the
    # rounds (other processes took the cores meanwhile) would otherwise stretch it, and the job, many times over.
    # The clock is read about every 20 µs of calls (as sized), so that reading it costs them next to nothing.
    limit, step = 2 * budget_s / rounds, max(1, int(CLOCK_EVERY_S / once))
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        done = 0
        while done < calls:
            n = min(step, calls - done)
            for _ in range(n):
                fn()
            done += n
            if time.perf_counter() - t0 > limit:
                break
        per_call.append((time.perf_counter() - t0) / done)
    return Timing(min(per_call) * 1e3, statistics.median(per_call) * 1e3, rounds, calls)


def fastest_call(fn: Callable[[], Any], repeats: int = 3) -> float:
    """The seconds of the fastest of ``repeats`` calls of ``fn``, after one untimed call (the roofs' figure: a
    machine's peak is its best run)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def per_second(amount: float, seconds: float) -> float:
    """``amount`` (bytes or flops) per second, in units of 10^9: the GB/s or GFLOP/s of the reports."""
    return amount / seconds / 1e9


class Rounds:
    """Wall seconds of single calls, by name, recorded round by round (``seconds[name]``, one entry per round)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.seconds: dict[str, list[float]] = {name: [] for name in names}

    def rotated(self) -> list[str]:
        """The names in the order of the next round: each round starts one name later than the one before, so no
        call always follows the same other call."""
        names = list(self.seconds)
        shift = len(self.seconds[names[0]]) % len(names)
        return names[shift:] + names[:shift]

    def time(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Call ``fn(*args, **kwargs)`` once and record its seconds under ``name``."""
        start = time.perf_counter()
        fn(*args, **kwargs)
        self.seconds[name].append(time.perf_counter() - start)

    def run(self, calls: dict[str, Callable[..., Any]], arguments: Callable[[], tuple] | None = None) -> None:
        """One round: every call of ``calls`` (keyed by name) once, in ``rotated`` order. ``arguments``: called
        before each call, outside its time, for the arguments to pass it (the next cold buffers, say)."""
        for name in self.rotated():
            self.time(name, calls[name], *(arguments() if arguments else ()))

    def medians(self, skip: int = 0) -> dict[str, float]:
        """Each name's median seconds over its rounds past the first ``skip`` (warm-up rounds)."""
        return {name: statistics.median(seconds[skip:]) for name, seconds in self.seconds.items()}

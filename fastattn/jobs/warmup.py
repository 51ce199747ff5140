"""``python -m fastattn warmup``: compile every op's kernels ahead of time, on all cores.

The work is split into units, one per (op group, dtype): "rope float16", "attention decode bfloat16", ...
(``warmup_calls``). Numba compiles on the calling thread, so the units run in separate processes, as many at a
time as there are cores, each in a fresh process (spawned, one unit per process) that writes what it compiles to
Numba's on-disk cache, where every later process finds it. A unit whose kernels are cached already only loads
them. Progress goes to stderr, one line per finished unit, then the total time.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import multiprocessing
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from .._core import validate as _validate
from .progress import elapsed
from .warmup_calls import GROUPS, QUANTIZED, dtype_of

#: The dtypes warmed when ``--dtypes`` is not given (bfloat16 only with ml_dtypes installed): the float dtypes
#: and llama.cpp's usual quantized KV cache, Q8_0 (Q4_0 on request).
DEFAULT_DTYPES = ("float32", "float16") + (("bfloat16",) if importlib.util.find_spec("ml_dtypes") else ()) + ("q8_0",)
#: Unit groups with nothing to compile for a quantized type (the norms take no quantized input).
_FLOAT_ONLY = ("norm",)


@dataclass(frozen=True)
class Unit:
    """One process's work: the warm-up calls of ``group`` with arrays of ``dtype``."""

    group: str
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.group} {self.dtype}"


@dataclass(frozen=True)
class Done:
    unit: Unit
    seconds: float
    calls: int
    skipped: int
    compiled: int  # top-level kernels compiled (the rest were loaded from the cache)


def units(ops: list[str] | None = None, dtypes: list[str] | None = None) -> list[Unit]:
    """The units for op groups ``ops`` (the main job's names: norm, set_rows, rope, attention, quant; all when None)
    and ``dtypes`` (names; ``DEFAULT_DTYPES`` when None), the slowest groups first."""
    unknown = sorted(set(ops or ()) - set(GROUPS))
    if unknown:
        raise ValueError(f"ops: unknown {unknown}; expected some of {list(GROUPS)}")
    names = list(dtypes) if dtypes is not None else list(DEFAULT_DTYPES)
    if not names:
        raise ValueError("dtypes: expected at least one of float32, float16, bfloat16, q8_0, q4_0")
    for name in names:
        dtype_of(name)  # ValueError for an unknown or unavailable dtype
    wanted = [op for op in GROUPS if ops is None or op in ops]
    groups = dict.fromkeys(group for op in wanted for group in GROUPS[op])  # op groups may share a unit group
    return [Unit(group, name) for group in groups for name in dict.fromkeys(names)
            if not (name in QUANTIZED and group in _FLOAT_ONLY)]


def run_unit(unit: Unit, thread_counts: list[int]) -> Done:
    """Run one unit in this process (the pool's worker entry point). Compile notices are counted, not shown:
    the parent process prints the progress."""
    from .._core import notices as _notices
    from .progress import CompileWatch
    from .warmup_calls import warm

    _notices.LOGGER.propagate = False  # this process only shows the parent's progress
    start = time.perf_counter()
    with CompileWatch() as watch:
        calls, skipped = warm(unit.group, unit.dtype, thread_counts)
    return Done(unit, time.perf_counter() - start, calls, skipped, watch.started)


def run(todo: list[Unit], thread_counts: list[int], workers: int, stream: TextIO | None = None
        ) -> list[Done | None]:
    """Run ``todo`` on ``workers`` processes (spawned, one unit each), printing a progress bar to ``stream``
    (stderr by default) as units finish, and the total at the end. Returns what each unit did, in order (None
    for a unit that failed; its error is printed)."""
    stream = stream if stream is not None else sys.stderr
    workers = _validate.integer("workers", workers, minimum=1)
    start = time.perf_counter()
    width = len(str(len(todo)))
    stream.write(f"warming {len(todo)} unit(s) on {min(workers, len(todo))} process(es), threads "
                 f"{','.join(map(str, thread_counts))}: compiling what Numba's cache does not hold yet\n")
    stream.flush()
    options = {"max_workers": workers, "mp_context": multiprocessing.get_context("spawn")}
    if sys.version_info >= (3, 11):
        options["max_tasks_per_child"] = 1  # a fresh process per unit
    done: dict[Unit, Done | None] = {}
    with concurrent.futures.ProcessPoolExecutor(**options) as pool:
        futures = {pool.submit(run_unit, unit, thread_counts): unit for unit in todo}
        for future in concurrent.futures.as_completed(futures):
            unit = futures[future]
            head = f"[{len(done) + 1:>{width}}/{len(todo)}] {_bar(len(done) + 1, len(todo))} {unit.label:<26}"
            try:
                result = done[unit] = future.result()
            except Exception as error:  # noqa: BLE001 - report the unit and go on with the others
                done[unit] = None
                stream.write(f"{head} FAILED: {type(error).__name__}: {error}\n")
            else:
                stream.write(f"{head} {elapsed(result.seconds):>7}  ({result.compiled} kernel(s) compiled)\n")
            stream.flush()
    total = time.perf_counter() - start
    finished = [d for d in done.values() if d is not None]
    compiled = sum(d.compiled for d in finished)
    failed = len(todo) - len(finished)
    stream.write(f"warm-up done in {elapsed(total)}: {compiled} kernel(s) compiled"
                 + (f", {failed} unit(s) FAILED\n" if failed else "; first calls now load them from Numba's cache\n"))
    stream.flush()
    return [done[unit] for unit in todo]


def _bar(k: int, n: int, width: int = 20) -> str:
    filled = round(width * k / n)
    return "[" + "#" * filled + "." * (width - filled) + "]"

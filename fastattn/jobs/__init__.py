"""The main job: run every op on a Llama-like layer, check fast against the reference, time both.

Each op module here (``norm``, ``set_rows``, ...) registers a function that builds its ``Case``s for a
``Config``; ``run`` executes them and ``format_table`` prints the result. ``python -m fastattn`` is the CLI.
"""
from __future__ import annotations

import importlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from .. import _threads

#: Op modules of this package that register cases (in table order).
OP_MODULES = ("norm", "rows", "rope", "attention")


@dataclass(frozen=True)
class Config:
    """A Llama-3-8B-like layer."""

    hidden: int = 4096
    n_head: int = 32
    n_head_kv: int = 8
    head_dim: int = 128
    n_prefill: int = 512
    eps: float = 1e-5
    rope_base: float = 500000.0
    seed: int = 0


@dataclass
class Case:
    """One row of the table: a fast call, the reference call, and how to compare them."""

    op: str
    shape: str
    path: str
    fast: Callable[[], Any]
    reference: Callable[[], Any]
    #: (fast result, reference result) -> (max abs error, within the SPEC's rule)
    check: Callable[[Any, Any], tuple[float, bool]]
    nbytes: float = 0.0  # bytes read + written, for GB/s
    flops: float = 0.0  # for GFLOP/s (when set, reported instead of GB/s)


@dataclass
class Result:
    op: str
    shape: str
    path: str
    threads: int
    max_error: float
    ok: bool
    reference_ms: float
    fast_ms: float
    first_call_ms: float
    speedup: float
    rate: float
    rate_unit: str
    extra: dict = field(default_factory=dict)


_BUILDERS: dict[str, Callable[[Config, np.random.Generator], list[Case]]] = {}


def register(op: str):
    """Decorator for ``builder(config, rng) -> list[Case]`` under the name ``op`` (the ``--ops`` filter)."""
    def wrap(builder):
        _BUILDERS[op] = builder
        return builder
    return wrap


def available_ops() -> list[str]:
    for name in OP_MODULES:
        importlib.import_module(f"{__name__}.{name}")
    return list(_BUILDERS)


def median_ms(fn: Callable[[], Any], budget_s: float, min_runs: int = 3, max_runs: int = 200) -> float:
    """Median wall time of ``fn`` in ms: at least ``min_runs`` runs, more while within ``budget_s``."""
    times = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(ops: Iterable[str] | None = None, threads: Iterable[int] = (None,), config: Config = Config(),
        budget_s: float = 0.5, progress: Callable[[str], None] | None = None) -> list[Result]:
    """Build, check and time every case of ``ops`` (all when None) at each thread count."""
    names = available_ops()
    wanted = names if ops is None else [o for o in names if o in set(ops)]
    unknown = set(ops or ()) - set(names)
    if unknown:
        raise ValueError(f"ops: unknown {sorted(unknown)}; expected some of {names}")
    results = []
    for n_threads in threads:
        with _threads.num_threads(n_threads or _threads.get_num_threads()) as n:
            for op in wanted:
                for case in _BUILDERS[op](config, np.random.default_rng(config.seed)):
                    if progress:
                        progress(f"{case.op} {case.shape} {case.path} ({n} threads)")
                    results.append(_run_case(case, n, budget_s))
    return results


def _run_case(case: Case, n_threads: int, budget_s: float) -> Result:
    t0 = time.perf_counter()
    fast_out = _snapshot(case.fast())  # a copy: in-place cases overwrite their result while being timed
    first_ms = (time.perf_counter() - t0) * 1e3
    # The fast path is timed before the reference runs: OpenBLAS's worker threads spin for a while after the
    # reference's matmuls and would steal the cores a parallel kernel launched right then needs.
    fast_ms = median_ms(case.fast, budget_s)
    error, ok = case.check(fast_out, case.reference())
    reference_ms = median_ms(case.reference, budget_s, min_runs=1)
    if case.flops:
        rate, unit = case.flops / fast_ms / 1e6, "GFLOP/s"
    else:
        rate, unit = case.nbytes / fast_ms / 1e6, "GB/s"
    return Result(case.op, case.shape, case.path, n_threads, error, ok, reference_ms, fast_ms, first_ms,
                  reference_ms / fast_ms, rate, unit)


def _snapshot(result):
    if isinstance(result, tuple):
        return tuple(_snapshot(r) for r in result)
    return result.copy() if isinstance(result, np.ndarray) else result


def format_table(results: list[Result]) -> str:
    header = ("op", "shape", "path", "thr", "max err", "ok", "ref ms", "fast ms", "speed-up", "rate", "1st call ms")
    rows = [header] + [
        (r.op, r.shape, r.path, str(r.threads), f"{r.max_error:.2e}", "yes" if r.ok else "NO",
         f"{r.reference_ms:.3f}", f"{r.fast_ms:.4f}", f"{r.speedup:.1f}x", f"{r.rate:.1f} {r.rate_unit}",
         f"{r.first_call_ms:.0f}")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def as_dicts(results: list[Result]) -> list[dict]:
    return [asdict(r) for r in results]


def compare_arrays(tolerance: Callable[[np.ndarray], float]):
    """A ``Case.check`` comparing array results elementwise: max |fast - ref| <= ``tolerance(ref)``."""
    def check(fast, reference):
        fast64 = np.asarray(fast, np.float64)
        ref64 = np.asarray(reference, np.float64)
        error = float(np.max(np.abs(fast64 - ref64))) if ref64.size else 0.0
        return error, bool(error <= tolerance(ref64))
    return check


def progress_printer(stream=sys.stderr):
    """A one-line progress indicator for terminals (plain lines otherwise)."""
    count = [0]

    def show(message: str) -> None:
        count[0] += 1
        if stream.isatty():
            stream.write(f"\r\033[K[{count[0]}] {message}")
        else:
            stream.write(f"[{count[0]}] {message}\n")
        stream.flush()
    return show

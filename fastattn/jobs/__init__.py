"""The main job: run every op on a Llama-like layer, check fast against the reference, time both.

Each op module here (``norm``, ``rows``, ...) registers a function that builds its ``Case``s for a ``Config``;
``run`` executes them and ``report`` turns the results into the table, its legend, the summary line and the
warnings. Together the cases call every public op, store into every storage dtype and rotate in every RoPE mode
(``coverage`` says what a list of cases leaves out; ``python -m fastattn --list`` prints them). ``python -m
fastattn`` is the CLI. ``Config`` is also where the benchmarks (bench/) take their shapes from, so each shape is
defined once.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from .._core import threads as _threads
from .checks import Check
from .progress import CompileWatch, Progress
from .timing import Timing, per_second, time_rounds

#: The reference's timing budget as a share of the fast path's: its figure serves only as the speed-up's
#: denominator, so half the calls read it well enough and save seconds of the job.
REFERENCE_SHARE = 0.5

#: Op modules of this package that register cases (in table order).
OP_MODULES = ("norm", "rows", "rope", "attention", "quant")

#: The storage dtypes the cases cover, by the names ``Case.dtype`` uses (``--dtypes``' names).
DTYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0")


@dataclass(frozen=True)
class Config:
    """A Llama-3-8B-like layer, and the KV cache the decode cases read."""

    hidden: int = 4096
    n_head: int = 32
    n_head_kv: int = 8
    head_dim: int = 128
    n_prefill: int = 512
    eps: float = 1e-5
    rope_base: float = 500000.0
    kv_cache_rows: int = 4096  # rows of the KV cache set_rows writes into
    decode_n_kv: int = 512  # KV rows a decode step reads: ggml's (and ``auto``'s) smallest split-KV context
    seed: int = 0


#: The layer every case and benchmark is shaped after.
LAYER = Config()


@dataclass
class Case:
    """One row of the table: a fast call, the reference call, and how to compare them."""

    op: str
    shape: str
    path: str
    fast: Callable[[], Any]
    reference: Callable[[], Any]
    check: Check
    nbytes: float = 0.0  # bytes read + written, for GB/s
    flops: float = 0.0  # for GFLOP/s (when set, reported instead of GB/s)
    op_group: str = ""  # set by ``build``: the registered op group and the case's place in its list
    index: int = 0
    #: The storage dtype the case exercises (a ``DTYPES`` name): the activations' for the norms and ``rope_ext``,
    #: the cache's for the row writes, K/V's for attention, the block type for quantize / dequantize.
    dtype: str = ""
    mode: str = ""  # the RoPE mode's name (``fastattn.RopeMode``) for RoPE cases
    #: Why the case cannot run here (e.g. bfloat16 without ml_dtypes): reported as skipped, never as a failure;
    #: ``fast``, ``reference`` and ``check`` are then not called.
    skip: str = ""

    @property
    def label(self) -> str:
        return f"{self.op} {self.shape}, {self.path}"


def skipped_case(op: str, shape: str, path: str, reason: str, **fields) -> Case:
    """A case that cannot run here, for ``reason``."""
    def unavailable():
        raise RuntimeError(f"{op} {shape}, {path} is skipped: {reason}")
    return Case(op, shape, path, fast=unavailable, reference=unavailable, check=None, skip=reason, **fields)


def bfloat16_dtype():
    """``ml_dtypes.bfloat16`` as a NumPy dtype, or None when ml_dtypes is not installed (it is an optional
    dependency: the bfloat16 cases are then skipped)."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


#: Why a bfloat16 case is skipped without ml_dtypes.
NO_BFLOAT16 = "bfloat16 needs ml_dtypes (python -m pip install ml_dtypes)"


@dataclass
class Result:
    op: str
    shape: str
    path: str
    threads: int
    max_error: float
    bound: float | None  # the absolute error allowed (None: ulps or bit equality, see tolerance)
    ok: bool | None  # None: the case was skipped
    tolerance: str  # what ok was checked against, in words
    reference_ms: float  # median of the rounds
    fast_ms: float  # median of the rounds
    first_call_ms: float
    speedup: float  # reference_ms / fast_ms
    rate: float
    rate_unit: str
    reference_min_ms: float = 0.0
    fast_min_ms: float = 0.0
    rounds: int = 0
    compiled: bool = False  # the first call compiled kernels (rather than loading them from Numba's cache)
    compile_s: float = 0.0  # seconds the first call spent compiling
    extra: dict = field(default_factory=dict)
    dtype: str = ""
    mode: str = ""
    skipped: str = ""  # why the case did not run (then ``ok`` is None and the figures are 0)


def agreed(results: list[Result]) -> bool:
    """Every case that ran agrees with the reference (skipped cases neither agree nor fail)."""
    return all(r.ok for r in results if not r.skipped)


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


def public_ops() -> list[str]:
    """The ops of ``fastattn.__all__``: its functions but the thread settings."""
    import fastattn
    from .._core import threads

    return [name for name in fastattn.__all__ if name.islower() and not hasattr(threads, name)]


def coverage(cases: list[Case]) -> dict[str, list[str]]:
    """What ``cases`` leave out, by kind: public ops no case calls, storage dtypes (``DTYPES``) and RoPE modes no
    case exercises. Skipped cases count: they are in the job, and run where their dependency is installed."""
    from ..rope.modes import RopeMode

    return {"ops": [o for o in public_ops() if o not in {c.op for c in cases}],
            "dtypes": [d for d in DTYPES if d not in {c.dtype for c in cases}],
            "modes": [m.name for m in RopeMode if m.name not in {c.mode for c in cases}]}


def select_ops(ops: Iterable[str] | None) -> list[str]:
    """The op groups to run, in table order; ``ValueError`` naming the unknown ones."""
    names = available_ops()
    if ops is None:
        return names
    ops = list(ops)
    unknown = sorted(set(ops) - set(names))
    if unknown:
        raise ValueError(f"ops: unknown {unknown}; expected some of {names}")
    return [o for o in names if o in set(ops)]


def build(ops: list[str], config: Config = LAYER) -> list[Case]:
    """Every case of ``ops``, with fresh inputs (the same for the same config), each marked with its op group
    and its place in the group's list."""
    cases = []
    for op in ops:
        for index, case in enumerate(_BUILDERS[op](config, np.random.default_rng(config.seed))):
            case.op_group, case.index = op, index
            cases.append(case)
    return cases


def run(ops: Iterable[str] | None = None, threads: Iterable[int | None] = (None,), config: Config = LAYER,
        budget_s: float = 0.5, rounds: int = 5, progress: Progress | None = None) -> list[Result]:
    """Build, check and time every case of ``ops`` (all when None) at each thread count (None: the current one).

    ``budget_s``: seconds of timing per fast figure, split into ``rounds`` rounds; the reference's figure gets
    ``REFERENCE_SHARE`` of it. The reference is run and timed once per case, at the first thread count (it does
    not use fastattn's threads).
    """
    wanted = select_ops(ops)
    counts = [n or _threads.get_num_threads() for n in threads]
    results: list[Result] = []
    references: dict[tuple[str, str, str], tuple[Any, Timing]] = {}
    with CompileWatch(progress) as watch:
        if progress:
            progress.preparing(f"preparing the cases of {', '.join(wanted)}")
        first = build(wanted, config)
        total, k = len(first) * len(counts), 0
        for i, n_threads in enumerate(counts):
            cases = first if i == 0 else build(wanted, config)  # fresh inputs: some cases work in place
            # each figure is labelled with its thread count: the prange kernels run on that many (fixed rule)
            with _threads.num_threads(n_threads) as n, _threads.thread_rule("fixed"):
                for case in cases:
                    k += 1
                    if progress:
                        progress.case(k, total, f"{case.label}, {n} thread{'' if n == 1 else 's'}"
                                      + (f": skipped, {case.skip}" if case.skip else ""))
                    if case.skip:
                        results.append(_skipped(case, n))
                        continue
                    results.append(_run_case(case, n, budget_s, rounds, watch, references))
            first = cases = []  # let the inputs go before the next thread count builds its own
    if progress:
        progress.finish()
    return results


def _skipped(case: Case, n_threads: int) -> Result:
    return Result(case.op, case.shape, case.path, n_threads, 0.0, None, None, "", 0.0, 0.0, 0.0, 0.0, 0.0, "",
                  dtype=case.dtype, mode=case.mode, skipped=case.skip)


def _run_case(case: Case, n_threads: int, budget_s: float, rounds: int, watch: CompileWatch,
              references: dict) -> Result:
    compiles, compile_s = watch.started, watch.seconds
    t0 = time.perf_counter()
    fast_out = _snapshot(case.fast())  # a copy: in-place cases overwrite their result while being timed
    first_ms = (time.perf_counter() - t0) * 1e3
    compiled, compile_s = watch.started > compiles, watch.seconds - compile_s
    # The fast path is timed before the reference runs: OpenBLAS's worker threads spin for a while after the
    # reference's matmuls and would steal the cores a parallel kernel launched right then needs.
    fast = time_rounds(case.fast, budget_s, rounds)
    key = (case.op, case.shape, case.path)
    if key not in references:
        t0 = time.perf_counter()
        reference_out = _snapshot(case.reference())
        once = time.perf_counter() - t0
        budget = budget_s * REFERENCE_SHARE
        # a reference slower than its whole budget (float64 attention prefill) gets 3 rounds of one call
        ref_rounds = rounds if once <= budget else min(rounds, 3)
        references[key] = (reference_out, time_rounds(case.reference, budget, ref_rounds, once_s=once))
    reference_out, reference = references[key]
    verdict = case.check(fast_out, reference_out)
    rate, unit = ((per_second(case.flops, fast.median_ms / 1e3), "GFLOP/s") if case.flops
                  else (per_second(case.nbytes, fast.median_ms / 1e3), "GB/s"))
    return Result(case.op, case.shape, case.path, n_threads, verdict.error, verdict.bound, verdict.ok,
                  case.check.tolerance, reference.median_ms, fast.median_ms, first_ms,
                  reference.median_ms / fast.median_ms, rate, unit, reference.min_ms, fast.min_ms, fast.rounds,
                  compiled, compile_s,
                  extra={"parallel": bool(case.flops) or case.nbytes >= _threads.PARALLEL_MIN_BYTES},
                  dtype=case.dtype, mode=case.mode)


def _snapshot(result):
    if isinstance(result, tuple):
        return tuple(_snapshot(r) for r in result)
    return result.copy() if isinstance(result, np.ndarray) else result


def format_table(results: list[Result]) -> str:
    """The results as an aligned plain-text table (see ``report.LEGEND`` for the columns)."""
    from .report import table
    return table(results)


def as_dicts(results: list[Result]) -> list[dict]:
    return [asdict(r) for r in results]

"""What the main job prints and writes (the table, its legend, the summary line, warnings, the JSON report), and
the table writers and time format the benchmarks' reports (bench/report.py, bench/compile_times.py) share with it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from typing import Iterable, Sequence

from .._core import threads as _threads
from . import DTYPES, REFERENCE_SHARE, Case, Result, coverage

#: 2 threads are reported as slower than 1 when their median exceeds 1 thread's by more than this factor.
SLOWER_FACTOR = 1.10
#: A figure is reported as noisy when its median round exceeds its fastest round by more than this factor.
NOISY_FACTOR = 1.5

LEGEND = """\
ok        the fast result against the float64 NumPy reference (fastattn.reference), by the rule of
          fastattn.testing: float32 results within 2x the error of a plain float32 NumPy evaluation of the
          same formula plus a small floor; float16 results within 1 ulp of the correctly rounded value;
          set_rows, quantize and dequantize bit-exact (each case's tolerance: "tolerances" in the --json
          report). "max err" is max |fast - reference|. "skipped": the case cannot run here (the reason is
          given: bfloat16 needs the optional ml_dtypes); it counts neither way.
ms        time per call, "min / median" over the rounds (each round: back-to-back calls).
speed-up  reference median / fast median. The reference is plain float64 NumPy, the definition the results
          are checked against, not a tuned competitor; below 1x the fast path is slower than it.
rate      the fast median as GB/s (bytes read + written) or GFLOP/s (attention prefill). The timing repeats
          each call on the same buffers, so a working set that fits the CPU's caches is read from there: its
          GB/s can exceed the DRAM bandwidth (bench measures both roofs, --plot compares each op with its own).
1st call  the case's first fast call in a fresh process: it compiles the kernels the case needs ("compiled";
          they are then cached on disk) or loads them from Numba's cache, and picks the path."""


def aligned(rows: Sequence[Sequence[str]], widths: Sequence[int] | None = None) -> list[str]:
    """Rows of cells as plain-text lines, the first row the header, followed by a rule of dashes; each column
    padded to ``widths`` (default: its widest cell), two spaces apart, trailing spaces dropped."""
    if widths is None:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def markdown_row(cells: Iterable[str]) -> str:
    """One row of a markdown table (an empty cell reads ``|  |``)."""
    return "| " + " | ".join(cells) + " |"


def markdown(header: Sequence[str], rows: Iterable[Iterable[str]] = ()) -> str:
    """A markdown table: the header row, its rule and one line per row (none: the header and rule alone)."""
    return "\n".join([markdown_row(header), "|" + " --- |" * len(header)] + [markdown_row(row) for row in rows])


def duration(seconds: float | None) -> str:
    """A time for the benchmarks' tables, with its unit and 3-4 significant digits: ``2.07 µs``, ``358.6 µs``,
    ``1.095 ms``, ``11.74 ms``, ``265.9 ms``; ``—`` for a figure that is missing (None)."""
    if seconds is None:
        return "—"
    if seconds < 1e-5:
        return f"{seconds * 1e6:.2f} µs"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    ms = seconds * 1e3
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:.2f} ms" if ms < 100 else f"{ms:.1f} ms"


def _ms(value: float) -> str:
    return f"{value:.4f}" if value < 1 else f"{value:.3f}" if value < 100 else f"{value:.1f}"


def _first_call(r: Result) -> str:
    text = f"{r.first_call_ms / 1e3:.2f} s" if r.first_call_ms >= 1000 else f"{r.first_call_ms:.1f} ms"
    return text + (", compiled" if r.compiled else "")


def table(results: list[Result]) -> str:
    """The results as an aligned plain-text table."""
    header = ("op", "shape", "path", "thr", "max err", "ok", "ref ms min / med", "fast ms min / med",
              "speed-up", "rate", "1st call")
    rows = [header] + [
        (r.op, r.shape, r.path, str(r.threads), "", "skipped", r.skipped, "", "", "", "") if r.skipped else
        (r.op, r.shape, r.path, str(r.threads), f"{r.max_error:.2e}", "yes" if r.ok else "NO",
         f"{_ms(r.reference_min_ms)} / {_ms(r.reference_ms)}", f"{_ms(r.fast_min_ms)} / {_ms(r.fast_ms)}",
         f"{r.speedup:.1f}x", f"{r.rate:.1f} {r.rate_unit}", _first_call(r))
        for r in results
    ]
    # a skipped row's reason runs on past its column rather than widening it
    widths = [max(len(row[i]) for row, r in zip(rows, [None] + results) if not (r and r.skipped and i == 6))
              for i in range(len(header))]
    return "\n".join(aligned(rows, widths))


def case_list(groups: list[str], cases: list[Case]) -> str:
    """``--list``: the op groups, then each case by op group, op, storage dtype, RoPE mode, shape and path, then
    what the cases cover (or leave out)."""
    from ..rope.modes import RopeMode

    header = ("group", "op", "dtype", "mode", "shape", "path")
    rows = [header] + [(c.op_group, c.op, c.dtype or "-", c.mode or "-", c.shape,
                        c.path + (f" (skipped here: {c.skip})" if c.skip else "")) for c in cases]
    lines = [f"op groups (--ops): {', '.join(groups)}", "", *aligned(rows)]
    missing = coverage(cases)
    ops = sorted({c.op for c in cases})
    dtypes = ", ".join(d for d in DTYPES if d not in missing["dtypes"]) or "none"
    modes = ", ".join(m.name for m in RopeMode if m.name not in missing["modes"]) or "none"
    lines.append(f"\n{len(cases)} cases: {len(ops)} ops; dtypes {dtypes}; RoPE modes {modes}")
    left = [f"{kind} {', '.join(names)}" for kind, names in missing.items() if names]
    lines.append("not covered by these groups: " + "; ".join(left) if left else
                 "every public op, storage dtype and RoPE mode is covered")
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    """``12/12 agree with the reference``, naming the cases that do not, and the skipped ones with the reason."""
    ran = [r for r in results if not r.skipped]
    line = f"{sum(r.ok for r in ran)}/{len(ran)} agree with the reference"
    failed = [f"{r.op} {r.shape} {r.path} ({r.threads} thr)" for r in ran if not r.ok]
    if failed:
        line += f"; outside the tolerance: {'; '.join(failed)}"
    skipped = [r for r in results if r.skipped]
    if skipped:
        reasons = "; ".join(dict.fromkeys(r.skipped for r in skipped))
        line += f"; {len(skipped)} skipped ({reasons})"
    return line


def warnings(results: list[Result], busy: list[str]) -> list[str]:
    """Busy-machine warnings (``busy``, from the load average), cases where more threads were slower, fast
    paths slower than the reference, and figures whose rounds disagree widely."""
    found = list(busy)
    results = [r for r in results if not r.skipped]
    by_case: dict[tuple, dict[int, Result]] = defaultdict(dict)
    for r in results:
        by_case[r.op, r.shape, r.path][r.threads] = r
    for (op, shape, path), runs in by_case.items():
        if len(runs) < 2 or 1 not in runs:
            continue
        one = runs[1]
        parallel = one.extra.get("parallel", True)
        for n, r in sorted(runs.items()):
            if n > 1 and parallel and r.fast_ms > SLOWER_FACTOR * one.fast_ms:
                found.append(f"{op} {shape} {path}: {n} threads took {_ms(r.fast_ms)} ms, 1 thread "
                             f"{_ms(one.fast_ms)} ms; more threads should not be slower: other processes "
                             f"probably hold the cores")
    slow = [f"{r.op} {r.shape} {r.path} ({r.threads} thr): {r.speedup:.2f}x" for r in results if r.speedup < 1]
    if slow:
        found.append("fast path slower than the float64 NumPy reference: " + "; ".join(slow)
                     + " (expected only on a busy machine: compare the min columns)")
    noisy = [f"{r.op} {r.shape} {r.path} ({r.threads} thr)" for r in results
             if r.fast_ms > NOISY_FACTOR * r.fast_min_ms]
    if noisy:
        found.append(f"noisy timings (median round > {NOISY_FACTOR}x the fastest): " + "; ".join(noisy))
    return found


def json_report(results: list[Result], *, machine: dict, budget_s: float, rounds: int, load: dict,
                warnings_found: list[str]) -> dict:
    """Everything the table shows, with versions, CPU, thread counts and the tolerances applied."""
    tolerances = {}
    ran = [r for r in results if not r.skipped]
    for r in ran:
        tolerances.setdefault(r.op, {})[f"{r.shape}, {r.path}"] = r.tolerance
    return {
        **machine,
        "budget_s": budget_s,
        "reference_budget_s": budget_s * REFERENCE_SHARE,
        "rounds": rounds,
        "parallel_min_bytes": _threads.PARALLEL_MIN_BYTES,
        "load_average": load,
        "tolerances": tolerances,
        "summary": {"cases": len(ran), "agree": sum(r.ok for r in ran), "skipped": len(results) - len(ran),
                    "line": summary(results)},
        "warnings": warnings_found,
        "results": [asdict(r) for r in results],
    }

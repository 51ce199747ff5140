"""The command line: ``python -m fastattn [check|bench|warmup] [options]`` (``--help`` for the details)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from ._core import threads as _threads

HELP = """\
Check every op of fastattn, in every storage dtype and RoPE mode, against its float64 NumPy reference on a
Llama-3-8B-like layer, and time both.

commands:
  check    (the default) compare each fast op with the reference and time both
  bench    the same, then measure the machine's roofs (copy and read bandwidth, float32 FMA peak)
  warmup   compile the kernels of every op ahead of time, in parallel processes on all cores

examples:
  python -m fastattn
  python -m fastattn --list                       the cases (op, dtype, RoPE mode), without running them
  python -m fastattn --threads 1,2 --ops norm,rope
  python -m fastattn --json - > report.json       only JSON on stdout; the table goes to stderr
  python -m fastattn bench --plot roofs.png
  python -m fastattn warmup --dtypes float32,float16

The first call of each op compiles its kernels (seconds each; cached on disk afterwards); the progress on
stderr says when. A case that cannot run here (bfloat16 without ml_dtypes) is reported as skipped, with the
reason. Exit status: 0 when every case that ran agrees with the reference, 1 when one does not (or a warm-up
unit failed), 2 for bad arguments.
"""


def _thread_list(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1 or max(counts) > _threads.max_threads():
        raise argparse.ArgumentTypeError(f"thread counts must be between 1 and {_threads.max_threads()}")
    return counts


def _names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastattn", description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=("check", "bench", "warmup"), default="check",
                   help="what to do (default: check)")
    p.add_argument("--ops", type=_names, default=None,
                   help="comma-separated op groups (default: all; --list shows them)")
    p.add_argument("--threads", type=_thread_list, default=None,
                   help="thread counts, e.g. 1,2. check/bench: run at each (default: all of Numba's threads); "
                        "warmup: warm at each (default: 1 and all)")
    p.add_argument("--list", action="store_true",
                   help="list the op groups and their cases (op, storage dtype, RoPE mode) without running them")
    p.add_argument("--jobs", type=_positive(int), default=None,
                   help="warmup: processes compiling at a time (default: the number of cores)")
    check = p.add_argument_group("check and bench")
    check.add_argument("--json", metavar="FILE", default=None,
                       help="also write the results as JSON to FILE; '-' writes only JSON to stdout and the "
                            "table to stderr")
    check.add_argument("--budget", type=_positive(float), default=0.5,
                       help="seconds of timing per fast figure, over all its rounds; the reference's gets half "
                            "(default 0.5)")
    check.add_argument("--rounds", type=_positive(int), default=5,
                       help="timing rounds per figure, reported as min and median (default 5)")
    check.add_argument("--plot", metavar="FILE.png", default=None, help="bench: draw the rates against the roofs")
    warm = p.add_argument_group("warmup")
    warm.add_argument("--dtypes", type=_names, default=None,
                      help="comma-separated K/V and activation dtypes to compile for: float32, float16, "
                           "bfloat16, q8_0, q4_0 (default: all but q4_0; bfloat16 with ml_dtypes)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        return _list(p, args)
    if args.command == "warmup":
        for name in ("json", "plot"):
            if getattr(args, name) is not None:
                p.error(f"--{name} belongs to the check and bench commands")
        return _warmup(p, args)
    for name in ("dtypes",):
        if getattr(args, name) is not None:
            p.error(f"--{name} belongs to the warmup command: python -m fastattn warmup --{name} ...")
    if args.plot and args.command != "bench":
        p.error("--plot belongs to the bench command: python -m fastattn bench --plot FILE.png")
    return _check(p, args)


def _list(p: argparse.ArgumentParser, args) -> int:
    """The op groups and the cases of those selected, without running them: building a case makes its inputs
    and its float32 baseline with NumPy, and compiles nothing."""
    from . import jobs
    from .jobs import report

    try:
        groups = jobs.select_ops(args.ops)
    except ValueError as error:
        p.error(str(error))
    print(report.case_list(jobs.available_ops(), jobs.build(groups)))
    return 0


def _warmup(p: argparse.ArgumentParser, args) -> int:
    from .jobs import machine, warmup

    try:
        todo = warmup.units(args.ops, args.dtypes)
    except ValueError as error:
        p.error(str(error))
    counts = args.threads or sorted({1, _threads.max_threads()})
    done = warmup.run(todo, counts, args.jobs or machine.cores())
    return 0 if all(d is not None for d in done) else 1


def _check(p: argparse.ArgumentParser, args) -> int:
    import threadpoolctl

    from . import jobs
    from .jobs import machine, report
    from .jobs.progress import Progress

    out: TextIO = sys.stderr if args.json == "-" else sys.stdout  # with --json -, stdout carries only JSON
    try:
        ops = jobs.select_ops(args.ops)
    except ValueError as error:
        p.error(str(error))
    # The references' idle OpenBLAS workers would otherwise spin on the cores our prange workers need.
    threadpoolctl.threadpool_limits(1, user_api="blas")
    thread_counts = args.threads or [_threads.get_num_threads()]
    cores = machine.cores()
    load_start = machine.load_average()
    busy = machine.busy_warning(load_start, cores)
    if busy:
        print(f"warning: {busy}", file=sys.stderr)
    results = jobs.run(ops, threads=thread_counts, budget_s=args.budget, rounds=args.rounds,
                       progress=Progress(sys.stderr))
    load_end = machine.load_average()
    loads = [x for x in (load_start, load_end) if x is not None]
    busy = machine.busy_warning(max(loads) if loads else None, cores)
    found = report.warnings(results, [busy] if busy else [])

    print(report.table(results), file=out)
    print(f"\n{report.LEGEND}\n(times: {args.rounds} rounds per figure, about {args.budget:g} s of calls in all "
          f"(the reference: {args.budget * jobs.REFERENCE_SHARE:g} s); "
          f"threads: {', '.join(map(str, thread_counts))}; cores: {cores})", file=out)
    description = machine.describe(thread_counts)
    roofs = _roofs(args, results, thread_counts, out) if args.command == "bench" else None
    print(f"\n{report.summary(results)}", file=out)
    for warning in found:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        data = report.json_report(results, machine=description, budget_s=args.budget, rounds=args.rounds,
                                  load={"start": load_start, "end": load_end, "cores": cores},
                                  warnings_found=found)
        if roofs is not None:
            data["roofs"] = roofs
        text = json.dumps(data, indent=2)
        if args.json == "-":
            sys.stdout.write(text + "\n")
        else:
            with open(args.json, "w") as fh:
                fh.write(text + "\n")
    return 0 if jobs.agreed(results) else 1


def _roofs(args, results, thread_counts: list[int], out: TextIO) -> list[dict]:
    from dataclasses import asdict

    from .jobs import roofs as roof_meter

    from .jobs.plot import working_set

    roofs = {}
    for n in thread_counts:
        # copies of the working sets of the ops that ran on threads: the roofs of those that stay in cache
        sizes = [working_set(r) for r in results
                 if r.threads == n and not r.skipped and r.extra.get("parallel", True)]
        roofs[n] = roof_meter.measure(n, [s for s in sizes if s])
        print(f"roofs, {n} thread(s): copy {roofs[n].copy_gbs:.1f} GB/s (DRAM), "
              f"{roofs[n].cache_copy_gbs:.1f} GB/s (in cache; 1 thread {roofs[n].serial_copy_gbs:.1f}), "
              f"read {roofs[n].read_gbs:.1f} GB/s (DRAM), "
              f"FMA {roofs[n].fma_gflops:.0f} GFLOP/s", file=out)
        if roofs[n].copy_at:
            print("  copies by working set: " + ", ".join(f"{size >> 20} MiB {gbs:.1f} GB/s"
                                                          for size, gbs in sorted(roofs[n].copy_at.items())), file=out)
    print(roof_meter.NOTE, file=out)
    if args.plot:
        from .jobs.plot import plot
        plot(results, roofs, args.plot)  # each op against its roof: DRAM, in-cache copy or FMA (roof_for)
        print(f"plot written to {args.plot}", file=out)
    return [asdict(r) for r in roofs.values()]


if __name__ == "__main__":
    sys.exit(main())

"""``python -m fastattn``: check and time every op on a default Llama-like layer.

    python -m fastattn [check] [--threads 1,2] [--ops rms_norm,set_rows] [--json FILE|-] [--budget SECONDS]
    python -m fastattn bench [--plot FILE.png] [same options]   # also measures the roofs and compares
"""
from __future__ import annotations

import argparse
import json
import sys

from . import _threads, jobs
from .jobs.blas import set_blas_threads


def _thread_list(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1 or max(counts) > _threads.max_threads():
        raise argparse.ArgumentTypeError(f"thread counts must be between 1 and {_threads.max_threads()}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastattn", description=__doc__.strip().splitlines()[0])
    parser.add_argument("command", nargs="?", choices=("check", "bench"), default="check",
                        help="check (default): fast vs reference and times; bench: also the roofs")
    parser.add_argument("--threads", type=_thread_list, default=None,
                        help="thread counts to run at, e.g. 1,2 (default: all of Numba's threads)")
    parser.add_argument("--ops", default=None, help="comma-separated op groups (default: all; see --list)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON ('-': stdout)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per measurement")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="bench: draw rates against the roofs")
    parser.add_argument("--list", action="store_true", help="list the op groups and exit")
    args = parser.parse_args(argv)

    if args.list:
        print("\n".join(jobs.available_ops()))
        return 0
    if args.plot and args.command != "bench":
        parser.error("--plot belongs to the bench command: python -m fastattn bench --plot FILE.png")
    ops = args.ops.split(",") if args.ops else None
    set_blas_threads(1)  # the references' idle OpenBLAS workers would steal our prange workers' cores
    thread_counts = args.threads or [_threads.get_num_threads()]
    try:
        results = jobs.run(ops, threads=thread_counts, budget_s=args.budget, progress=jobs.progress_printer())
    except ValueError as error:
        parser.error(str(error))
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
    print(jobs.format_table(results))
    report = {"results": jobs.as_dicts(results)}
    if args.command == "bench":
        from dataclasses import asdict

        from .jobs import roofs as roof_meter
        roofs = {}
        for n in thread_counts:
            roofs[n] = roof_meter.measure(n)
            print(f"roofs, {n} thread(s): copy {roofs[n].copy_gbs:.1f} GB/s, read {roofs[n].read_gbs:.1f} GB/s, "
                  f"FMA {roofs[n].fma_gflops:.0f} GFLOP/s")
        report["roofs"] = [asdict(r) for r in roofs.values()]
        if args.plot:
            from .jobs.plot import plot
            plot(results, roofs, args.plot)
            print(f"plot written to {args.plot}")
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as fh:
                fh.write(text + "\n")
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"\n{len(failed)} check(s) outside the SPEC's tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

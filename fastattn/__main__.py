"""``python -m fastattn``: check and time every op on a default Llama-like layer.

    python -m fastattn [--threads 1,2] [--ops rms_norm_mul,set_rows] [--json FILE|-] [--budget SECONDS]
"""
from __future__ import annotations

import argparse
import json
import sys

from . import jobs


def _thread_list(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("thread counts must be >= 1")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastattn", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--threads", type=_thread_list, default=None,
                        help="thread counts to run at, e.g. 1,2 (default: all of Numba's threads)")
    parser.add_argument("--ops", default=None, help="comma-separated op groups (default: all)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON ('-': stdout)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per measurement")
    parser.add_argument("--list", action="store_true", help="list the op groups and exit")
    args = parser.parse_args(argv)

    if args.list:
        print("\n".join(jobs.available_ops()))
        return 0
    ops = args.ops.split(",") if args.ops else None
    try:
        results = jobs.run(ops, threads=args.threads or (None,), budget_s=args.budget,
                           progress=jobs.progress_printer())
    except ValueError as error:
        parser.error(str(error))
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
    print(jobs.format_table(results))
    if args.json:
        text = json.dumps(jobs.as_dicts(results), indent=2)
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

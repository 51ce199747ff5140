"""Turn a pytest-benchmark JSON file into the markdown table of docs/benchmarks.md.

    python -m pytest bench --benchmark-group-by=group --benchmark-json=bench.json
    python bench/report.py bench.json > table.md
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def rows(data: dict) -> dict[str, list[tuple[str, int, float, str]]]:
    groups: dict[str, list[tuple[str, int, float, str]]] = defaultdict(list)
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        label = bench["name"].removeprefix("test_")
        rate = next((f"{info[key]:.1f} {key}" for key in ("GB/s", "GFLOP/s") if key in info), "")
        if "qkv/contiguous" in info:  # the paired in-place RoPE benchmark: its ratio is the figure
            rate = (f"QKV view {info['qkv_us']:.0f} µs / contiguous {info['contiguous_us']:.0f} µs = "
                    f"{info['qkv/contiguous']:.2f}")
        if "copy/rope_ext" in info:  # the paired out-of-place RoPE benchmark: fractions of the copy's bandwidth
            rate = (f"copy {info['copy_us']:.0f} µs; rope_ext {info['rope_ext_us']:.0f} µs = "
                    f"{info['copy/rope_ext']:.0%}, apply_rope_cache {info['apply_rope_cache_us']:.0f} µs = "
                    f"{info['copy/apply_rope_cache']:.0%} of its bandwidth")
        if "dram/auto" in info:  # the paired float32 decode benchmark: fractions of the DRAM probe's bandwidth
            rate = (f"DRAM read {info['dram_us']:.0f} µs; " + ", ".join(
                f"{path} {info[path + '_us']:.0f} µs = {info['dram/' + path]:.0%}"
                for path in ("auto", "split_kv", "one_chunk")) + " of its bandwidth")
        groups[bench["group"] or ""].append((label, info.get("threads", 0), bench["stats"]["median"], rate))
    return groups


def table(data: dict) -> str:
    lines = ["| group | case | threads | median | rate |", "| --- | --- | --- | --- | --- |"]
    for group, entries in rows(data).items():
        for label, threads, median, rate in sorted(entries, key=lambda e: (e[1], e[2])):
            time = f"{median * 1e3:.3f} ms" if median >= 1e-3 else f"{median * 1e6:.2f} µs"
            lines.append(f"| {group} | {label} | {threads} | {time} | {rate} |")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        print(table(json.load(fh)))

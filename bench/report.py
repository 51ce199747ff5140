"""Turn a pytest-benchmark JSON file into the table of docs/benchmarks.md.

    python -m pytest bench --benchmark-group-by=group --benchmark-json=bench.json
    python bench/report.py bench.json > table.md          # the table of docs/benchmarks.md
    python bench/report.py --all bench.json > cases.md    # every case: group, case, threads, median, rate

The table has one row per target (``ROWS``) and thread count: the fast op's median time, the reference's, torch's
and one more baseline where the benchmark has one (a copy of the same bytes, the DRAM read probe, the unfused
calls, ...), the ratio the target is about, the target and whether it is met. Targets are checked on the rows at
the highest thread count in the file. A figure the file lacks (torch not installed, a case not run) reads "—"; an
empty cell means the case has no such baseline. Times and tables are written by the main job's report module
(``fastattn.jobs.report``: ``duration``, ``markdown``).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass

from fastattn.jobs.report import duration, markdown


@dataclass(frozen=True)
class Pick:
    """A time from the JSON: the median of benchmark ``name`` (without ``test_``; ``{t}`` is the thread count), or
    its ``extra_info[key]`` when ``key`` is given (keys end in ``_us`` or ``_ms``; a key ending in ``_MB`` is a size
    in megabytes instead)."""
    name: str
    key: str | None = None


@dataclass(frozen=True)
class Row:
    op: str
    shape: str
    fast: Pick
    reference: Pick | None = None
    torch: Pick | None = None
    other: tuple[str, Pick] | None = None
    #: how the ratio is formed from the fast time and the baseline (``other``, else ``torch``):
    #: "bandwidth": baseline / fast, the fast op's share of the baseline's bandwidth; "faster": the speed-up,
    #: baseline / fast; "time": fast / baseline; "above": fast - baseline, in seconds (a ``ratio_key`` figure
    #: for it is in microseconds)
    ratio: str | None = None
    #: the benchmark's own ratio in ``extra_info`` (a paired benchmark's, from unrounded medians), used when present
    ratio_key: str | None = None
    target: str = ""
    #: what the target checks: ("ratio" or "time" (seconds), ">=" or "<=", bound); None: no target
    goal: tuple[str, str, float] | None = None


def _norm(op: str, rows: int, target: str, goal) -> Row:
    case = f"norm[{op} ({rows}, 4096) f32-{{}}-{{t}}]"
    return Row(op, f"({rows}, 4096) float32", Pick(case.format("fast", t="{t}")),
               Pick(case.format("reference", t="{t}")), Pick(case.format("torch", t="{t}")),
               ("copy", Pick(case.format("copy", t="{t}"))), "bandwidth", target=target, goal=goal)


def _set_rows(rows: int, target: str, goal) -> Row:
    noun = "row" if rows == 1 else "rows"
    case = f"set_rows[set_rows {rows} {noun} f32 -> f16 (4096, 1024)-{{}}-{{t}}]"
    return Row("set_rows", f"{rows} {noun} of 1024 float32 into a (4096, 1024) float16 cache",
               Pick(case.format("fast", t="{t}")), Pick(case.format("reference", t="{t}")),
               Pick(case.format("torch", t="{t}")), ("copy", Pick(case.format("copy", t="{t}"))), "bandwidth",
               target=target, goal=goal)


def _decode_probe(n_kv: int, dtype: str) -> Row:
    paired = f"decode_vs_dram_paired[{n_kv}-{dtype}-{{t}}]"
    return Row("flash_attn_ext decode, `auto`, vs DRAM probe", f"Nkv {n_kv}, {dtype} K/V",
               Pick(paired, "auto_us"),
               Pick(f"decode[{n_kv}-{dtype}-reference-1]") if n_kv <= 4096 else None,
               Pick(f"decode[{n_kv}-{dtype}-torch-{{t}}]"), ("DRAM probe", Pick(paired, "dram_us")), "bandwidth",
               target="≥ 70% of the probe's bandwidth", goal=('ratio', '>=', 0.70))


def _prefill(n: int, dtype: str, target: str, least: float) -> Row:
    return Row("flash_attn_ext prefill, causal, tiled", f"Nq = Nkv = {n}, {dtype} K/V",
               Pick(f"tiled[{n}-{dtype}-{{t}}]"), Pick(f"reference[{dtype}]") if n == 512 else None,
               Pick(f"torch_sdpa[{n}-{dtype}-{{t}}]"), ratio="faster", target=target, goal=('ratio', '>=', least))


def _quantized_decode(n_kv: int, qtype: str, most: float) -> Row:
    paired = f"decode_quantized_paired[{n_kv}-{{t}}]"
    return Row(f"flash_attn_ext decode, `auto`, {qtype.upper()} K/V", f"Nkv {n_kv}",
               Pick(paired, f"{qtype}_us"), other=("float16 K/V", Pick(paired, "float16_us")), ratio="time",
               ratio_key=f"{qtype}/float16",
               target=f"≤ {most}× the float16 time", goal=('ratio', '<=', most))


def _masks(name: str, op: str, shape: str, label: str, most: float) -> Row:
    return Row(op, shape, Pick(name, "masked_ms"), other=(label, Pick(name, "live_ms")), ratio="time",
               ratio_key="masked/live",
               target=f"≤ {most}× the {label}", goal=('ratio', '<=', most))


def _transformers(context: int, least: float, target: str) -> Row:
    paired = f"decode_per_token_paired[{context}]"
    return Row('transformers decode per token, `attn_implementation="fastattn"`', f"context {context}",
               Pick(paired, "fastattn_ms"), torch=Pick(paired, "sdpa_ms"), other=('"eager"', Pick(paired, "eager_ms")),
               ratio="faster", ratio_key="sdpa/fastattn", target=target, goal=('ratio', '>=', least))


def _transformers_quantized(qtype: str, base: str, label: str, least: float | None) -> Row:
    """``QuantizedKVCache`` decode against "sdpa" over another cache (``base``: ``sdpa`` for DynamicCache, the torch
    column, or ``sdpa_fp8`` for ``QuantizedCache(backend="fp8")``, the other baseline)."""
    paired = "quantized_cache_decode_paired"
    return Row(f'transformers decode per token, `QuantizedKVCache` {qtype.upper()}, `"fastattn"`',
               "context 16384", Pick(paired, f"{qtype}_ms"), torch=Pick(paired, "sdpa_ms"),
               other=None if base == "sdpa" else (label, Pick(paired, f"{base}_ms")), ratio="faster",
               ratio_key=f"{base}/{qtype}",
               target="" if least is None else f"speed-up ≥ {least}× over {label}",
               goal=None if least is None else ('ratio', '>=', least))


def _transformers_quantized_bytes(qtype: str, most: float | None) -> Row:
    paired = "quantized_cache_decode_paired"
    return Row(f"`QuantizedKVCache` {qtype.upper()}, `nbytes`", "context 16384 + 18 tokens",
               Pick(paired, f"{qtype}_MB"), other=("float32 K/V", Pick(paired, "float32_MB")), ratio="time",
               ratio_key=f"{qtype}_bytes/float32",
               target="" if most is None else f"≤ {most}× the float32 K/V bytes",
               goal=None if most is None else ('ratio', '<=', most))


HEADS = "Hq 32, Hkv 8, D 128"
ROWS: list[Row] = [
    _norm("rms_norm_mul", 512, "≥ 70% of the copy's bandwidth", ('ratio', '>=', 0.70)),
    _norm("rms_norm_mul", 1, "≤ 5 µs", ("time", "<=", 5e-6)),
    _norm("add_rms_norm_mul", 512, "", None),
    _set_rows(512, "≤ 0.1 ms", ('time', '<=', 1e-4)),
    _set_rows(1, "≤ 5 µs", ("time", "<=", 5e-6)),
    Row("set_rows", "512 rows of 1024 float32 into a (4096, 1024) Q8_0 cache", Pick("set_rows_q8_0[fast-{t}]"),
        Pick("set_rows_q8_0[reference-{t}]"), target="≤ 0.15 ms", goal=('time', '<=', 1.5e-4)),
    Row("rope_ext NEOX, out of place", "(512, 32, 128) float32",
        Pick("neox_out_of_place_vs_copy_paired[{t}]", "rope_ext_us"), Pick("neox_prefill[reference-{t}]"),
        other=("copy", Pick("neox_out_of_place_vs_copy_paired[{t}]", "copy_us")), ratio="bandwidth",
        target="≥ 70% of the copy's bandwidth", goal=('ratio', '>=', 0.70)),
    Row("apply_rope_cache NEOX, out of place", "(512, 32, 128) float32",
        Pick("neox_out_of_place_vs_copy_paired[{t}]", "apply_rope_cache_us"),
        other=("copy", Pick("neox_out_of_place_vs_copy_paired[{t}]", "copy_us")), ratio="bandwidth",
        target="≥ 70% of the copy's bandwidth", goal=('ratio', '>=', 0.70)),
    Row("rope_ext NEOX, in place on a fused-QKV view", "(512, 32, 128) float32",
        Pick("neox_in_place_fused_qkv_paired[{t}]", "qkv_us"),
        other=("contiguous", Pick("neox_in_place_fused_qkv_paired[{t}]", "contiguous_us")), ratio="time",
        target="≤ 1.10× contiguous", goal=('ratio', '<=', 1.10)),
    Row("apply_rope_cache, in place, prebuilt cache", "(1, 32, 128) float32",
        Pick("decode[apply_rope_cache in place-{t}]"), target="≤ 5 µs", goal=("time", "<=", 5e-6)),
    Row("rope_set_rows, fused", "K (512, 8, 128) float32 into a float16 cache",
        Pick("rope_set_rows[rope_set_rows (fused)-{t}]"),
        other=("rope_ext + set_rows", Pick("rope_set_rows[rope_ext + set_rows-{t}]")), ratio="faster",
        target="speed-up ≥ 1.3×", goal=('ratio', '>=', 1.3)),
    Row("apply_rope_cache_set_rows, fused", "K (1, 8, 128) float32 into a float16 cache",
        Pick("rope_set_rows_decode[apply_rope_cache_set_rows (fused)-{t}]"),
        other=("apply_rope_cache + set_rows", Pick("rope_set_rows_decode[apply_rope_cache + set_rows-{t}]")),
        ratio="faster", target="speed-up ≥ 1.3×", goal=('ratio', '>=', 1.3)),
    Row("flash_attn_ext decode, `auto`", "Nkv 4096, float16 K/V", Pick("decode[4096-float16-auto-{t}]"),
        Pick("decode[4096-float16-reference-1]"), Pick("decode[4096-float16-torch-{t}]"), ratio="faster",
        target="≤ 1.40 ms (≥ 12 GB/s)", goal=('time', '<=', 1.4e-3)),
    _decode_probe(4096, "float32"),
    _decode_probe(4096, "float16"),
    _decode_probe(16384, "float32"),
    _decode_probe(16384, "float16"),
    _prefill(512, "float16", "speed-up ≥ 1.0×", 1.0),
    _prefill(512, "float32", "speed-up ≥ 1.0×", 1.0),
    _prefill(2048, "float16", "speed-up ≥ 0.8×", 0.8),
    _prefill(2048, "float32", "speed-up ≥ 0.8×", 0.8),
    _quantized_decode(4096, "q8_0", 0.65),
    _quantized_decode(4096, "q4_0", 0.5),
    _quantized_decode(16384, "q8_0", 0.65),
    _quantized_decode(16384, "q4_0", 0.5),
    Row("flash_attn_ext prefill, causal, Q8_0 K/V", "Nq = Nkv = 512",
        Pick("prefill_quantized_paired[{t}]", "q8_0_ms"),
        other=("float16 K/V", Pick("prefill_quantized_paired[{t}]", "float16_ms")), ratio="time",
        ratio_key="q8_0/float16",
        target="≤ 1.2× the float16 time", goal=('ratio', '<=', 1.2)),
    Row("rope_set_rows, fused, into Q8_0", "K (512, 8, 128) float32",
        Pick("rope_set_rows_q8_0_paired[{t}]", "fused_us"),
        other=("rope_ext + set_rows", Pick("rope_set_rows_q8_0_paired[{t}]", "rope_ext + set_rows_us")),
        ratio="faster", ratio_key="unfused/fused", target="speed-up ≥ 1.3×", goal=('ratio', '>=', 1.3)),
    _masks("window_decode", "flash_attn_ext decode, window mask", "4096 live keys of 32768, float16 K/V",
           "sliced call", 1.2),
    _masks("padded_batch_decode", "flash_attn_ext decode, padded batch", "B 4 of 512/1024/2048/4096 keys",
           "four single calls", 1.15),
    _masks("window_prefill", "flash_attn_ext prefill, 512-key window", "Nq = Nkv = 2048, float16 K/V",
           "causal prefill", 0.4),
    _transformers(4096, 1.0, "speed-up ≥ 1.0×"),
    _transformers(16384, 1.5, "speed-up ≥ 1.5×"),
    _transformers_quantized("q8_0", "sdpa", '"sdpa" + `DynamicCache`', 1.5),
    _transformers_quantized("q8_0", "sdpa_fp8", '"sdpa" + fp8 `QuantizedCache`', 2.0),
    _transformers_quantized("q4_0", "sdpa", '"sdpa" + `DynamicCache`', None),
    _transformers_quantized("q4_0", "sdpa_fp8", '"sdpa" + fp8 `QuantizedCache`', None),
    _transformers_quantized_bytes("q8_0", 0.28),
    _transformers_quantized_bytes("q4_0", None),
    Row("flash_attn_varlen_func, causal prefill", f"8 sequences of 64–2048, {HEADS}, float32",
        Pick("varlen_prefill_vs_separate_calls_paired", "varlen_ms"),
        other=("8 flash_attn_ext calls", Pick("varlen_prefill_vs_separate_calls_paired", "separate_ms")),
        ratio="time", ratio_key="varlen/separate", target="≤ 1.10× the separate calls", goal=('ratio', '<=', 1.10)),
    Row("flash_attn_varlen_func, causal prefill", f"8 sequences of 64–2048, {HEADS}, float32; torch padded to 2048",
        Pick("varlen_prefill_vs_sdpa_padded_paired", "varlen_ms"),
        torch=Pick("varlen_prefill_vs_sdpa_padded_paired", "sdpa_ms"), ratio="faster", ratio_key="sdpa/varlen",
        target="speed-up ≥ 1.5×", goal=('ratio', '>=', 1.5)),
    Row("flash_attn_with_kvcache decode, paged", "page 16 (shuffled), 8 sequences of 1k–8k rows, float16",
        Pick("paged_decode_paired", "paged_ms"),
        other=("contiguous caches", Pick("paged_decode_paired", "contiguous_ms")), ratio="time",
        ratio_key="paged/contiguous", target="≤ 1.15× contiguous", goal=('ratio', '<=', 1.15)),
    Row("flash_attn_with_kvcache decode, append + rotary", "B 8, Nkv 4096, float16 cache",
        Pick("decode_append_rotary_paired", "append_ms"),
        other=("attention alone", Pick("decode_append_rotary_paired", "attention_ms")), ratio="time",
        ratio_key="append/attention", target="≤ 1.10× the attention alone", goal=('ratio', '<=', 1.10)),
    Row("flash_attn_with_kvcache, decode-sized call", "B 1, Nkv 256, float16 cache",
        Pick("decode_call_overhead_paired", "kvcache_us"),
        other=("flash_attn_ext", Pick("decode_call_overhead_paired", "flash_attn_ext_us")), ratio="above",
        ratio_key="kvcache-flash_attn_ext_us", target="≤ 20 µs above flash_attn_ext", goal=('ratio', '<=', 20e-6)),
]

COLUMNS = ["op", "shape", "threads", "fastattn", "reference", "torch", "other baseline", "ratio", "target", "met"]


def _seconds(bench: dict, key: str | None) -> float | None:
    """The time ``key`` names, in seconds (a size in megabytes for a ``_MB`` key)."""
    if key is None:
        return bench["stats"]["median"]
    value = bench.get("extra_info", {}).get(key)
    if value is None:
        return None
    if key.endswith("_MB"):
        return value
    return value * (1e-6 if key.endswith("_us") else 1e-3)


def _cell(value: float | None, key: str | None) -> str:
    """A time (``duration``), or a size for a ``_MB`` key."""
    if value is not None and key is not None and key.endswith("_MB"):
        return f"{value:.1f} MB"
    return duration(value)


def _ratio(row: Row, fast: float | None, base: float | None, label: str, given: float | None
           ) -> tuple[float | None, str]:
    if row.ratio is None:
        return None, ""
    if given is None and (fast is None or base is None):
        return None, "—"
    if row.ratio == "bandwidth":
        value = base / fast if given is None else given
        return value, f"{value:.0%} of {label}"
    if row.ratio == "faster":
        value = base / fast if given is None else given
        return value, f"speed-up {value:.2f}×"
    if row.ratio == "above":
        value = fast - base if given is None else given * 1e-6
        return value, f"+{duration(value)} over {label}"
    value = fast / base if given is None else given
    return value, f"{value:.2f}× {label}"


def table(data: dict) -> str:
    """The table of docs/benchmarks.md from a pytest-benchmark JSON file: a line per ``ROWS`` entry and thread
    count the file has the fast case of, the targets checked at the highest thread count."""
    by_name = {bench["name"].removeprefix("test_"): bench for bench in data["benchmarks"]}
    thread_counts = sorted({bench.get("extra_info", {}).get("threads", 0) for bench in data["benchmarks"]})
    top = thread_counts[-1] if thread_counts else 0

    def find(pick: Pick | None, t: int) -> tuple[bool, float | None]:
        if pick is None:
            return False, None
        bench = by_name.get(pick.name.format(t=t))
        return True, (None if bench is None else _seconds(bench, pick.key))

    body = []
    for row in ROWS:
        threaded = "{t}" in row.fast.name
        for t in (sorted(thread_counts, reverse=True) if threaded else [None]):
            fast_bench = by_name.get(row.fast.name.format(t=t))
            if fast_bench is None:  # the case was not run
                continue
            threads = t if threaded else fast_bench.get("extra_info", {}).get("threads", top)
            fast = _seconds(fast_bench, row.fast.key)
            cells = [row.op, row.shape, str(threads), _cell(fast, row.fast.key)]
            for pick in (row.reference, row.torch):
                present, seconds = find(pick, threads)
                cells.append(_cell(seconds, pick.key) if present else "")
            label, other = row.other if row.other else ("torch", row.torch)
            present, base = find(other, threads)
            cells.append(f"{label} {_cell(base, other.key)}" if present and row.other else "")
            given = fast_bench.get("extra_info", {}).get(row.ratio_key) if row.ratio_key else None
            value, text = _ratio(row, fast, base, label, given)
            cells.append(text)
            if threads == top and row.goal is not None:
                on, sense, bound = row.goal
                figure = value if on == "ratio" else fast
                if figure is None:
                    cells += [row.target, "—"]
                else:
                    cells += [row.target, "yes" if (figure >= bound if sense == ">=" else figure <= bound) else "no"]
            else:
                cells += ["", ""]
            body.append(cells)
    return markdown(COLUMNS, body)


def cases(data: dict) -> str:
    """Every benchmark of the file: group, case, threads, median and its rate (or a paired benchmark's ratio)."""
    groups: dict[str, list[tuple[str, int, float, str]]] = defaultdict(list)
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        rate = next((f"{info[key]:.1f} {key}" for key in ("GB/s", "GFLOP/s") if key in info), "")
        ratios = ", ".join(f"{key} {value}" for key, value in info.items() if "/" in key and key[-2:] != "/s")
        rate = "; ".join(part for part in (rate, ratios) if part)
        groups[bench["group"] or ""].append((bench["name"].removeprefix("test_"), info.get("threads", 0),
                                             bench["stats"]["median"], rate))
    return markdown(["group", "case", "threads", "median", "rate"],
                    [(group, label, str(threads), duration(median), rate) for group, entries in groups.items()
                     for label, threads, median, rate in sorted(entries, key=lambda e: (e[1], e[2]))])


if __name__ == "__main__":
    args = sys.argv[1:]
    every = "--all" in args
    paths = [a for a in args if a != "--all"]
    if len(paths) != 1:
        sys.exit("usage: python bench/report.py [--all] bench.json")
    with open(paths[0]) as fh:
        data = json.load(fh)
    print(cases(data) if every else table(data))

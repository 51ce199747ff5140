"""FlashAttention's API on the CPU (``fastattn.integrations.flash_attn``): its calls against the work they stand on.

Llama-3-8B-like heads (32 query heads, 8 KV heads, D 128), 2 threads, every comparison paired (each round calls
each side once, in an order that rotates; ``conftest.paired``), ``extra_info`` holding each side's median and the
ratio:

- varlen prefill: ``flash_attn_varlen_func`` causal over 8 float32 sequences of 64 to 2048 tokens, against the
  8 separate ``flash_attn_ext`` calls on the same rows with their causal masks built beforehand (target: <= 1.10x
  their sum), and, in a benchmark of its own, torch SDPA (``is_causal``, ``enable_gqa``) on the batch padded to
  2048 (target: >= 1.5x faster);
- paged decode: ``flash_attn_with_kvcache`` over a float16 paged cache (pages of 16 rows, shuffled), 8 sequences
  of 1k to 8k rows, against the same call over contiguous caches (target: <= 1.15x);
- decode step with append and rotary: batch 8, 4096 live rows, float16 cache, one new K/V row each rotated with
  NEOX tables, against the attention alone (the same call without k, v and tables; target: <= 1.10x);
- decode-sized call: batch 1, 256 live rows of a float16 cache, against ``flash_attn_ext`` on the same rows with
  its output preallocated (target: <= 20 us above). Timed as blocks of 20 calls (a call is ~0.1 ms).

Run: ``python -m pytest bench/bench_flash_attn.py --benchmark-group-by=group``.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import paired, torch_or_none

import fastattn
from fastattn.integrations.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

HQ, HKV, D = 32, 8, 128
THREADS = 2
LENGTHS = [64, 2048, 256, 1024, 128, 1536, 512, 768]
PAGE = 16
DECODE_LENGTHS = [1024, 8192, 2048, 4096, 3072, 6144, 5120, 7168]
CALLS_PER_BLOCK = 20


def _record(benchmark, medians: dict | None, unit: str, ratios: dict[str, tuple[str, str]]) -> None:
    if medians is None:
        return
    scale = 1e3 if unit == "ms" else 1e6
    for name, seconds in medians.items():
        benchmark.extra_info[f"{name}_{unit}"] = round(seconds * scale, 3)
    for key, (top, bottom) in ratios.items():
        benchmark.extra_info[key] = round(medians[top] / medians[bottom], 3)


def _varlen_inputs():
    rng = np.random.default_rng(0)
    total = sum(LENGTHS)
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    q = rng.standard_normal((total, HQ, D), dtype=np.float32)
    k = rng.standard_normal((total, HKV, D), dtype=np.float32)
    v = rng.standard_normal((total, HKV, D), dtype=np.float32)
    return cu, q, k, v, lambda: flash_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), causal=True)


def test_varlen_prefill_vs_separate_calls_paired(benchmark):
    cu, q, k, v, varlen = _varlen_inputs()
    masks = {n: np.triu(np.full((n, n), -np.inf, np.float32), 1) for n in LENGTHS}
    views = [tuple(x[cu[b]:cu[b + 1]].transpose(1, 0, 2)[None] for x in (q, k, v)) for b in range(len(LENGTHS))]

    def separate():  # each call allocates its output, as varlen allocates its one
        for (qb, kb, vb), n in zip(views, LENGTHS):
            fastattn.flash_attn_ext(qb, kb, vb, masks[n])

    calls = {"varlen": varlen, "separate": separate}
    for call in calls.values():  # compile / warm up both sides
        call()
    medians = paired(benchmark, calls, group="flash_attn varlen prefill, 8 sequences of 64-2048, float32",
                     threads=THREADS, rounds=8)
    _record(benchmark, medians, "ms", {"varlen/separate": ("varlen", "separate")})


def test_varlen_prefill_vs_sdpa_padded_paired(benchmark):
    """torch's SDPA on the batch padded to 2048 (its own benchmark: torch's threads would stay busy into the
    next call of a shared round)."""
    torch = torch_or_none()
    if torch is None:
        pytest.skip("torch is not installed")
    cu, q, k, v, varlen = _varlen_inputs()
    padded = [torch.zeros((len(LENGTHS), h, max(LENGTHS), D)) for h in (HQ, HKV, HKV)]
    for b in range(len(LENGTHS)):
        for t, x in zip(padded, (q, k, v)):
            t[b, :, :LENGTHS[b]] = torch.from_numpy(x[cu[b]:cu[b + 1]].transpose(1, 0, 2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {"varlen": varlen, "sdpa": lambda: sdpa(*padded, is_causal=True, enable_gqa=True)}
    for call in calls.values():
        call()
    medians = paired(benchmark, calls, group="flash_attn varlen prefill vs torch SDPA padded to 2048, float32",
                     threads=THREADS, rounds=4)
    _record(benchmark, medians, "ms", {"sdpa/varlen": ("sdpa", "varlen")})


def _paged_caches(rng, lengths):
    """Contiguous float16 caches (8, 8192, Hkv, D) and the same rows as shuffled pages of PAGE rows."""
    n_rows = max(lengths)
    contiguous = [rng.standard_normal((len(lengths), n_rows, HKV, D), dtype=np.float32).astype(np.float16)
                  for _ in range(2)]
    pages_per_seq = n_rows // PAGE
    table = rng.permutation(len(lengths) * pages_per_seq).reshape(len(lengths), pages_per_seq).astype(np.int32)
    pages = []
    for cache in contiguous:
        paged = np.empty((len(lengths) * pages_per_seq, PAGE, HKV, D), np.float16)
        paged[table.ravel()] = cache.reshape(-1, PAGE, HKV, D)
        pages.append(paged)
    return contiguous, pages, table


def test_paged_decode_paired(benchmark):
    rng = np.random.default_rng(1)
    contiguous, pages, table = _paged_caches(rng, DECODE_LENGTHS)
    q = rng.standard_normal((len(DECODE_LENGTHS), 1, HQ, D), dtype=np.float32).astype(np.float16)
    seqlens = np.array(DECODE_LENGTHS, np.int32)
    flash_attn_with_kvcache(q, *pages, cache_seqlens=seqlens, block_table=table)  # compiled before the rounds
    calls = {"paged": lambda: flash_attn_with_kvcache(q, *pages, cache_seqlens=seqlens, block_table=table),
             "contiguous": lambda: flash_attn_with_kvcache(q, *contiguous, cache_seqlens=seqlens)}
    medians = paired(benchmark, calls, group="flash_attn paged decode, page 16, 8 sequences of 1k-8k, float16",
                     threads=THREADS, rounds=20)
    _record(benchmark, medians, "ms", {"paged/contiguous": ("paged", "contiguous")})


def test_decode_append_rotary_paired(benchmark):
    rng = np.random.default_rng(2)
    batch, n_kv = 8, 4096
    caches = [rng.standard_normal((batch, n_kv, HKV, D), dtype=np.float32).astype(np.float16) for _ in range(2)]
    q = rng.standard_normal((batch, 1, HQ, D), dtype=np.float32).astype(np.float16)
    k, v = (rng.standard_normal((batch, 1, HKV, D), dtype=np.float32).astype(np.float16) for _ in range(2))
    angles = np.arange(n_kv)[:, None] * 10000.0 ** (-np.arange(D // 2) / (D // 2))
    cos, sin = np.cos(angles).astype(np.float16), np.sin(angles).astype(np.float16)
    calls = {"append": lambda: flash_attn_with_kvcache(q, *caches, k, v, cos, sin, cache_seqlens=n_kv - 1,
                                                       causal=True, rotary_interleaved=False),
             "attention": lambda: flash_attn_with_kvcache(q, *caches, cache_seqlens=n_kv, causal=True)}
    for call in calls.values():
        call()
    medians = paired(benchmark, calls, group="flash_attn decode step, append + rotary, B 8, Nkv 4096, float16",
                     threads=THREADS, rounds=30)
    _record(benchmark, medians, "ms", {"append/attention": ("append", "attention")})


def test_decode_call_overhead_paired(benchmark):
    rng = np.random.default_rng(3)
    n_kv = 256
    q = rng.standard_normal((1, 1, HQ, D), dtype=np.float32)
    k_cache, v_cache = (rng.standard_normal((1, 1024, HKV, D), dtype=np.float32).astype(np.float16)
                        for _ in range(2))
    q4 = q.transpose(0, 2, 1, 3)
    k4, v4 = k_cache[:, :n_kv].transpose(0, 2, 1, 3), v_cache[:, :n_kv].transpose(0, 2, 1, 3)
    out = np.empty((1, 1, HQ, D), np.float32)

    def block(fn):
        def run():
            for _ in range(CALLS_PER_BLOCK):
                fn()
        return run

    calls = {"kvcache": block(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=n_kv)),
             "flash_attn_ext": block(lambda: fastattn.flash_attn_ext(q4, k4, v4, out=out))}
    for call in calls.values():
        call()
    medians = paired(benchmark, calls, group="flash_attn decode-sized call, B 1, Nkv 256, float16",
                     threads=THREADS, rounds=60)
    if medians is None:
        return
    per_call = {name: seconds / CALLS_PER_BLOCK for name, seconds in medians.items()}
    _record(benchmark, per_call, "us", {})
    benchmark.extra_info["kvcache-flash_attn_ext_us"] = round(
        (per_call["kvcache"] - per_call["flash_attn_ext"]) * 1e6, 2)

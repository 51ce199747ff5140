"""Masks at mask cost: a masked call against the same work on its live keys alone, interleaved round by round.

Llama-3-8B-like heads (32 query heads, 8 KV heads, D 128), float16 K/V and masks, 2 threads:

- window: decode over a 32768-key cache whose mask lets the last 4096 keys through (a sliding window), against
  the call on the 4096-key slice without a mask (target: <= 1.2x);
- padded batch: four sequences of 512, 1024, 2048 and 4096 keys in one call (B = 4, padded to 4096, a mask row per
  batch entry), against the four calls on their live slices (target: <= 1.15x their sum);
- prefill window: 2048 queries with a causal 512-key window, against the dense causal prefill of the same size
  (target: <= 0.4x).

Each round runs both sides in an order that alternates (``conftest.paired``); ``extra_info`` holds each side's
median (ms) and the ratio masked / live. Run: ``python -m pytest bench/bench_masks.py --benchmark-group-by=group``.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import paired

import fastattn

HQ, HKV, D = 32, 8, 128
SCALE = D ** -0.5
THREADS = 2


def _qkv(rng, batch, n_q, n_kv):
    q = rng.standard_normal((batch, HQ, n_q, D), dtype=np.float32)
    k = rng.standard_normal((batch, HKV, n_kv, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((batch, HKV, n_kv, D), dtype=np.float32).astype(np.float16)
    return q, k, v


def _paired(benchmark, masked, live, *, group: str, rounds: int):
    live()  # compile / warm up both sides
    medians = paired(benchmark, {"masked": masked, "live": live}, group=group, threads=THREADS, rounds=rounds)
    if medians is None:
        return
    benchmark.extra_info["masked_ms"] = round(medians["masked"] * 1e3, 3)
    benchmark.extra_info["live_ms"] = round(medians["live"] * 1e3, 3)
    benchmark.extra_info["masked/live"] = round(medians["masked"] / medians["live"], 3)


def test_window_decode(benchmark):
    rng = np.random.default_rng(0)
    n_kv, window = 32768, 4096
    q, k, v = _qkv(rng, 1, 1, n_kv)
    mask = np.full((1, n_kv), -np.inf, np.float16)
    mask[:, n_kv - window:] = 0.0
    k_live, v_live = k[:, :, n_kv - window:], v[:, :, n_kv - window:]
    _paired(benchmark, lambda: fastattn.flash_attn_ext(q, k, v, mask, scale=SCALE),
            lambda: fastattn.flash_attn_ext(q, k_live, v_live, scale=SCALE),
            group="masks: window 4096 of 32768, decode", rounds=30)


def test_padded_batch_decode(benchmark):
    rng = np.random.default_rng(1)
    lengths = [512, 1024, 2048, 4096]
    q, k, v = _qkv(rng, len(lengths), 1, max(lengths))
    mask = np.full((len(lengths), 1, 1, max(lengths)), -np.inf, np.float16)
    for b, n in enumerate(lengths):
        mask[b, ..., :n] = 0.0

    def singles():
        for b, n in enumerate(lengths):
            fastattn.flash_attn_ext(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], scale=SCALE)

    _paired(benchmark, lambda: fastattn.flash_attn_ext(q, k, v, mask, scale=SCALE), singles,
            group="masks: padded batch 512/1024/2048/4096, decode", rounds=30)


def test_window_prefill(benchmark):
    rng = np.random.default_rng(2)
    n, window = 2048, 512
    q, k, v = _qkv(rng, 1, n, n)
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    causal = np.where(j <= i, 0.0, -np.inf).astype(np.float16)
    windowed = np.where((j <= i) & (j > i - window), 0.0, -np.inf).astype(np.float16)
    _paired(benchmark, lambda: fastattn.flash_attn_ext(q, k, v, windowed, scale=SCALE),
            lambda: fastattn.flash_attn_ext(q, k, v, causal, scale=SCALE),
            group="masks: prefill 2048, window 512 vs causal", rounds=6)


@pytest.fixture(autouse=True)
def _two_threads():
    with fastattn.num_threads(THREADS):
        yield

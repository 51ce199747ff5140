"""Quantized KV caches (Q8_0, Q4_0) against float16 ones, in one process, interleaved round by round.

- ``test_decode_quantized_paired``: decode of the main job's layer (32 query heads, 8 KV heads, D 128), Nkv 4096 and
  16384, cold (each call reads the next of a set of distinct layers, >= 256 MiB per type). Each round calls
  ``auto`` on float16, Q8_0 and Q4_0 K/V and the DRAM read probe of ``bench_attention_decode``, in an order that
  rotates from round to round. ``extra_info``: each type's median time, its time over float16's (the targets:
  Q8_0 <= 0.65, Q4_0 <= 0.5: their bytes are 0.53x and 0.28x float16's), the GB/s of the bytes it reads and that
  as a share of the probe's.
- ``test_prefill_quantized_paired``: a causal prefill of 512 tokens on float16 and on Q8_0 K/V (``auto``: tiled),
  interleaved; the target is Q8_0 within 1.2x of float16.
- ``test_rope_set_rows_q8_0_paired``: 512 K rows rotated and quantized into a Q8_0 (4096, 8 x 128) cache, fused
  (``rope_set_rows``) against ``rope_ext`` then ``set_rows``, interleaved; the target is fused >= 1.3x faster.
- ``test_decode_writes_paired``: one decode step's K and V writes (``apply_rope_cache_set_rows``, ``set_rows``)
  into float16, Q8_0 and Q4_0 caches, interleaved; ``extra_info``: microseconds per step of each.

Run: ``python -m pytest bench/bench_quantized.py --benchmark-columns=median,rounds --benchmark-group-by=group``
(2 threads is the targets' setting; 1 thread is shown beside it).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from bench_attention_decode import COLD_BYTES, _dram_read
from conftest import THREADS, paired

import fastattn
from fastattn.jobs import LAYER
from fastattn.jobs.timing import per_second

HQ, HKV, D = LAYER.n_head, LAYER.n_head_kv, LAYER.head_dim
SCALE = D ** -0.5
KINDS = ("float16", "q8_0", "q4_0")
ROW_BYTES = {"float16": 2 * D, "q8_0": D // 32 * 34, "q4_0": D // 32 * 18}


def _layers(kind: str, n_kv: int) -> list:
    """Distinct (K, V) layers of ``kind`` (>= COLD_BYTES together), from one set of random values."""
    rng = np.random.default_rng(n_kv)
    base = rng.standard_normal((2, 1, HKV, n_kv, D)).astype(np.float32)
    per_layer = 2 * HKV * n_kv * ROW_BYTES[kind]
    count = max(2, -(-COLD_BYTES // per_layer))
    if kind == "float16":
        half = base.astype(np.float16)
        return [(half[0].copy(), half[1].copy()) for _ in range(count)]
    k, v = fastattn.quantize(base[0], kind), fastattn.quantize(base[1], kind)
    return [(fastattn.Quantized(k.data.copy(), kind), fastattn.Quantized(v.data.copy(), kind)) for _ in range(count)]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n_kv", [4096, 16384])
def test_decode_quantized_paired(benchmark, n_kv, threads):
    q = np.random.default_rng(1).standard_normal((1, HQ, 1, D)).astype(np.float32)
    out = np.empty((1, 1, HQ, D), np.float32)
    layers = {kind: itertools.cycle(_layers(kind, n_kv)) for kind in KINDS}
    probe_layers = itertools.cycle(_layers("float16", n_kv))

    def attend(kind):
        k, v = next(layers[kind])
        fastattn.flash_attn_ext(q, k, v, scale=SCALE, out=out)

    calls = {kind: (lambda kind=kind: attend(kind)) for kind in KINDS}
    calls["dram"] = lambda: _dram_read(*next(probe_layers), threads)
    nbytes = {kind: 2 * HKV * n_kv * ROW_BYTES[kind] for kind in KINDS}
    medians = paired(benchmark, calls, group=f"decode Nkv {n_kv} float16 / q8_0 / q4_0 KV, paired", threads=threads,
                     nbytes=sum(nbytes.values()) + nbytes["float16"], rounds=12, skip=2)
    if medians is None:
        return
    probe = per_second(nbytes["float16"], medians["dram"])
    benchmark.extra_info["dram_GB/s"] = round(probe, 2)
    for kind in KINDS:
        rate = per_second(nbytes[kind], medians[kind])
        benchmark.extra_info[f"{kind}_us"] = round(medians[kind] * 1e6, 1)
        benchmark.extra_info[f"{kind}_GB/s"] = round(rate, 2)
        benchmark.extra_info[f"{kind}/dram"] = round(rate / probe, 3)
        benchmark.extra_info[f"{kind}/float16"] = round(medians[kind] / medians["float16"], 3)


@pytest.mark.parametrize("threads", THREADS)
def test_prefill_quantized_paired(benchmark, threads):
    n = LAYER.n_prefill
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, HQ, n, D)).astype(np.float32)
    k = rng.standard_normal((1, HKV, n, D)).astype(np.float32)
    v = rng.standard_normal((1, HKV, n, D)).astype(np.float32)
    mask = np.where(np.arange(n)[None, :] > np.arange(n)[:, None], -np.inf, 0.0).astype(np.float16)
    out = np.empty((1, n, HQ, D), np.float32)
    kv = {"float16": (k.astype(np.float16), v.astype(np.float16)),
          "q8_0": (fastattn.quantize(k, "q8_0"), fastattn.quantize(v, "q8_0"))}
    calls = {kind: (lambda kind=kind: fastattn.flash_attn_ext(q, *kv[kind], mask, scale=SCALE, out=out))
             for kind in kv}
    flops = 4.0 * HQ * D * n * (n + 1) / 2
    medians = paired(benchmark, calls, group=f"prefill {n} causal float16 / q8_0 KV, paired", threads=threads,
                     rounds=8, skip=2)
    if medians is None:
        return
    for kind in kv:
        benchmark.extra_info[f"{kind}_ms"] = round(medians[kind] * 1e3, 2)
        benchmark.extra_info[f"{kind}_GFLOP/s"] = round(per_second(flops, medians[kind]), 1)
    benchmark.extra_info["q8_0/float16"] = round(medians["q8_0"] / medians["float16"], 3)


@pytest.mark.parametrize("threads", THREADS)
def test_rope_set_rows_q8_0_paired(benchmark, threads):
    n, rows = LAYER.n_prefill, LAYER.kv_cache_rows
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, HKV, D)).astype(np.float32)
    pos = np.arange(n, dtype=np.int32)
    idx = np.arange(n, dtype=np.int64)
    rope = dict(n_dims=D, mode=fastattn.ROPE_NEOX, freq_base=500000.0)
    cache = fastattn.quantize(np.zeros((rows, HKV, D), np.float32), "q8_0")
    flat = fastattn.Quantized(cache.data.reshape(rows, -1), "q8_0")
    calls = {"fused": lambda: fastattn.rope_set_rows(cache, x, pos, idx, **rope),
             "rope_ext + set_rows": lambda: fastattn.set_rows(flat, fastattn.rope_ext(x, pos, **rope)
                                                              .reshape(n, HKV * D), idx)}
    medians = paired(benchmark, calls, group=f"rope_set_rows {n} x {HKV} x {D} f32 -> q8_0, paired", threads=threads,
                     rounds=30, skip=2)
    if medians is None:
        return
    for name, seconds in medians.items():
        benchmark.extra_info[f"{name}_us"] = round(seconds * 1e6, 1)
    benchmark.extra_info["unfused/fused"] = round(medians["rope_ext + set_rows"] / medians["fused"], 3)


#: Decode steps per timed call of ``test_decode_writes_paired`` (one step takes microseconds).
STEPS = 200


def test_decode_writes_paired(benchmark):
    """One decode step's cache writes, K by ``apply_rope_cache_set_rows`` (one token, its table prebuilt) and V by
    ``set_rows`` (one row), into float16, Q8_0 and Q4_0 caches of (4096, 8 x 128), interleaved: decode-sized
    calls, serial at any thread count."""
    rows = LAYER.kv_cache_rows
    rng = np.random.default_rng(4)
    k = rng.standard_normal((1, HKV, D)).astype(np.float32)
    v = rng.standard_normal((1, HKV * D)).astype(np.float32)
    idx = np.array([rows // 2])
    table = fastattn.rope_cache(np.array([rows // 2], np.int32), n_dims=D, mode=fastattn.ROPE_NEOX,
                                freq_base=500000.0)
    caches = {"float16": (np.zeros((rows, HKV, D), np.float16), np.zeros((rows, HKV * D), np.float16))}
    for kind in KINDS[1:]:
        caches[kind] = (fastattn.quantize(np.zeros((rows, HKV, D), np.float32), kind),
                        fastattn.quantize(np.zeros((rows, HKV * D), np.float32), kind))

    def steps(kind):
        k_cache, v_cache = caches[kind]
        for _ in range(STEPS):
            fastattn.apply_rope_cache_set_rows(k_cache, k, table, idx)
            fastattn.set_rows(v_cache, v, idx)

    calls = {kind: (lambda kind=kind: steps(kind)) for kind in KINDS}
    medians = paired(benchmark, calls, group=f"decode K and V writes, 1 token x {HKV} x {D}, f16 / q8_0 / q4_0",
                     threads=1, rounds=30, skip=2)
    if medians is None:
        return
    for kind, seconds in medians.items():
        benchmark.extra_info[f"{kind}_us_per_step"] = round(seconds / STEPS * 1e6, 2)

"""Decode attention (Nq 1): fastattn's paths against the NumPy reference and torch SDPA, cold cache.

Llama-3-8B-like layer: 32 query heads, 8 KV heads, D 128, Nkv 512 / 4096 / 16384, float16 and float32 K/V, 1 and 2
threads. Each round reads the K/V of the next of a set of distinct "layers" (>= 256 MiB together), so nothing
stays in L3 and the timing is the DRAM-bound one a model sees. GB/s in ``extra_info`` counts the K+V bytes read.

``test_dram_read_baseline`` measures the machine's DRAM read bandwidth over the same kind of cold buffers (a
Numba ``prange`` sum), in the same run: the float32 target is >= 70% of it, the float16 target >= 12 GB/s at
Nkv 4096 with 2 threads.

``test_decode_vs_dram_paired`` calls the DRAM probe, ``auto``, ``split_kv`` and ``one_chunk`` (float32 and
float16, Nkv 4096 and 16384) in each round, in an order that rotates from round to round, and records the fraction of the probe's
bandwidth each path reaches (``extra_info["dram/auto"]`` ...): separate benchmarks, a minute apart on this shared
machine, read the ratio poorly (the probe alone moved between 1.2 and 1.5 ms within the hour).

Run: ``python -m pytest bench/bench_attention_decode.py --benchmark-columns=median,iqr,rounds
--benchmark-group-by=group``.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import THREADS, measure, paired, torch_or_none
from numba import prange

import fastattn
from fastattn import reference
from fastattn._core.kernel import kernel, kernel_view, to_f32
from fastattn.jobs import LAYER

HQ, HKV, D = LAYER.n_head, LAYER.n_head_kv, LAYER.head_dim
#: the context of the targets, the paired benchmark and the DRAM probe
TARGET_N_KV = 4096
#: the main job's decode context, then two longer ones
N_KV = [LAYER.decode_n_kv, TARGET_N_KV, 16384]
COLD_BYTES = 256 << 20  # distinct K/V bytes cycled through: well past the L3 cache
ROUNDS = 15


class Layers:
    """Distinct K/V layer buffers (at least COLD_BYTES together) handed out round robin."""

    _cache: dict = {}

    def __init__(self, n_kv: int, dtype):
        rng = np.random.default_rng(n_kv)
        per_layer = 2 * HKV * n_kv * D * np.dtype(dtype).itemsize
        count = max(2, -(-COLD_BYTES // per_layer))
        base = rng.standard_normal((2, 1, HKV, n_kv, D)).astype(dtype)
        self.kv = [(base[0] + np.asarray(i, dtype), base[1] - np.asarray(i, dtype)) for i in range(count)]
        self.bytes = per_layer
        self._next = itertools.cycle(range(count))

    @classmethod
    def get(cls, n_kv, dtype) -> "Layers":
        key = (n_kv, np.dtype(dtype))
        if key not in cls._cache:
            cls._cache.clear()  # keep one set alive at a time
            cls._cache[key] = Layers(n_kv, dtype)
        return cls._cache[key]

    def next(self):
        return self.kv[next(self._next)]


def _query():
    return np.random.default_rng(1).standard_normal((1, HQ, 1, D)).astype(np.float32)


IMPLS = ["split_kv", "auto", "one_chunk", "reference", "torch"]
SCALE = D ** -0.5


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("n_kv", N_KV)
def test_decode(benchmark, n_kv, dtype, impl, threads):
    if impl == "reference" and (n_kv > TARGET_N_KV or threads > 1):
        pytest.skip(f"the reference is slow and single-threaded: up to {TARGET_N_KV} at 1 thread only")
    if impl == "one_chunk" and n_kv > TARGET_N_KV:
        pytest.skip(f"one_chunk is not the decode path; shown up to {TARGET_N_KV}")
    layers = Layers.get(n_kv, np.dtype(dtype))
    q = _query()
    out = np.empty((1, 1, HQ, D), np.float32)
    if impl == "torch":
        torch = torch_or_none()
        if torch is None:
            pytest.skip("torch is not installed")
        tq = torch.from_numpy(q).to(torch.from_numpy(layers.kv[0][0]).dtype)  # SDPA wants one dtype
        tensors = [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in layers.kv]
        cycle = itertools.cycle(tensors)

        def fn():
            k, v = next(cycle)
            return torch.nn.functional.scaled_dot_product_attention(tq, k, v, scale=SCALE, enable_gqa=True)
    elif impl == "reference":
        def fn():
            k, v = layers.next()
            return reference.flash_attn_ext(q, k, v, scale=SCALE)
    else:
        def fn():
            k, v = layers.next()
            return fastattn.flash_attn_ext(q, k, v, scale=SCALE, path=impl, out=out)
    measure(benchmark, fn, group=f"decode Nkv {n_kv} {dtype}", threads=threads, nbytes=layers.bytes,
            rounds=5 if impl in ("reference", "torch") else ROUNDS)


@kernel(parallel=True)
def _sum_rows(a):
    """Read every element of ``a`` (n, m) once, rows spread over the threads: a DRAM read-bandwidth probe."""
    total = 0.0
    for i in prange(a.shape[0]):
        row = a[i]
        s = np.float32(0.0)
        for j in range(row.shape[0]):
            s += to_f32(row[j])
        total += s
    return total


def _dram_read(k, v, threads: int):
    """The DRAM probe over one layer's K and V, on ``threads`` threads (Numba's own count: a plain prange)."""
    import numba

    numba.set_num_threads(threads)
    return _sum_rows(kernel_view(k).reshape(-1, D)) + _sum_rows(kernel_view(v).reshape(-1, D))


@pytest.mark.parametrize("threads", THREADS)
def test_dram_read_baseline(benchmark, threads):
    """DRAM read bandwidth over cold float32 buffers (the Nkv 4096 float32 layers: 32 MiB each)."""
    layers = Layers.get(TARGET_N_KV, np.float32)

    def pinned():
        return _dram_read(*layers.next(), threads)
    measure(benchmark, pinned, group="decode DRAM read baseline", threads=threads, nbytes=layers.bytes,
            rounds=ROUNDS)


PAIRED_ROUNDS = 12


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("n_kv", [TARGET_N_KV, 16384])
def test_decode_vs_dram_paired(benchmark, n_kv, dtype, threads):
    """The DRAM probe and the three paths, each on the next cold layer, every round: each path's share of the
    probe's bandwidth (the probe widens float16 as the kernels do)."""
    layers = Layers.get(n_kv, np.dtype(dtype))
    q = _query()
    out = np.empty((1, 1, HQ, D), np.float32)
    calls = {"dram": lambda k, v: _dram_read(k, v, threads)}
    for path in ("auto", "split_kv", "one_chunk"):
        calls[path] = lambda k, v, path=path: fastattn.flash_attn_ext(q, k, v, scale=SCALE, path=path, out=out)
    medians = paired(benchmark, calls, group=f"decode Nkv {n_kv} {dtype} vs DRAM read, paired", threads=threads,
                     nbytes=len(calls) * layers.bytes, rounds=PAIRED_ROUNDS, skip=2, arguments=layers.next)
    if medians is None:
        return
    names = list(calls)
    for name in names:
        benchmark.extra_info[f"{name}_us"] = round(medians[name] * 1e6, 1)
    for name in names[1:]:
        benchmark.extra_info[f"dram/{name}"] = round(medians["dram"] / medians[name], 3)

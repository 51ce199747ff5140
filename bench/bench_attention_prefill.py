"""Prefill attention: B 1, Nq = Nkv = 512 and 2048, 32 query / 8 KV heads, D 128, causal float16 mask.

Implementations: the ``tiled`` path (``run_tiled`` on kernel views, ``out`` preallocated), the ``one_chunk`` path
through ``fastattn.attention.flash_attn_ext`` when that module exists, the float64 NumPy reference (512 only: it is
slow) and torch SDPA (float32, ``is_causal``, ``enable_gqa``) when torch is installed; 1 and 2 threads.

FLOPs: 4·B·Hq·Nq·Nkv·D / 2 for a causal mask (QKᵀ and PV, 2 FLOPs per multiply-add, half the pairs live), the
usual FlashAttention convention; recorded as GFLOP/s in ``extra_info``.

Run: ``python -m pytest bench/bench_attention_prefill.py --benchmark-columns=median,iqr,rounds
--benchmark-group-by=group``.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from conftest import THREADS, measure, torch_or_none
from fastattn.attention import tiled as _attention_tiled
from fastattn.attention.args import alibi_slopes
from fastattn._core.kernel import kernel_view
from fastattn.jobs import LAYER

B, HQ, HKV, D = 1, LAYER.n_head, LAYER.n_head_kv, LAYER.head_dim
SIZES = [LAYER.n_prefill, 2048]  # the main job's prefill, then a longer prompt
KV_DTYPES = [np.float16, np.float32]
ROUNDS = dict(zip(SIZES, (7, 3)))


def causal_flops(n: int) -> float:
    return 4.0 * B * HQ * n * n * D / 2


def inputs(n: int, kv_dtype):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, HQ, n, D)).astype(np.float32)
    k = rng.standard_normal((B, HKV, n, D)).astype(kv_dtype)
    v = rng.standard_normal((B, HKV, n, D)).astype(kv_dtype)
    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1).astype(np.float16)
    return q, k, v, mask


def group(n: int, kv_dtype) -> str:
    return f"attention prefill N={n} {np.dtype(kv_dtype).name} KV causal"


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_tiled(benchmark, n, kv_dtype, threads):
    q, k, v, mask = inputs(n, kv_dtype)
    kk, vv, mm = kernel_view(k), kernel_view(v), kernel_view(mask.reshape(1, 1, n, n))
    slopes = alibi_slopes(HQ, 0.0).astype(np.float32)
    out = np.empty((B, n, HQ, D), np.float32)
    benchmark.extra_info["flops_convention"] = "4*B*Hq*Nq*Nkv*D/2 (causal)"
    measure(benchmark, lambda: _attention_tiled.run_tiled(q, kk, vv, mm, slopes, None, D ** -0.5, 0.0, out),
            group=group(n, kv_dtype), threads=threads, flops=causal_flops(n), rounds=ROUNDS[n])


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_one_chunk(benchmark, n, kv_dtype, threads):
    if importlib.util.find_spec("fastattn.attention.api") is None:
        pytest.skip("fastattn.attention (the one_chunk path) is not in this tree")
    from fastattn.attention.api import flash_attn_ext

    q, k, v, mask = inputs(n, kv_dtype)
    out = np.empty((B, n, HQ, D), np.float32)
    measure(benchmark, lambda: flash_attn_ext(q, k, v, mask, scale=D ** -0.5, path="one_chunk", out=out),
            group=group(n, kv_dtype), threads=threads, flops=causal_flops(n), rounds=ROUNDS[n])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda d: np.dtype(d).name)
def test_reference(benchmark, kv_dtype):
    from fastattn.reference import flash_attn_ext

    n = LAYER.n_prefill
    q, k, v, mask = inputs(n, kv_dtype)
    measure(benchmark, lambda: flash_attn_ext(q, k, v, mask, scale=D ** -0.5), group=group(n, kv_dtype),
            threads=1, flops=causal_flops(n), rounds=2)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_torch_sdpa(benchmark, n, kv_dtype, threads):
    torch = torch_or_none()
    if torch is None:
        pytest.skip("torch is not installed")
    q, k, v, _ = inputs(n, kv_dtype)
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a, np.float32)) for a in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    measure(benchmark, lambda: sdpa(tq, tk, tv, is_causal=True, enable_gqa=True), group=group(n, kv_dtype),
            threads=threads, flops=causal_flops(n), rounds=ROUNDS[n])

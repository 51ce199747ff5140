"""Main-job cases for ``flash_attn_ext``: a causal prefill and a decode step of a Llama-like layer.

K/V are float16 (a KV cache as llama.cpp keeps it by default); the decode case reads Nkv 512 rows, the smallest
context at which ggml (and ``auto``) takes the split-KV path. The check allows 1e-4 absolute error: outputs are
softmax-weighted averages of O(1) values, and float32 accumulation with a polynomial exp stays well inside it
(the tests apply the SPEC's stricter rule on many shapes).
"""
from __future__ import annotations

import numpy as np

from .. import flash_attn_ext
from .. import reference
from . import Case, Config, compare_arrays, register


def _causal_mask(n_q: int, n_kv: int) -> np.ndarray:
    rows = np.arange(n_q)[:, None]
    cols = np.arange(n_kv)[None, :]
    return np.where(cols > rows + (n_kv - n_q), -np.inf, 0.0).astype(np.float16)


@register("attention")
def build(config: Config, rng: np.random.Generator) -> list[Case]:
    Hq, Hkv, D = config.n_head, config.n_head_kv, config.head_dim
    scale = D ** -0.5
    check = compare_arrays(lambda ref: 1e-4 * max(1.0, float(np.abs(ref).max())))
    cases = []

    n = config.n_prefill
    q = rng.standard_normal((1, Hq, n, D)).astype(np.float32)
    k = rng.standard_normal((1, Hkv, n, D)).astype(np.float16)
    v = rng.standard_normal((1, Hkv, n, D)).astype(np.float16)
    mask = _causal_mask(n, n)
    out = np.empty((1, n, Hq, D), np.float32)
    live_pairs = n * (n + 1) // 2  # causal: query i sees keys 0..i
    cases.append(Case(
        "attention", f"prefill {n} causal {Hq}/{Hkv}x{D} f16 KV", "auto",
        fast=lambda: flash_attn_ext(q, k, v, mask, scale=scale, out=out),
        reference=lambda: reference.flash_attn_ext(q, k, v, mask, scale=scale),
        check=check, flops=4.0 * Hq * D * live_pairs))

    n_kv = 512
    qd = rng.standard_normal((1, Hq, 1, D)).astype(np.float32)
    kd = rng.standard_normal((1, Hkv, n_kv, D)).astype(np.float16)
    vd = rng.standard_normal((1, Hkv, n_kv, D)).astype(np.float16)
    out_d = np.empty((1, 1, Hq, D), np.float32)
    for path in ("auto", "split_kv"):
        cases.append(Case(
            "attention", f"decode Nkv {n_kv} {Hq}/{Hkv}x{D} f16 KV", path,
            fast=lambda path=path: flash_attn_ext(qd, kd, vd, scale=scale, path=path, out=out_d),
            reference=lambda: reference.flash_attn_ext(qd, kd, vd, scale=scale),
            check=check, nbytes=kd.nbytes + vd.nbytes))
    return cases

"""Main-job cases for ``flash_attn_ext``: a causal prefill and a decode step of a Llama-like layer.

K/V are float16 (a KV cache as llama.cpp keeps it by default); the decode cases read ``Config.decode_n_kv`` (512)
rows, the smallest context at which ggml takes the split-KV path, and once more from a Q8_0 cache
(llama.cpp's ``-ctk q8_0 -ctv q8_0``). Checked by ``fastattn.testing``'s rule against a straightforward float32
evaluation (on the dequantized values for Q8_0), with the attention tests' floor.
"""
from __future__ import annotations

import numpy as np

from .. import flash_attn_ext
from .. import reference
from . import Case, Config, register
from .checks import float32_rule

#: The rule's absolute floor: outputs are convex combinations of V rows of magnitude ~1 (as the attention tests).
FLOOR = 2e-6


def _causal_mask(n_q: int, n_kv: int) -> np.ndarray:
    rows = np.arange(n_q)[:, None]
    cols = np.arange(n_kv)[None, :]
    return np.where(cols > rows + (n_kv - n_q), -np.inf, 0.0).astype(np.float16)


def naive_f32(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float) -> np.ndarray:
    """softmax(scale q kᵀ + mask) v in plain float32 NumPy, per query head (GQA: head h reads KV head
    h // (Hq // Hkv)). q (1, Hq, Nq, D), k and v (1, Hkv, Nkv, D), mask (Nq, Nkv) or None -> (1, Nq, Hq, D)."""
    f32 = np.float32
    _, hq, nq, _ = q.shape
    group = hq // k.shape[1]
    out = np.empty((1, nq, hq, v.shape[3]), f32)
    m = None if mask is None else mask.astype(f32)
    for h in range(hq):
        scores = (q[0, h] @ k[0, h // group].astype(f32).T) * f32(scale)
        if m is not None:
            scores = scores + m
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[0, :, h] = (weights @ v[0, h // group].astype(f32)) / weights.sum(axis=1, keepdims=True)
    return out


@register("attention")
def build(config: Config, rng: np.random.Generator) -> list[Case]:
    Hq, Hkv, D = config.n_head, config.n_head_kv, config.head_dim
    scale = D ** -0.5
    cases = []

    n = config.n_prefill
    q = rng.standard_normal((1, Hq, n, D)).astype(np.float32)
    k = rng.standard_normal((1, Hkv, n, D)).astype(np.float16)
    v = rng.standard_normal((1, Hkv, n, D)).astype(np.float16)
    mask = _causal_mask(n, n)
    out = np.empty((1, n, Hq, D), np.float32)
    live_pairs = n * (n + 1) // 2  # causal: query i sees keys 0..i
    cases.append(Case(
        "flash_attn_ext", f"prefill {n} causal {Hq}/{Hkv}x{D} f16 KV", "auto",
        fast=lambda: flash_attn_ext(q, k, v, mask, scale=scale, out=out),
        reference=lambda: reference.flash_attn_ext(q, k, v, mask, scale=scale),
        check=float32_rule(naive_f32(q, k, v, mask, scale), FLOOR), flops=4.0 * Hq * D * live_pairs,
        dtype="float16"))

    n_kv = config.decode_n_kv
    qd = rng.standard_normal((1, Hq, 1, D)).astype(np.float32)
    kd = rng.standard_normal((1, Hkv, n_kv, D)).astype(np.float16)
    vd = rng.standard_normal((1, Hkv, n_kv, D)).astype(np.float16)
    out_d = np.empty((1, 1, Hq, D), np.float32)
    check = float32_rule(naive_f32(qd, kd, vd, None, scale), FLOOR)
    for path in ("auto", "split_kv"):
        cases.append(Case(
            "flash_attn_ext", f"decode Nkv {n_kv} {Hq}/{Hkv}x{D} f16 KV", path,
            fast=lambda path=path: flash_attn_ext(qd, kd, vd, scale=scale, path=path, out=out_d),
            reference=lambda: reference.flash_attn_ext(qd, kd, vd, scale=scale),
            check=check, nbytes=kd.nbytes + vd.nbytes,
            dtype="float16"))

    # the reference quantizer (NumPy; the same bytes as fastattn.quantize): building the case compiles nothing
    kq = reference.quantize(kd, "q8_0")
    vq = reference.quantize(vd, "q8_0")
    cases.append(Case(
        "flash_attn_ext", f"decode Nkv {n_kv} {Hq}/{Hkv}x{D} q8_0 KV", "auto",
        fast=lambda: flash_attn_ext(qd, kq, vq, scale=scale, out=out_d),
        reference=lambda: reference.flash_attn_ext(qd, kq, vq, scale=scale),
        check=float32_rule(naive_f32(qd, reference.dequantize(kq), reference.dequantize(vq), None, scale), FLOOR),
        nbytes=kq.data.nbytes + vq.data.nbytes, dtype="q8_0"))
    return cases

"""Main-job cases for RoPE on a Llama-3-8B-like layer: NEOX prefill, in place on Q inside a fused QKV buffer, a
decode step with a prebuilt cos/sin cache, and the fused RoPE -> float16 KV-cache write.

Checks are ``fastattn.testing``'s rule: float32 results within 2x the error of a straightforward float32 NumPy
evaluation plus a small floor; float16 results within 1 ulp of the correctly rounded value.
"""
from __future__ import annotations

import numpy as np

from . import Case, Config, register
from .checks import float32_rule, half_1ulp

#: absolute floor of the rule, per unit of |x| (a few float32 roundings)
_FLOOR = 4e-7


def _naive_f32_neox(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """NEOX in float32 NumPy, angles included: the baseline of the contract's rule."""
    d = x.shape[-1]
    inv_freq = (np.float32(base) ** (-np.arange(0, d, 2, dtype=np.float32) / np.float32(d))).astype(np.float32)
    theta = pos.astype(np.float32)[:, None] * inv_freq
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., :d // 2].astype(np.float32), x[..., d // 2:].astype(np.float32)
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def _rule(x: np.ndarray, pos: np.ndarray, base: float):
    """The rule against the float32 NEOX evaluation, with a floor of a few float32 roundings of |x|."""
    return float32_rule(_naive_f32_neox(x, pos, base), _FLOOR * (1 + float(np.abs(x).max())))


@register("rope")
def rope_cases(config: Config, rng: np.random.Generator) -> list[Case]:
    import fastattn
    from .. import reference as ref

    n, h, h_kv, d, base = config.n_prefill, config.n_head, config.n_head_kv, config.head_dim, config.rope_base
    neox = dict(n_dims=d, mode=fastattn.ROPE_NEOX, freq_base=base)
    pos = np.arange(n, dtype=np.int32)
    cases = []

    x = rng.standard_normal((n, h, d)).astype(np.float32)
    out = np.empty_like(x)
    cases.append(Case("rope_ext", f"({n},{h},{d}) f32", "neox out of place",
                      fast=lambda: fastattn.rope_ext(x, pos, **neox, out=out),
                      reference=lambda: ref.rope_ext(x, pos, **neox, out=np.empty(x.shape)),
                      check=_rule(x, pos, base), nbytes=2 * x.nbytes, kernels="rope_ext"))

    # Q inside the fused QKV projection output, rotated in place. The first (checked) call rotates the original
    # values; timing calls keep rotating the same buffer.
    qkv = rng.standard_normal((n, (h + 2 * h_kv) * d)).astype(np.float32)
    q = qkv[:, :h * d].reshape(n, h, d)
    q0 = q.copy()
    cases.append(Case("rope_ext", f"({n},{h},{d}) f32", "neox in place, fused QKV view",
                      fast=lambda: fastattn.rope_ext(q, pos, **neox, out=q),
                      reference=lambda: ref.rope_ext(q0, pos, **neox, out=np.empty(q0.shape)),
                      check=_rule(q0, pos, base), nbytes=2 * q.nbytes, kernels="rope_ext"))

    # decode: one cache for the step, applied in place (to Q; K is the same call). The cache is built by the
    # case's first call, so building the cases compiles nothing and that first call counts the table's kernel.
    step = np.array([n], np.int32)
    cache = []
    xq = rng.standard_normal((1, h, d)).astype(np.float32)
    xq0 = xq.copy()

    def apply_decode():
        if not cache:
            cache.append(fastattn.rope_cache(step, **neox))
        return fastattn.apply_rope_cache(xq, cache[0], out=xq)

    cases.append(Case("apply_rope_cache", f"(1,{h},{d}) f32", "decode, prebuilt cache, in place",
                      fast=apply_decode,
                      reference=lambda: ref.rope_ext(xq0, step, **neox, out=np.empty(xq0.shape)),
                      check=_rule(xq0, step, base), nbytes=2 * xq.nbytes))

    # fused RoPE -> float16 KV cache write of K
    k = rng.standard_normal((n, h_kv, d)).astype(np.float32)
    kv_cache = np.zeros((2 * n, h_kv * d), np.float16)
    idx = np.arange(n, dtype=np.int64) + n // 2

    def fused():
        fastattn.rope_set_rows(kv_cache, k, pos, idx, **neox)
        return kv_cache[idx].reshape(n, h_kv, d)

    cases.append(Case("rope_set_rows", f"K ({n},{h_kv},{d}) -> f16", "fused",
                      fast=fused, reference=lambda: ref.rope_ext(k, pos, **neox, out=np.empty(k.shape)),
                      check=half_1ulp(), nbytes=k.nbytes + n * h_kv * d * 2))
    return cases

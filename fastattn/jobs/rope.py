"""Main-job cases for RoPE on a Llama-3-8B-like layer, in every RoPE mode: NEOX prefill (out of place, and in place
on Q inside a fused QKV buffer), a decode step with a prebuilt cos/sin cache, the fused RoPE -> float16 KV-cache
writes (prefill from the positions, decode from a prebuilt cache), NORMAL (GPT-J pairs) on a decode row, and the
multimodal modes on the tokens of a small image: MROPE (Qwen2-VL text layers, with its ``rope_cache`` table),
IMROPE (Qwen3-VL) and VISION (Qwen2-VL's vision encoder).

The multimodal cases are small (below the parallel size): with the decode case they share the serial table
kernels, so they add timing but hardly any compile time to the job.

Checks are ``fastattn.testing``'s rule: float32 results within 2x the error of a straightforward float32 NumPy
evaluation plus a small floor; float16 results within 1 ulp of the correctly rounded value.
"""
from __future__ import annotations

import numpy as np

from . import Case, Config, register
from .checks import float32_rule, half_1ulp

#: absolute floor of the rule, per unit of |x| (a few float32 roundings)
_FLOOR = 4e-7
#: The image of the multimodal cases: a grid of GRID x GRID patches (tokens), after TEXT tokens of text.
GRID, TEXT = 4, 12


def _naive_angles(pos: np.ndarray, kwargs: dict) -> np.ndarray:
    """theta (N, n_pairs) in float32 NumPy for positions (N,) or (4, N): each pair's stream and exponent as the
    reference assigns them for the mode (its sections), the products in float32."""
    from ..reference import rope as ref_rope

    params = ref_rope.rope_cache(pos, **kwargs).params
    streams, exponents = ref_rope.pair_streams_and_exponents(params)
    pos2 = np.asarray(pos).reshape(-1, np.shape(pos)[-1])
    theta = np.empty((pos2.shape[1], params.n_pairs), np.float32)
    for p in range(params.n_pairs):
        inv_freq = np.float32(params.freq_base ** (-2.0 * exponents[p] / params.n_dims))
        theta[:, p] = pos2[streams[p]].astype(np.float32) * inv_freq
    return theta


def _naive_f32(x: np.ndarray, pos: np.ndarray, kwargs: dict) -> np.ndarray:
    """RoPE of x (N, H, D) in float32 NumPy, angles included: the baseline of the contract's rule. Pairs (2p, 2p+1)
    for NORMAL, (p, p + n_pairs) for the other modes (VISION: n_pairs = n_dims, the whole head)."""
    theta = _naive_angles(pos, kwargs)
    n = theta.shape[1]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    first, second = ((np.arange(0, 2 * n, 2), np.arange(1, 2 * n, 2)) if kwargs["mode"] == 0
                     else (np.arange(n), np.arange(n, 2 * n)))
    xf = x.astype(np.float32)
    out = xf.copy()
    out[..., first] = xf[..., first] * c - xf[..., second] * s
    out[..., second] = xf[..., first] * s + xf[..., second] * c
    return out


def _rule(x: np.ndarray, pos: np.ndarray, kwargs: dict):
    """The rule against the float32 evaluation, with a floor of a few float32 roundings of |x|."""
    return float32_rule(_naive_f32(x, pos, kwargs), _FLOOR * (1 + float(np.abs(x).max())))


def _reference_table(pos: np.ndarray, kwargs: dict) -> np.ndarray:
    """The reference's cos/sin table, laid out as ``fastattn.rope_cache``'s: cos then sin of each token's pairs."""
    from .. import reference as ref

    table = ref.rope_cache(pos, **kwargs)
    return np.concatenate([table.cos, table.sin], axis=1)


def _image_positions() -> np.ndarray:
    """(4, GRID²) positions of an image's patches after TEXT text tokens, as Qwen2-VL numbers them: t the image's
    place in the sequence, h and w the patch's row and column offset from it, e unused."""
    rows, cols = np.divmod(np.arange(GRID * GRID, dtype=np.int32), GRID)
    t = np.full_like(rows, TEXT)
    return np.stack([t, TEXT + rows, TEXT + cols, np.zeros_like(rows)])


@register("rope")
def rope_cases(config: Config, rng: np.random.Generator) -> list[Case]:
    import fastattn
    from .. import reference as ref

    n, h, h_kv, d, base = config.n_prefill, config.n_head, config.n_head_kv, config.head_dim, config.rope_base
    neox = dict(n_dims=d, mode=fastattn.ROPE_NEOX, freq_base=base)
    f32 = dict(dtype="float32", mode="NEOX")
    pos = np.arange(n, dtype=np.int32)
    cases = []

    x = rng.standard_normal((n, h, d)).astype(np.float32)
    out = np.empty_like(x)
    cases.append(Case("rope_ext", f"({n},{h},{d}) f32", "neox out of place",
                      fast=lambda: fastattn.rope_ext(x, pos, **neox, out=out),
                      reference=lambda: ref.rope_ext(x, pos, **neox, out=np.empty(x.shape)),
                      check=_rule(x, pos, neox), nbytes=2 * x.nbytes, **f32))

    # Q inside the fused QKV projection output, rotated in place. The first (checked) call rotates the original
    # values; timing calls keep rotating the same buffer.
    qkv = rng.standard_normal((n, (h + 2 * h_kv) * d)).astype(np.float32)
    q = qkv[:, :h * d].reshape(n, h, d)
    q0 = q.copy()
    cases.append(Case("rope_ext", f"({n},{h},{d}) f32", "neox in place, fused QKV view",
                      fast=lambda: fastattn.rope_ext(q, pos, **neox, out=q),
                      reference=lambda: ref.rope_ext(q0, pos, **neox, out=np.empty(q0.shape)),
                      check=_rule(q0, pos, neox), nbytes=2 * q.nbytes, **f32))

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
                      check=_rule(xq0, step, neox), nbytes=2 * xq.nbytes, **f32))

    # fused RoPE -> float16 KV cache write of K
    k = rng.standard_normal((n, h_kv, d)).astype(np.float32)
    kv_cache = np.zeros((2 * n, h_kv * d), np.float16)
    idx = np.arange(n, dtype=np.int64) + n // 2

    def fused():
        fastattn.rope_set_rows(kv_cache, k, pos, idx, **neox)
        return kv_cache[idx].reshape(n, h_kv, d)

    cases.append(Case("rope_set_rows", f"K ({n},{h_kv},{d}) -> f16", "fused",
                      fast=fused, reference=lambda: ref.rope_ext(k, pos, **neox, out=np.empty(k.shape)),
                      check=half_1ulp(), nbytes=k.nbytes + n * h_kv * d * 2, dtype="float16", mode="NEOX"))

    # decode: K rotated by the step's prebuilt cache straight into its float16 cache row
    k1 = rng.standard_normal((1, h_kv, d)).astype(np.float32)
    kv_rows = np.zeros((config.kv_cache_rows, h_kv, d), np.float16)
    row = np.array([n], np.int64)
    step_cache = []

    def fused_decode():
        if not step_cache:
            step_cache.append(fastattn.rope_cache(step, **neox))
        fastattn.apply_rope_cache_set_rows(kv_rows, k1, step_cache[0], row)
        return kv_rows[row]

    cases.append(Case("apply_rope_cache_set_rows", f"K (1,{h_kv},{d}) -> f16", "decode, prebuilt cache",
                      fast=fused_decode, reference=lambda: ref.rope_ext(k1, step, **neox, out=np.empty(k1.shape)),
                      # its first call builds the step's table, as the "table" cases do: one task compiles it once
                      check=half_1ulp(), nbytes=k1.nbytes + h_kv * d * 2, dtype="float16",
                      mode="NEOX"))

    return cases + _mode_cases(config, rng, step)


def _mode_cases(config: Config, rng: np.random.Generator, step: np.ndarray) -> list[Case]:
    """The RoPE modes other than NEOX: NORMAL on a decode row, and the multimodal modes on an image's patches."""
    import fastattn
    from .. import reference as ref

    h, d = config.n_head, config.head_dim
    cases = []
    # NORMAL: GPT-J's adjacent pairs, on a decode row of Q
    normal = dict(n_dims=d, mode=fastattn.ROPE_NORMAL, freq_base=10000.0)
    xn = rng.standard_normal((1, h, d)).astype(np.float32)
    out_n = np.empty_like(xn)
    cases.append(Case("rope_ext", f"(1,{h},{d}) f32", "normal, decode",
                      fast=lambda: fastattn.rope_ext(xn, step, **normal, out=out_n),
                      reference=lambda: ref.rope_ext(xn, step, **normal, out=np.empty(xn.shape)),
                      check=_rule(xn, step, normal), nbytes=2 * xn.nbytes, dtype="float32",
                      mode="NORMAL"))

    # The multimodal modes on an image's patches: Qwen2-VL's text layers (MROPE, sections of pairs for t, h, w),
    # Qwen3-VL's (IMROPE, t/h/w interleaved) and Qwen2-VL's vision encoder (VISION: head dim 80, all of it
    # rotated, h and w streams).
    image = _image_positions()
    tokens = image.shape[1]
    vision_pos = np.stack([image[1], image[2], image[1], image[2]])
    for name, kwargs, heads, head_dim, pos4 in (
            ("MROPE", dict(n_dims=d, mode=fastattn.ROPE_MROPE, freq_base=1e6, sections=(16, 24, 24, 0)), h, d,
             image),
            ("IMROPE", dict(n_dims=d, mode=fastattn.ROPE_IMROPE, freq_base=5e6, sections=(24, 20, 20, 0)), h, d,
             image),
            ("VISION", dict(n_dims=40, mode=fastattn.ROPE_VISION, freq_base=1e4, sections=(20, 20, 0, 0)), 16, 80,
             vision_pos)):
        xm = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
        out_m = np.empty_like(xm)
        cases.append(Case("rope_ext", f"({tokens},{heads},{head_dim}) f32", f"{name.lower()}, {GRID}x{GRID} image",
                          fast=lambda xm=xm, out_m=out_m, kwargs=kwargs, pos4=pos4: fastattn.rope_ext(
                              xm, pos4, **kwargs, out=out_m),
                          reference=lambda xm=xm, kwargs=kwargs, pos4=pos4: ref.rope_ext(
                              xm, pos4, **kwargs, out=np.empty(xm.shape)),
                          check=_rule(xm, pos4, kwargs), nbytes=2 * xm.nbytes, dtype="float32",
                          mode=name))
        if name == "MROPE":  # the table itself: cos then sin of every pair, built once for Q and K of these tokens
            theta = _naive_angles(pos4, kwargs)
            cases.append(Case(
                "rope_cache", f"({tokens}, 2x{theta.shape[1]}) f32", f"mrope, {GRID}x{GRID} image",
                fast=lambda pos4=pos4, kwargs=kwargs: fastattn.rope_cache(pos4, **kwargs).cs,
                reference=lambda pos4=pos4, kwargs=kwargs: _reference_table(pos4, kwargs),
                check=float32_rule(np.concatenate([np.cos(theta), np.sin(theta)], axis=1), 2 * _FLOOR),
                nbytes=theta.size * 8 + pos4.nbytes, dtype="float32", mode=name))
    return cases

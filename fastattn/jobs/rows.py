"""Main-job cases for SET_ROWS: writing K rows (n_head_kv x head_dim) into a float16 KV cache, prefill and decode,
and a decode row into a bfloat16 one (skipped without ml_dtypes, an optional dependency)."""
from __future__ import annotations

import numpy as np

from . import NO_BFLOAT16, Case, Config, bfloat16_dtype, register, skipped_case
from .checks import bit_exact


@register("set_rows")
def cases(config: Config, rng: np.random.Generator) -> list[Case]:
    import fastattn
    import fastattn.reference as ref

    width, n_cache = config.n_head_kv * config.head_dim, config.kv_cache_rows
    out = []
    for path, rows in (("prefill", config.n_prefill), ("decode", 1)):
        src = rng.standard_normal((rows, width)).astype(np.float32)
        idx = np.sort(rng.permutation(n_cache)[:rows]).astype(np.int64)  # free slots, not necessarily adjacent
        cache = (0.1 * rng.standard_normal((n_cache, width))).astype(np.float16)
        fast_cache, ref_cache = cache.copy(), cache.copy()
        # an explicit bound: a copy with one float32 -> float16 rounding is exactly defined
        out.append(Case("set_rows", f"{rows} x {width} f32 -> f16 ({n_cache}, {width})", path,
                        fast=lambda c=fast_cache, s=src, i=idx: fastattn.set_rows(c, s, i),
                        reference=lambda c=ref_cache, s=src, i=idx: ref.set_rows(c, s, i),
                        check=bit_exact(), nbytes=src.nbytes + rows * width * 2, dtype="float16"))

    shape, path = f"1 x {width} f32 -> bf16 ({n_cache}, {width})", "decode"
    bf16 = bfloat16_dtype()
    if bf16 is None:
        out.append(skipped_case("set_rows", shape, path, NO_BFLOAT16, dtype="bfloat16"))
        return out
    src = rng.standard_normal((1, width)).astype(np.float32)
    idx = np.array([n_cache // 2], np.int64)
    cache = (0.1 * rng.standard_normal((n_cache, width))).astype(bf16)
    fast_cache, ref_cache = cache.copy(), cache.copy()
    # one float32 -> bfloat16 rounding (to nearest even) per value: exactly defined
    out.append(Case("set_rows", shape, path, fast=lambda: fastattn.set_rows(fast_cache, src, idx),
                    reference=lambda: ref.set_rows(ref_cache, src, idx), check=bit_exact(),
                    nbytes=src.nbytes + width * 2, dtype="bfloat16"))
    return out

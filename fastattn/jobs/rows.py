"""Main-job cases for SET_ROWS: writing K rows (n_head_kv x head_dim) into a float16 KV cache."""
from __future__ import annotations

import numpy as np

from . import Case, Config, register
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
                        check=bit_exact(), nbytes=src.nbytes + rows * width * 2))
    return out

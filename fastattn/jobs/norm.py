"""Main-job cases for the RMSNorm family on a Llama layer: the norm before attention / FFN, prefill and decode,
and the plain norm (no weight: Q/K norms without a scale, ggml's ``rms_norm`` op) on a decode row."""
from __future__ import annotations

import numpy as np

from . import Case, Config, register
from .checks import bit_exact, both, float32_rule

#: The rule's absolute floor: outputs are O(|w|), a few float32 roundings of that (as tests/test_norm.py).
FLOOR = 1e-6


def naive_f32(s: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """The straightforward float32 NumPy evaluation the rule measures against: s (rows, D), w (D,) float32 or
    None (no weight)."""
    y = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + np.float32(eps))
    return y if w is None else y * w


@register("norm")
def cases(config: Config, rng: np.random.Generator) -> list[Case]:
    import fastattn
    import fastattn.reference as ref

    d, eps = config.hidden, config.eps
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    out = []
    for path, rows in (("prefill", config.n_prefill), ("decode", 1)):
        x = rng.standard_normal((rows, d)).astype(np.float32)
        y, y64 = np.empty_like(x), np.empty(x.shape)
        out.append(Case("rms_norm_mul", f"({rows}, {d}) f32", path,
                        fast=lambda x=x, y=y: fastattn.rms_norm_mul(x, w, eps, out=y),
                        reference=lambda x=x, y64=y64: ref.rms_norm_mul(x, w, eps, out=y64),
                        check=float32_rule(naive_f32(x, w, eps), FLOOR), nbytes=2 * x.nbytes + w.nbytes,
                        dtype="float32"))

    x = rng.standard_normal((1, d)).astype(np.float32)
    y, y64 = np.empty_like(x), np.empty(x.shape)
    out.append(Case("rms_norm", f"(1, {d}) f32", "decode", fast=lambda x=x, y=y: fastattn.rms_norm(x, eps, out=y),
                    reference=lambda x=x, y64=y64: ref.rms_norm(x, eps, out=y64),
                    check=float32_rule(naive_f32(x, None, eps), FLOOR),
                    nbytes=2 * x.nbytes, dtype="float32"))

    rows = config.n_prefill
    x, residual = (rng.standard_normal((rows, d)).astype(np.float32) for _ in range(2))
    s, y, s64, y64 = np.empty_like(x), np.empty_like(x), np.empty(x.shape), np.empty(x.shape)
    # the sum is rounded once to float32, so it must be exact; y by the rule
    check = both(bit_exact(), float32_rule(naive_f32(x + residual, w, eps), FLOOR), "sum {}; y {}")
    out.append(Case("add_rms_norm_mul", f"({rows}, {d}) f32", "prefill",
                    fast=lambda: fastattn.add_rms_norm_mul(x, residual, w, eps, out=y, sum_out=s),
                    reference=lambda: ref.add_rms_norm_mul(x, residual, w, eps, out=y64, sum_out=s64),
                    check=check, nbytes=4 * x.nbytes + w.nbytes, dtype="float32"))
    return out

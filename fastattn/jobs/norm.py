"""Main-job cases for the RMSNorm family on a Llama layer: the norm before attention / FFN, prefill and decode."""
from __future__ import annotations

import numpy as np

from . import Case, Config, register


def _naive_f32(s: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The straightforward float32 NumPy evaluation the SPEC's rule measures against."""
    return s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + np.float32(eps)) * w


def _rule(naive: np.ndarray, floor: float = 1e-6):
    """check(fast y, float64 reference y): max error <= 2 x the naive float32 error + floor."""
    def check(fast, reference):
        error = float(np.max(np.abs(fast.astype(np.float64) - reference)))
        return error, error <= 2 * float(np.max(np.abs(naive - reference))) + floor
    return check


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
                        check=_rule(_naive_f32(x, w, eps)), nbytes=2 * x.nbytes + w.nbytes))

    rows = config.n_prefill
    x, residual = (rng.standard_normal((rows, d)).astype(np.float32) for _ in range(2))
    s, y, s64, y64 = np.empty_like(x), np.empty_like(x), np.empty(x.shape), np.empty(x.shape)
    naive_y = _naive_f32(x + residual, w, eps)

    def check_add(fast, reference):
        (fs, fy), (rs, ry) = fast, reference
        error, ok = _rule(naive_y)(fy, ry)
        return error, ok and fs.tobytes() == rs.astype(np.float32).tobytes()  # the sum: rounded once, exact

    out.append(Case("add_rms_norm_mul", f"({rows}, {d}) f32", "prefill",
                    fast=lambda: fastattn.add_rms_norm_mul(x, residual, w, eps, out=y, sum_out=s),
                    reference=lambda: ref.add_rms_norm_mul(x, residual, w, eps, out=y64, sum_out=s64),
                    check=check_add, nbytes=4 * x.nbytes + w.nbytes))
    return out

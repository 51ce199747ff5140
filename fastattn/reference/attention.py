"""Attention with ggml's ``flash_attn_ext`` semantics, in float64 NumPy: the definition the fast paths match.

For query batch b, query head h, query row i (GQA: KV head h // (Hq // Hkv); KV batch b // (B // Bk)):

    s_j   = scale * q_i . k_j                        (j over the Nkv key rows)
    s_j   = softcap * tanh(s_j / softcap)            when logit_softcap != 0
    s_j  += slope_h * mask[b % Bm, h % Hm, i, j]     slope_h: ALiBi when max_bias > 0, else 1
    M     = max(max_j s_j, sink_h)                   sink_h = -inf without sinks
    out_i = sum_j exp(s_j - M) v_j / (sum_j exp(s_j - M) + exp(sink_h - M))

Key j is hidden from query row i of head h when its mask entry is exactly -inf (whatever the slope): then s_j is
-inf and neither k_j nor v_j is read, so a NaN there (an unwritten cache cell) cannot matter. A NaN anywhere else
(q, a key or value row that is not hidden, the mask, a sink) propagates to the outputs it reaches. A row whose
scores are all -inf (and no sink) gives zeros. The result is laid out (B, Nq, Hq, DV), ggml's permuted output.
"""
from __future__ import annotations

import numpy as np

from ..attention import args as args_attention
from ..quant.blocks import Quantized

from .quant import dequantize

FLOAT64 = np.dtype(np.float64)


def flash_attn_ext(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                   scale: float | None = None, max_bias: float = 0.0, logit_softcap: float = 0.0,
                   sinks: np.ndarray | None = None, path: str = "auto", out: np.ndarray | None = None
                   ) -> np.ndarray:
    """softmax(scale·QKᵀ [softcap] + slope·mask, sinks) V, in float64; returns float32 (or fills ``out``).

    q (B, Hq, Nq, DK) float32; k (Bk, Hkv, Nkv, DK), v (Bk, Hkv, Nkv, DV) float32/float16/bfloat16 or
    ``Quantized`` (Q8_0 / Q4_0: their dequantized values); at most 256 heads (token-major arrays are refused, see
    ``fastattn.flash_attn_ext``); ``scale`` defaults to DK^-0.5;
    mask broadcastable as ggml (..., >= Nq rows, Nkv columns); sinks (Hq,) float32; ``path`` is accepted
    for signature parity with ``fastattn.flash_attn_ext`` and ignored. ``out`` (B, Nq, Hq, DV) float32 or float64.
    """
    a = args_attention.parse(q, k, v, mask, scale, max_bias, logit_softcap, sinks, path, out,
                             out_dtypes=(np.float32, np.float64))
    B, Hq, Nq, _ = q.shape
    Bk, Hkv = k.shape[:2]
    k = dequantize(k) if isinstance(k, Quantized) else k
    v = dequantize(v) if isinstance(v, Quantized) else v
    slopes = args_attention.alibi_slopes(Hq, a.max_bias)
    result = np.zeros(a.out_shape, FLOAT64)
    # NaN and inf inputs give NaN quietly, as in the kernels; a row with nothing live divides 0 by 0 (then zeroed)
    with np.errstate(invalid="ignore"):
        for b in range(B):
            for h in range(Hq):
                kb, kh = b // (B // Bk), h // (Hq // Hkv)
                keys = k[kb, kh].astype(FLOAT64)
                values = v[kb, kh].astype(FLOAT64)
                scores = a.scale * (q[b, h].astype(FLOAT64) @ keys.T)  # (Nq, Nkv)
                if a.logit_softcap != 0.0:
                    scores = a.logit_softcap * np.tanh(scores / a.logit_softcap)
                seen = np.ones(scores.shape, bool)
                if a.mask is not None:
                    m = a.mask[b % a.mask.shape[0], h % a.mask.shape[1], :Nq].astype(FLOAT64)
                    seen = m != -np.inf
                    scores = np.where(seen, scores + slopes[h] * m, -np.inf)
                sink = -np.inf if a.sinks is None else float(a.sinks[h])
                top = np.maximum(scores.max(axis=1, initial=-np.inf), sink)  # NaN when a score or the sink is NaN
                weights = np.where(seen, np.exp(scores - top[:, None]), 0.0)  # (Nq, Nkv); 0 where hidden
                denominator = weights.sum(axis=1) + np.exp(sink - top)
                # sum_j weight_ij v_j over the keys row i sees: a V row holding inf or NaN is added only to the
                # rows that see it (0 * inf would make NaN of the others), every other row by one product
                finite = np.isfinite(values).all(axis=1)
                sums = weights @ np.where(finite[:, None], values, 0.0)
                for j in np.flatnonzero(~finite):
                    sums[seen[:, j]] += weights[seen[:, j], j, None] * values[j]
                live = top != -np.inf  # every score masked and no sink: zeros
                result[b, :, h] = np.where(live[:, None], sums / denominator[:, None], 0.0)
    if out is None:
        return result.astype(np.float32)
    out[...] = result
    return out

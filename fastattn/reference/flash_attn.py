"""FlashAttention's API, the definition in float64 NumPy: ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``, with the signatures of ``fastattn.integrations.flash_attn``.

For every sequence (a batch entry, a varlen sequence, a batch entry's live cache rows [cache_leftpad,
cache_seqlens + seqlen_new)), ``attend`` evaluates the score rule of ``fastattn.attention.flash_args`` in float64:

    s_ij  = scale · q_i.k_j                       (query head h reads KV head h // (H / Hk))
    s_ij  = softcap · tanh(s_ij / softcap)        when softcap > 0
    s_ij -= slope_h · |d_ij|                      with ALiBi, d_ij = j - (i + Sk - Sq)
    out_i = sum_j exp(s_ij - M) v_j / sum_j exp(s_ij - M)   over the visible keys j (the window, causal)
    lse_i = M + log(sum_j exp(s_ij - M))          (+inf for a row with no visible key, whose output is 0)

A hidden key's K and V rows are never read (a NaN there cannot matter). A paged cache's rows are gathered through
``block_table`` (the definition; the fast side reads them in place). ``flash_attn_with_kvcache`` first writes the
new rows in place at cache_seqlens (K rotated in float64 with the given tables, then rounded once to the cache's
dtype; into a ``Quantized`` cache quantized from float32), then attends with the query rotated in float64 (not
rounded). Results are rounded once to q's dtype (float64 inputs give float64 results, the unrounded values); the
logsumexp is float32 (float64 for a float64 q). Arrays may be CPU torch tensors: a torch q gets torch results.
"""
from __future__ import annotations

import numpy as np

from ..attention import flash_args as _args
from ..attention.flash_args import REFERENCE_FLOATS, Scores
from .._core import validate as _validate
from .._core.tensors import tensors_in_tensors_out
from ..quant.blocks import Quantized

from .quant import dequantize, quantize

FLOAT64 = np.dtype(np.float64)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scores: Scores, slopes: np.ndarray | None
           ) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: q (Sq, H, D), k (Sk, Hk, D), v (Sk, Hk, DV) float64 and the score rule; ``slopes`` (H,) with
    ALiBi, else None. Returns out (Sq, H, DV) and lse (H, Sq), float64."""
    sq, heads, _ = q.shape
    sk, heads_k, dv = v.shape
    out = np.zeros((sq, heads, dv))
    lse = np.full((heads, sq), np.inf)
    if sq == 0 or sk == 0:
        return out, lse
    d = np.arange(sk)[None, :] - (np.arange(sq)[:, None] + sk - sq)
    bias = _args.mask_values(d, scores.left, scores.right, slopes is not None)
    seen = bias != -np.inf
    group = heads // heads_k
    # NaN and inf inputs give NaN quietly, as in the kernels; hidden entries are replaced, never read
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for h in range(heads):
            values = v[:, h // group]
            s = scores.scale * (q[:, h] @ k[:, h // group].T)  # (Sq, Sk)
            if scores.softcap != 0.0:
                s = scores.softcap * np.tanh(s / scores.softcap)
            if slopes is not None:
                s = s + float(slopes[h]) * bias
            s = np.where(seen, s, -np.inf)
            top = s.max(axis=1)
            weights = np.where(seen, np.exp(s - top[:, None]), 0.0)
            total = weights.sum(axis=1)
            # a V row holding inf or NaN reaches only the rows that see it (0 * inf would make NaN of the others)
            finite = np.isfinite(values).all(axis=1)
            sums = weights @ np.where(finite[:, None], values, 0.0)
            for j in np.flatnonzero(~finite):
                sums[seen[:, j]] += weights[seen[:, j], j, None] * values[j]
            live = top != -np.inf
            out[:, h] = np.where(live[:, None], sums / total[:, None], 0.0)
            lse[h] = np.where(live, top + np.log(total), np.inf)
    return out, lse


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x (N, H, D) float64 rotated by the table rows cos, sin (N, rotary_dim / 2) in float64: pairs (2p, 2p+1)
    when ``interleaved``, else (p, p + rotary_dim / 2); dims past rotary_dim pass through."""
    n_pairs = cos.shape[1]
    first = np.arange(0, 2 * n_pairs, 2) if interleaved else np.arange(n_pairs)
    second = first + 1 if interleaved else first + n_pairs
    c = cos.astype(FLOAT64)[:, None, :]
    s = sin.astype(FLOAT64)[:, None, :]
    a, b = x[..., first], x[..., second]
    result = x.copy()
    result[..., first] = a * c - b * s
    result[..., second] = a * s + b * c
    return result


def _f64(a) -> np.ndarray:
    return dequantize(a).astype(FLOAT64) if isinstance(a, Quantized) else a.astype(FLOAT64)


def _rounded(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float64 results in q's dtype: bfloat16 through float32, as the kernels narrow from float32."""
    if _validate.is_bfloat16(dtype):
        return a.astype(np.float32).astype(dtype)
    return a.astype(dtype)


def _result(out: np.ndarray, lse: np.ndarray, dtype: np.dtype, return_lse: bool, probs: bool):
    out = _rounded(out, dtype)
    if not return_lse:
        return out
    lse = lse if dtype == FLOAT64 else lse.astype(np.float32)
    return (out, lse, None) if probs else (out, lse)


def _slopes(scores: Scores, b: int) -> np.ndarray | None:
    return None if scores.alibi is None else scores.alibi[b].astype(FLOAT64)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention's ``flash_attn_func``, the definition: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_k, headdim); returns out of q's shape (head size v's) and dtype, and with
    ``return_attn_probs`` (out, softmax_lse (batch, nheads, seqlen_q), None)."""
    a = _args.parse_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_attn_probs, floats=REFERENCE_FLOATS)
    batch, sq, heads, _ = q.shape
    out = np.empty((batch, sq, heads, v.shape[3]))
    lse = np.empty((batch, heads, sq))
    for b in range(batch):
        out[b], lse[b] = attend(_f64(q[b]), _f64(k[b]), _f64(v[b]), a.scores, _slopes(a.scores, b))
    return _result(out, lse, q.dtype, a.return_lse, True)


def paged_rows(cache, block_table: np.ndarray, b: int, start: int, end: int) -> np.ndarray:
    """Rows [start, end) of sequence b of a paged cache (num_blocks, page, Hk, D), gathered, float64."""
    page = cache.shape[1]
    rows = np.arange(start, end)
    blocks = block_table[b, rows // page]
    if isinstance(cache, Quantized):
        return _f64(Quantized(cache.data[blocks, rows % page], cache.qtype))
    return _f64(cache[blocks, rows % page])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """FlashAttention's ``flash_attn_varlen_func``, the definition: packed q (total_q, nheads, headdim), k and v
    (total_k, nheads_k, headdim) or, with ``block_table``, paged caches (num_blocks, page_block_size, nheads_k,
    headdim); returns out (total_q, nheads, headdim_v), and with ``return_attn_probs`` (out, softmax_lse
    (nheads, total_q), None)."""
    a = _args.parse_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                           softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, block_table, floats=REFERENCE_FLOATS)
    out = np.empty((q.shape[0], q.shape[1], v.shape[-1]))
    lse = np.empty((q.shape[1], q.shape[0]))
    for b in range(len(a.q_starts) - 1):
        q0, q1 = a.q_starts[b], a.q_starts[b + 1]
        k0, k1 = a.k_starts[b], a.k_starts[b + 1]
        if a.block_table is None:
            keys, values = _f64(k[k0:k1]), _f64(v[k0:k1])
        else:
            keys = paged_rows(k, a.block_table, b, 0, k1 - k0)
            values = paged_rows(v, a.block_table, b, 0, k1 - k0)
        out[q0:q1], lse[:, q0:q1] = attend(_f64(q[q0:q1]), keys, values, a.scores, _slopes(a.scores, b))
    return _result(out, lse, q.dtype, a.return_lse, True)


def _cache_row(a: _args.KVCache, b: int, row: int) -> tuple[int, int]:
    """(entry, row) of the cache holding logical row ``row`` of batch entry b."""
    if a.block_table is None:
        return a.batch_idx[b], row
    page = a.k_cache.shape[1]
    return int(a.block_table[b, row // page]), row % page


def _append(a: _args.KVCache) -> None:
    """Write k (rotated with the tables when given) and v at rows cache_seqlens + t, in batch then row order."""
    batch, n_new = a.k.shape[:2]
    for cache, new, rotate in ((a.k_cache, a.k, a.rotary is not None), (a.v_cache, a.v, False)):
        for b in range(batch):
            rows = _f64(new[b])  # (Sn, Hk, D)
            positions = a.seqlens[b] + np.arange(n_new)
            if rotate:
                rows = apply_rotary(rows, a.rotary[0][positions], a.rotary[1][positions], a.interleaved)
            if isinstance(cache, Quantized):
                stored = quantize(rows.astype(np.float32), cache.qtype).data
                target = cache.data
            else:
                stored = rows.astype(cache.dtype)
                target = cache
            for t, position in enumerate(positions.tolist()):
                target[_cache_row(a, b, position)] = stored[t]


def _live_rows(a: _args.KVCache, cache, b: int) -> np.ndarray:
    start, end = a.live(b)
    if a.block_table is not None:
        return paged_rows(cache, a.block_table, b, start, end)
    entry = a.batch_idx[b]
    if isinstance(cache, Quantized):
        return _f64(Quantized(cache.data[entry, start:end], cache.qtype))
    return _f64(cache[entry, start:end])


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """FlashAttention's ``flash_attn_with_kvcache``, the definition: append k, v (rotated) in place at
    cache_seqlens, then attend q (batch, seqlen_q, nheads, headdim) over each batch entry's live cache rows.
    Returns out, or (out, softmax_lse (batch, nheads, seqlen_q)) with ``return_softmax_lse``."""
    a = _args.parse_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                            rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
                            floats=REFERENCE_FLOATS)
    if a.k is not None:
        _append(a)
    batch, sq, heads, _ = q.shape
    out = np.empty((batch, sq, heads, v_cache.shape[3]))
    lse = np.empty((batch, heads, sq))
    for b in range(batch):
        query = _f64(q[b])
        if a.rotary is not None:
            positions = a.q_positions(b)
            query = apply_rotary(query, a.rotary[0][positions], a.rotary[1][positions], a.interleaved)
        out[b], lse[b] = attend(query, _live_rows(a, k_cache, b), _live_rows(a, v_cache, b), a.scores,
                                _slopes(a.scores, b))
    return _result(out, lse, q.dtype, a.return_lse, False)


flash_attn_func = tensors_in_tensors_out(flash_attn_func)
flash_attn_varlen_func = tensors_in_tensors_out(flash_attn_varlen_func)
flash_attn_with_kvcache = tensors_in_tensors_out(flash_attn_with_kvcache)

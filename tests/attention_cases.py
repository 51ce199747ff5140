"""Attention test inputs and the naive float32 evaluation the contract's error rule compares against.

Shared by the attention tests: ``naive_f32`` is the formula of ``fastattn/reference/attention.py`` evaluated plainly in
float32 NumPy (the "straightforward float32 evaluation" of ``fastattn.testing``), and ``make_mask`` builds the masks the
contract lists: causal, random -inf blocks (as ggml's test-backend-ops: uniform values in [-1, 1] with masked KV
blocks), fully masked rows and fully masked tiles.
"""
from __future__ import annotations

import numpy as np

from fastattn.attention.args import alibi_slopes

MASK_KINDS = ("none", "causal", "blocks", "rows", "tiles")
#: The error rule's absolute floor: outputs are convex combinations of V rows of magnitude ~1.
FLOOR = 2e-6


def make_mask(rng: np.random.Generator, kind: str, shape, *, tile: tuple[int, int] = (64, 64)) -> np.ndarray:
    """A float64 additive mask of ``shape`` (..., Nm, Nkv) of the given kind (``MASK_KINDS`` minus "none").

    causal: 0 on and below the diagonal aligned to the last KV row, -inf above.  blocks: uniform [-1, 1] with
    random runs of -inf along KV.  rows: random values with some rows entirely -inf.  tiles: random values with
    whole (tile[0] x tile[1]) blocks -inf, one row or column of tiles at least.
    """
    *lead, n_rows, n_kv = shape
    values = rng.uniform(-1.0, 1.0, shape)
    if kind == "causal":
        rows = np.arange(n_rows)[:, None]
        cols = np.arange(n_kv)[None, :]
        return np.broadcast_to(np.where(cols > rows + max(n_kv - n_rows, 0), -np.inf, 0.0), shape).copy()
    if kind == "blocks":
        for _ in range(max(1, n_kv // 8)):
            start = int(rng.integers(0, n_kv))
            length = int(rng.integers(1, max(2, n_kv // 4) + 1))
            row_lo = int(rng.integers(0, n_rows))
            values[..., row_lo:, start:start + length] = -np.inf
        return values
    if kind == "rows":
        dead = rng.random(n_rows) < 0.3
        dead[int(rng.integers(0, n_rows))] = True
        values[..., dead, :] = -np.inf
        return values
    if kind == "tiles":
        tq, tk = tile
        n_tq, n_tk = -(-n_rows // tq), -(-n_kv // tk)
        dead = rng.random((n_tq, n_tk)) < 0.5
        dead[int(rng.integers(0, n_tq)), :] = True  # a Q tile with every KV tile masked: fully masked rows
        dead[:, int(rng.integers(0, n_tk))] = True  # a KV tile masked for every Q tile
        full = np.repeat(np.repeat(dead, tq, axis=0), tk, axis=1)[:n_rows, :n_kv]
        values[..., full] = -np.inf
        return values
    raise ValueError(kind)


def naive_f32(q, k, v, mask, *, scale, max_bias=0.0, logit_softcap=0.0, sinks=None) -> np.ndarray:
    """The reference's formula evaluated straightforwardly in float32 (B, Nq, Hq, DV), with its rule for non-finite
    values: a key whose mask entry is -inf is not read (its score is -inf, its V row left out), NaN elsewhere
    propagates."""
    f32 = np.float32
    B, Hq, Nq, _ = q.shape
    Bk, Hkv = k.shape[:2]
    slopes = alibi_slopes(Hq, max_bias).astype(f32)
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    result = np.zeros((B, Nq, Hq, v.shape[3]), f32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(B):
            for h in range(Hq):
                kb, kh = b // (B // Bk), h // (Hq // Hkv)
                scores = (q[b, h].astype(f32) @ k[kb, kh].astype(f32).T) * f32(scale)
                if logit_softcap != 0.0:
                    scores = f32(logit_softcap) * np.tanh(scores / f32(logit_softcap))
                seen = np.ones(scores.shape, bool)
                if mask is not None:
                    m = mask[b % mask.shape[0], h % mask.shape[1], :Nq].astype(f32)
                    seen = m != -np.inf
                    scores = np.where(seen, scores + slopes[h] * m, f32(-np.inf))
                sink = f32(-np.inf) if sinks is None else f32(sinks[h])
                row_max = np.maximum(scores.max(axis=1), sink)  # NaN stays NaN
                live = row_max != -np.inf
                weights = np.exp(scores[live] - row_max[live, None])
                denominator = weights.sum(axis=1) + np.exp(sink - row_max[live])
                values = v[kb, kh].astype(f32)
                if np.isfinite(values).all():
                    result[b, live, h] = (weights @ values) / denominator[:, None]
                else:  # a hidden key weighs 0, and 0 * NaN is NaN: leave hidden keys out row by row
                    for x, i in enumerate(np.flatnonzero(live)):
                        result[b, i, h] = (weights[x, seen[i]] @ values[seen[i]]) / denominator[x]
    return result

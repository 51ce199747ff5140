"""Arguments of FlashAttention's API (``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``),
shared by the fast side (``fastattn.integrations.flash_attn``) and the reference (``fastattn.reference.flash_attn``).

Every check runs here, before anything is written, so both sides refuse the same inputs with the same
``TypeError``/``ValueError`` naming the argument. NumPy only (no Numba).

The score rule all three share (FlashAttention's, with the keys of one sequence numbered from 0): for query row i
of Sq and key j of Sk, with d = j - (i + Sk - Sq) (the key's offset from the query's bottom-right-aligned
diagonal), key j is visible when ``(left < 0 or d >= -left) and (right < 0 or d <= right)``; causal sets
right = 0. The logit is ``scale·q.k``, then ``softcap·tanh(logit/softcap)`` (softcap > 0), then
``- slope_h·|d|`` with ALiBi; hidden keys are left out, and a row with no visible key gives zeros (its
logsumexp is +inf, FlashAttention's convention).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._core import validate as v
from ..quant.blocks import Quantized
from .args import MAX_HEADS, SOFTCAP_MIN, default_scale

#: The float dtypes the fast side takes (FlashAttention's float16 and bfloat16, and float32).
FAST_FLOATS = v.STORAGE_FLOATS
#: The reference takes float64 as well: float64 inputs give its unrounded float64 results.
REFERENCE_FLOATS = v.STORAGE_FLOATS + (v.FLOAT64,)


class Scores(NamedTuple):
    """The score rule of one call (module docstring)."""

    scale: float
    left: int  # -1: no left bound
    right: int  # -1: no right bound (0 when causal)
    softcap: float  # 0: off
    alibi: np.ndarray | None  # (B, H) float32 slopes (an (H,) argument broadcast, a view), or None


class Func(NamedTuple):
    q: np.ndarray  # (B, Sq, H, D)
    k: np.ndarray  # (B, Sk, Hk, D)
    v: np.ndarray  # (B, Sk, Hk, DV)
    scores: Scores
    return_lse: bool


class Varlen(NamedTuple):
    q: np.ndarray  # (total_q, H, D)
    k: np.ndarray | Quantized  # (total_k, Hk, D), or a paged cache (num_blocks, page, Hk, D)
    v: np.ndarray | Quantized
    q_starts: list[int]  # cu_seqlens_q as Python ints (B + 1)
    k_starts: list[int]
    block_table: np.ndarray | None  # (B, max_blocks) int
    scores: Scores
    return_lse: bool


class KVCache(NamedTuple):
    q: np.ndarray  # (B, Sq, H, D)
    k_cache: np.ndarray | Quantized  # (Bc, Sc, Hk, D), or paged (num_blocks, page, Hk, D)
    v_cache: np.ndarray | Quantized
    k: np.ndarray | None  # (B, Sn, Hk, D): rows to append, or None
    v: np.ndarray | None
    seqlens: list[int]  # cache rows before the append, per batch entry
    batch_idx: list[int]  # the cache entry of each batch entry (contiguous caches)
    leftpad: list[int]  # the first live cache row of each batch entry
    block_table: np.ndarray | None
    rotary: tuple[np.ndarray, np.ndarray] | None  # (cos, sin) (seqlen_ro, rotary_dim / 2)
    interleaved: bool
    scores: Scores
    num_splits: int
    return_lse: bool

    @property
    def n_new(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def live(self, b: int) -> tuple[int, int]:
        """Batch entry b's live rows [start, end) of its (logical) cache sequence."""
        return self.leftpad[b], self.seqlens[b] + self.n_new

    def q_positions(self, b: int) -> np.ndarray:
        """The rotary table rows of batch entry b's query rows: cache_seqlens + i when causal or local, else
        cache_seqlens for every row (FlashAttention's rule)."""
        sq = self.q.shape[1]
        local = self.scores.left >= 0 or self.scores.right >= 0
        return self.seqlens[b] + (np.arange(sq) if local else np.zeros(sq, np.int64))


# ---------------------------------------------------------------------------------------------------------------
# The score rule.
def mask_values(d: np.ndarray, left: int, right: int, alibi: bool) -> np.ndarray:
    """The additive mask at key offsets ``d`` (float64): -inf where hidden, else -|d| with ALiBi (times the
    head's slope) and 0 without."""
    hidden = np.zeros(d.shape, bool)
    if left >= 0:
        hidden |= d < -left
    if right >= 0:
        hidden |= d > right
    values = -np.abs(d).astype(np.float64) if alibi else np.zeros(d.shape)
    values[hidden] = -np.inf
    return values


def needs_mask(scores: Scores, sq: int, sk: int) -> bool:
    """Whether a (sq, sk) block hides a key or carries ALiBi (else attention runs without a mask)."""
    return (scores.alibi is not None or 0 <= scores.left < sk - 1 or 0 <= scores.right < sq - 1)


# ---------------------------------------------------------------------------------------------------------------
# Pieces.
def _float_array(name: str, a, floats, ndim: int) -> np.ndarray:
    if not (isinstance(a, np.ndarray) and (a.dtype in floats or v.is_bfloat16(a.dtype)) and a.ndim == ndim):
        v.array(name, a, dtypes=floats, ndim=ndim)
    return a


def _kv_array(name: str, a, floats, ndim: int, quantized_ok: bool):
    if quantized_ok and isinstance(a, Quantized):
        if a.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} axes, got the Quantized shape {a.shape}")
        return a
    if quantized_ok and not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, a CPU torch tensor or a fastattn.Quantized, got "
                        f"{type(a).__name__}")
    return _float_array(name, a, floats, ndim)


def _flag(name: str, value) -> bool:
    if value is True or value is False:  # the usual case, without the scalar checks
        return value
    value = v.scalar(value)
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {v.scalar_type(value)}")
    return bool(value)


def _heads(q_shape, k_shape, v_shape, axis: int) -> None:
    """Head counts (axis ``axis``) and head sizes of q, k, v."""
    H, Hk = q_shape[axis], k_shape[axis]
    if H < 1 or q_shape[-1] < 1 or v_shape[-1] < 1:
        raise ValueError(f"q must have at least one head of at least one dim, got q {q_shape}, v {v_shape}")
    if H > MAX_HEADS:
        raise ValueError(f"q must have at most {MAX_HEADS} heads, got {H} (q.shape {q_shape}): FlashAttention's "
                         f"layout has the heads on axis {axis}")
    if Hk < 1 or H % Hk:
        raise ValueError(f"k's heads ({Hk}) must divide q's heads ({H}) (GQA), got q {q_shape} and k {k_shape}")
    if v_shape[axis] != Hk:
        raise ValueError(f"v must have k's {Hk} heads, got v.shape {v_shape}")
    if k_shape[-1] != q_shape[-1]:
        raise ValueError(f"k must have q's head size {q_shape[-1]}, got k.shape {k_shape}")


def _window(causal, window_size) -> tuple[int, int]:
    causal = _flag("causal", causal)
    if window_size.__class__ is tuple and window_size == (-1, -1):  # the default, without the integer checks
        return -1, 0 if causal else -1
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    left = v.integer("window_size[0]", left)
    right = v.integer("window_size[1]", right)
    left, right = max(left, -1), max(right, -1)  # any negative side is unbounded, as FlashAttention's -1
    return left, 0 if causal else right


def scores(q: np.ndarray, batch: int, softmax_scale, causal, window_size, softcap, alibi_slopes) -> Scores:
    """The score rule's parameters; q's last axis is the head size, its axis -2 the query heads."""
    heads = q.shape[-2]
    scale = default_scale(q.shape[-1]) if softmax_scale is None else v.real("softmax_scale", softmax_scale)
    if not abs(scale) <= v.FLOAT32_MAX:
        raise ValueError(f"softmax_scale must be in float32's range, got {scale}")
    left, right = _window(causal, window_size)
    softcap = v.real("softcap", softcap)
    if not (softcap == 0.0 or SOFTCAP_MIN <= softcap <= v.FLOAT32_MAX):
        raise ValueError(f"softcap must be 0 (off) or in [{SOFTCAP_MIN}, {v.FLOAT32_MAX}], got {softcap}")
    alibi = None
    if alibi_slopes is not None:
        v.array("alibi_slopes", alibi_slopes, dtypes=(v.FLOAT32,))
        if alibi_slopes.shape not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes must have shape (nheads,) = ({heads},) or (batch, nheads) = "
                             f"({batch}, {heads}), got {alibi_slopes.shape}")
        if not np.isfinite(alibi_slopes).all():
            raise ValueError("alibi_slopes must be finite")
        alibi = np.broadcast_to(alibi_slopes, (batch, heads))
    return Scores(scale, left, right, softcap, alibi)


def _dropout(dropout_p) -> None:
    p = v.real("dropout_p", dropout_p)
    if p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: fastattn runs inference attention, without dropout (got "
                         f"{p}); call it under model.eval() or pass dropout_p=0.0")


def _starts(name: str, cu, total: int | None, batch: int | None) -> list[int]:
    """cu_seqlens as Python ints: 1-D int32/int64, from 0, non-decreasing, ending at ``total`` (when given)."""
    v.array(name, cu, dtypes=v.INDEX_INTS, ndim=1)
    if cu.shape[0] < 2:
        raise ValueError(f"{name} must have batch_size + 1 >= 2 entries, got shape {cu.shape}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{name} must have batch_size + 1 = {batch + 1} entries, got shape {cu.shape}")
    starts = cu.tolist()
    if starts[0] != 0:
        raise ValueError(f"{name} must start at 0, got {starts[0]}")
    if any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {starts}")
    if total is not None and starts[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {starts[-1]}")
    return starts


def _max_seqlen(name: str, value, starts: list[int]) -> None:
    value = v.integer(name, value, minimum=0)
    longest = max(b - a for a, b in zip(starts, starts[1:]))
    if longest > value:
        raise ValueError(f"{name} must be at least the longest sequence, {longest}, got {value}")


def _block_table(block_table, batch: int, n_blocks: int, page: int, lengths: list[int]) -> np.ndarray:
    """(batch, max_blocks) int32/int64; the entries of the pages each sequence uses must be in [0, n_blocks)."""
    v.array("block_table", block_table, dtypes=v.INDEX_INTS, ndim=2)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have one row per sequence ({batch}), got shape {block_table.shape}")
    capacity = block_table.shape[1] * page
    for b, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"the paged cache is too small: sequence {b} needs {n} rows, block_table holds "
                             f"{block_table.shape[1]} pages of {page} = {capacity}")
        used = block_table[b, :-(-n // page)]
        if used.size and (used.min() < 0 or used.max() >= n_blocks):
            bad = int(used[(used < 0) | (used >= n_blocks)][0])
            raise ValueError(f"block_table entries must be in [0, {n_blocks}) (the cache's pages), got {bad} in "
                             f"row {b}")
    return block_table


def _memory(a):
    return a.data if isinstance(a, Quantized) else a


# ---------------------------------------------------------------------------------------------------------------
# The three calls.
def parse_func(q, k, vv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, *, floats) -> Func:
    _dropout(dropout_p)
    _float_array("q", q, floats, 4)
    _float_array("k", k, floats, 4)
    _float_array("v", vv, floats, 4)
    _heads(q.shape, k.shape, vv.shape, 2)
    if k.shape[0] != q.shape[0] or vv.shape[:2] != k.shape[:2]:
        raise ValueError(f"q, k and v must be (batch, seqlen, nheads, headdim) with one batch and k, v one "
                         f"seqlen, got q {q.shape}, k {k.shape}, v {vv.shape}")
    if q.shape[0] < 1:
        raise ValueError(f"q must have a batch of at least 1, got q.shape {q.shape}")
    _flag("deterministic", deterministic)
    return Func(q, k, vv, scores(q, q.shape[0], softmax_scale, causal, window_size, softcap, alibi_slopes),
                _flag("return_attn_probs", return_attn_probs))


def parse_varlen(q, k, vv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, *,
                 floats) -> Varlen:
    _dropout(dropout_p)
    _float_array("q", q, floats, 3)
    paged = block_table is not None
    k = _kv_array("k", k, floats, 4 if paged else 3, paged)
    vv = _kv_array("v", vv, floats, 4 if paged else 3, paged)
    _heads(q.shape, k.shape, vv.shape, -2)
    if vv.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v must match k but for the head size, got k {k.shape}, v {vv.shape}")
    q_starts = _starts("cu_seqlens_q", cu_seqlens_q, q.shape[0], None)
    batch = len(q_starts) - 1
    k_starts = _starts("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], batch)
    _max_seqlen("max_seqlen_q", max_seqlen_q, q_starts)
    _max_seqlen("max_seqlen_k", max_seqlen_k, k_starts)
    if paged:
        lengths = [b - a for a, b in zip(k_starts, k_starts[1:])]
        block_table = _block_table(block_table, batch, k.shape[0], k.shape[1], lengths)
        for name, a in (("q", q), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            v.disjoint("block_table", block_table, (name, a))
    _flag("deterministic", deterministic)
    return Varlen(q, k, vv, q_starts, k_starts, block_table,
                  scores(q, batch, softmax_scale, causal, window_size, softcap, alibi_slopes),
                  _flag("return_attn_probs", return_attn_probs))


def _per_batch(name: str, value, batch: int, default: int) -> list[int]:
    """An int, or a (batch,) int32/int64 array, as ``batch`` Python ints; None: ``default`` for each."""
    if value is None:
        return [default] * batch
    if isinstance(value, np.ndarray) and value.ndim == 1:
        v.array(name, value, dtypes=v.INDEX_INTS, ndim=1)
        if value.shape[0] != batch:
            raise ValueError(f"{name} must have shape (batch_size,) = ({batch},), got {value.shape}")
        return value.tolist()
    return [v.integer(name, value)] * batch


def _new_kv(k, vv, q, k_cache, v_cache, floats):
    """k and v to append: both or neither, (B, Sn, Hk, D|DV), each of its cache's dtype (any float dtype into a
    Quantized cache), not overlapping the caches."""
    if (k is None) != (vv is None):
        raise ValueError("k and v must be given together (the rows to append) or both be None")
    if k is None:
        return
    _float_array("k", k, floats, 4)
    _float_array("v", vv, floats, 4)
    expected = (q.shape[0], k.shape[1]) + k_cache.shape[2:]
    if k.shape != expected or vv.shape != expected[:3] + v_cache.shape[3:]:
        raise ValueError(f"k and v must be (batch_size, seqlen_new, nheads_k, headdim) = {expected} and "
                         f"{expected[:3] + v_cache.shape[3:]} for q {q.shape} and the caches, got k {k.shape}, "
                         f"v {vv.shape}")
    for name, new, cache in (("k", k, k_cache), ("v", vv, v_cache)):
        if not isinstance(cache, Quantized) and new.dtype != cache.dtype:
            raise TypeError(f"{name} must have {name}_cache's dtype {cache.dtype}, got {new.dtype}")
        for other_name, other in (("k_cache", k_cache), ("v_cache", v_cache)):
            v.disjoint(other_name, _memory(other), (name, new))


def _rotary(rotary_cos, rotary_sin, k, head_dim: int, floats):
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos and rotary_sin rotate the appended rows: they need k and v")
    _float_array("rotary_cos", rotary_cos, floats, 2)
    _float_array("rotary_sin", rotary_sin, floats, 2)
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin must have rotary_cos's shape {rotary_cos.shape}, got {rotary_sin.shape}")
    if rotary_cos.shape[1] < 1 or 2 * rotary_cos.shape[1] > head_dim:
        raise ValueError(f"rotary_cos must be (seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= headdim "
                         f"({head_dim}), got shape {rotary_cos.shape}")
    return rotary_cos, rotary_sin


def _cache_rows(a: KVCache, capacity: int, seqlen_ro: int | None) -> None:
    """Every batch entry's rows fit: leftpad <= cache_seqlens, cache_seqlens + seqlen_new <= capacity, and the
    rotary tables reach every position they are read at."""
    sq = a.q.shape[1]
    for b, (start, seqlen) in enumerate(zip(a.leftpad, a.seqlens)):
        if seqlen < 0 or not 0 <= start <= seqlen:
            raise ValueError(f"cache_seqlens must be >= 0 and cache_leftpad in [0, cache_seqlens], got "
                             f"{seqlen} and {start} for batch entry {b}")
        if seqlen + a.n_new > capacity:
            raise ValueError(f"the cache is too small: batch entry {b} needs cache_seqlens + seqlen_new = {seqlen} "
                             f"+ {a.n_new} rows, the cache holds {capacity}")
        if seqlen_ro is not None:
            last = max(seqlen + a.n_new, int(a.q_positions(b)[-1]) + 1 if sq else 0)
            if last > seqlen_ro:
                raise ValueError(f"rotary_cos and rotary_sin must have a row for every position they rotate: "
                                 f"batch entry {b} reaches position {last - 1}, the tables have {seqlen_ro} rows")


def parse_kvcache(q, k_cache, v_cache, k, vv, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                  num_splits, return_softmax_lse, *, floats) -> KVCache:
    _float_array("q", q, floats, 4)
    k_cache = _kv_array("k_cache", k_cache, floats, 4, True)
    v_cache = _kv_array("v_cache", v_cache, floats, 4, True)
    _heads(q.shape, k_cache.shape, v_cache.shape, 2)
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must match k_cache but for the head size, got k_cache {k_cache.shape}, "
                         f"v_cache {v_cache.shape}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)) if k is not None else ():
        if not _memory(cache).flags.writeable:
            raise ValueError(f"{name} must be writeable to append k and v")
    batch = q.shape[0]
    if batch < 1:
        raise ValueError(f"q must have a batch of at least 1, got q.shape {q.shape}")
    _new_kv(k, vv, q, k_cache, v_cache, floats)
    rotary = _rotary(rotary_cos, rotary_sin, k, q.shape[3], floats)
    if k is not None and cache_seqlens is None:
        raise ValueError("cache_seqlens is required with k and v: the rows they are appended at")
    paged = block_table is not None
    capacity = k_cache.shape[1] if not paged else None
    if paged:
        v.array("block_table", block_table, dtypes=v.INDEX_INTS, ndim=2)
        capacity = block_table.shape[1] * k_cache.shape[1]
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx does not apply to a paged cache (block_table picks each sequence's "
                             "pages), as in FlashAttention")
    seqlens = _per_batch("cache_seqlens", cache_seqlens, batch, capacity)
    leftpad = _per_batch("cache_leftpad", cache_leftpad, batch, 0)
    batch_idx = _per_batch("cache_batch_idx", cache_batch_idx, batch, 0)
    if cache_batch_idx is None:
        batch_idx = list(range(batch))
    bad = [i for i in batch_idx if not 0 <= i < k_cache.shape[0]]
    if not paged and bad:
        raise ValueError(f"cache_batch_idx must be in [0, {k_cache.shape[0]}) (the cache's batch), got {bad[0]}"
                         if cache_batch_idx is not None else
                         f"k_cache must have a batch of at least q's {batch} (or pass cache_batch_idx), got "
                         f"k_cache.shape {k_cache.shape}")
    num_splits = v.integer("num_splits", num_splits, minimum=0)
    a = KVCache(q, k_cache, v_cache, k, vv, seqlens, batch_idx, leftpad, block_table, rotary,
                _flag("rotary_interleaved", rotary_interleaved),
                scores(q, batch, softmax_scale, causal, window_size, softcap, alibi_slopes), num_splits,
                _flag("return_softmax_lse", return_softmax_lse))
    _cache_rows(a, capacity, None if rotary is None else rotary[0].shape[0])
    if paged:
        _block_table(block_table, batch, k_cache.shape[0], k_cache.shape[1], [a.live(b)[1] for b in range(batch)])
    return a

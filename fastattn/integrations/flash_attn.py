"""FlashAttention 2's Python API on the CPU: ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache`` with FlashAttention's signatures and semantics, on fastattn's kernels.

    from fastattn.integrations.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Arrays are NumPy arrays or CPU torch tensors (a torch q gets torch results, sharing memory with the float32
output where no conversion is needed), float32, float16 or bfloat16; the output has q's dtype. Caches may also be
``fastattn.Quantized`` (Q8_0 / Q4_0): the append quantizes the new rows (fused with the rotation). The definition
is ``fastattn.reference.flash_attn`` (float64), the argument rules ``fastattn.attention.flash_args`` (shared, so
both sides refuse the same calls, before anything is written). docs/flash_attn.md has the mapping and what
differs from FlashAttention on a GPU.

How the calls run on the kernels (``flash_attn_ext_checked``: ``flash_attn_ext`` with FlashAttention's own ALiBi
slopes, its arguments checked here):
- q is read through a (B, H, Sq, D) view (widened to float32 first when it is float16/bfloat16); K and V through
  (B, Hk, Sk, D) views of their arrays: a varlen sequence is a slice of the packed arrays, a cache entry's live rows
  a slice of the cache. Nothing is gathered, padded or copied (but the blocks of 32 rows that straddle two pages of
  a paged cache, copied one at a time into a work unit's scratch); each sequence runs on its own rows.
- The output is written straight into FlashAttention's (B, Sq, H, DV) layout, the kernels' own.
- Causal, window and ALiBi become a mask whose entry depends only on the key's offset from the query's diagonal,
  so every (Sq, Sk) mask is a strided view (row stride -1) of one cached 1-D table per (window, ALiBi): no
  (Sq, Sk) mask is ever built. The kernels skip the keys such a mask hides.
- ``softmax_lse`` (``return_attn_probs`` / ``return_softmax_lse``) is computed by a separate float32 NumPy pass
  (a BLAS product per head over the same live rows): the kernels do not return their row maxima and sums yet, so
  asking for it costs about one more pass over K.
- A paged cache (``block_table``) goes through ``_paged_attention``: the kernels read its pages in place through
  the block table (``attention.paged``), the whole batch in one call when no sequence needs a mask, else one call
  per sequence; the output is bit-identical to the same rows in a contiguous cache on the same path.
"""
from __future__ import annotations

import functools

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .._core import threads as _threads
from .._core.tensors import tensors_in_tensors_out
from ..attention import flash_args as _args
from ..attention.api import flash_attn_ext_checked
from ..attention.flash_args import FAST_FLOATS, Scores
from ..attention.paged import Pages, pages_of
from ..quant.api import dequantize
from ..quant.blocks import Quantized
from ..rope.api import RopeCache, apply_rope_cache, apply_rope_cache_set_rows, rope_cache_from_tables
from ..rows.api import set_rows

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
#: Query rows per block of the NumPy logsumexp pass: bounds its (rows, Sk) score block.
LSE_ROWS = 256


# ---------------------------------------------------------------------------------------------------------------
# Masks: one 1-D table per (left, right, ALiBi), every (Sq, Sk) mask a strided view of it.
_TABLES: dict[tuple[int, int, bool], np.ndarray] = {}
#: The smallest table radius (key offsets -R .. R): tables grow by doubling from it.
MIN_TABLE_RADIUS = 1024


def _table(key: tuple[int, int, bool], radius: int) -> np.ndarray:
    """The table of mask values at key offsets -R .. R (R >= radius), float32, read-only."""
    table = _TABLES.get(key)
    if table is None or table.shape[0] // 2 < radius:
        r = max(MIN_TABLE_RADIUS, 1 << (radius - 1).bit_length())
        table = _args.mask_values(np.arange(-r, r + 1), *key).astype(FLOAT32)
        table.flags.writeable = False
        _TABLES[key] = table  # a replaced table stays alive as long as a view of it does
    return table


def mask_view(scores: Scores, sq: int, sk: int) -> np.ndarray | None:
    """The (sq, sk) float32 mask of the score rule (``flash_args.mask_values``), a read-only view of its table:
    entry (i, j) sits at offset d = j - i - (sk - sq) from the table's centre, so rows step back one element. None
    when the block hides no key and has no ALiBi."""
    if not _args.needs_mask(scores, sq, sk):
        return None
    table = _table((scores.left, scores.right, scores.alibi is not None), max(sq, sk))
    centre = table.shape[0] // 2
    if sq == 1:  # a decode step's one row: a slice (as_strided costs microseconds)
        return table[centre - (sk - 1):centre + 1][None]
    item = table.itemsize
    return as_strided(table[centre - (sk - sq):], shape=(sq, sk), strides=(-item, item), writeable=False)


@functools.lru_cache(maxsize=16)
def _ones(heads: int) -> np.ndarray:
    """Slopes of 1 (no ALiBi: the mask is 0 or -inf); the kernels only read them (writeable, as a caller's slopes:
    both share one compiled kernel)."""
    return np.ones(heads, FLOAT32)


# ---------------------------------------------------------------------------------------------------------------
# One block of sequences: the kernels, then the optional logsumexp.
def _attend(q4: np.ndarray, k4, v4, scores: Scores, slopes: np.ndarray | None, out: np.ndarray, path: str,
            lse: np.ndarray | None, pages: Pages | None = None) -> None:
    """Attention of q4 (B, H, Sq, D) float32 over k4, v4 (B, Hk, Sk, D|DV) into out (B, Sq, H, DV) float32 (views);
    ``slopes`` (H,) float32 with ALiBi; ``lse`` (B, H, Sq) float32 to fill, or None. With ``pages``
    (``attention.paged.Pages`` of one sequence), k4, v4 are pages (num_blocks, Hk, page, D|DV) read through its
    block table, Sk its live rows (``lse`` then None: the caller computes it on the gathered rows)."""
    sq = q4.shape[2]
    sk = k4.shape[2] if pages is None else int(pages.ends[0] - pages.starts[0])
    if sq == 0:
        return
    if sk == 0:  # no key: zeros, as every row whose keys are all hidden
        out[...] = 0.0
        if lse is not None:
            lse[...] = np.inf
        return
    mask = mask_view(scores, sq, sk)
    # flash_args has checked everything flash_attn_ext_slopes would check again (a decode step's microseconds)
    flash_attn_ext_checked(q4, k4, v4, mask, _ones(q4.shape[1]) if slopes is None else slopes, scores.scale,
                           scores.softcap, path, out, pages)
    if lse is not None:
        _lse(q4, k4, scores, slopes, mask, lse)


def _keys32(k4, b: int, kh: int) -> np.ndarray:
    """K rows (Sk, D) of batch b, KV head kh, as float32 (dequantized)."""
    if isinstance(k4, Quantized):
        return dequantize(Quantized(k4.data[b, kh], k4.qtype))
    return k4[b, kh].astype(FLOAT32)


def _lse(q4: np.ndarray, k4, scores: Scores, slopes, mask, lse: np.ndarray) -> None:
    """lse[b, h, i] = logsumexp of row i's scores (+inf where every key is hidden), in float32 NumPy."""
    batch, heads, sq, _ = q4.shape
    heads_k = k4.shape[1]
    group = heads // heads_k
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for b, kh in np.ndindex(batch, heads_k):
            keys = _keys32(k4, b, kh)
            for h in range(kh * group, (kh + 1) * group):
                for i0 in range(0, sq, LSE_ROWS):
                    i1 = min(sq, i0 + LSE_ROWS)
                    s = (q4[b, h, i0:i1] @ keys.T) * np.float32(scores.scale)
                    if scores.softcap != 0.0:
                        s = np.float32(scores.softcap) * np.tanh(s / np.float32(scores.softcap))
                    if mask is not None:
                        m = mask[i0:i1]
                        s = np.where(m == -np.inf, -np.inf, s + (1 if slopes is None else slopes[h]) * m)
                    top = s.max(axis=1)
                    total = np.exp(s - top[:, None]).sum(axis=1)
                    lse[b, h, i0:i1] = np.where(top == -np.inf, np.inf, top + np.log(total))


def _float32(a: np.ndarray) -> np.ndarray:
    """a itself when float32, else widened (the kernels' query type)."""
    return a if a.dtype == FLOAT32 else a.astype(FLOAT32)


def _in_dtype(out: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return out if dtype == FLOAT32 else out.astype(dtype)


def _slope_groups(scores: Scores, batch: int):
    """(b0, b1, slopes) blocks of batch entries sharing their ALiBi slopes (all of them without ALiBi or with an
    (nheads,) argument; one each with (batch, nheads) slopes)."""
    if scores.alibi is None:
        return [(0, batch, None)]
    if batch == 1 or scores.alibi.strides[0] == 0:
        return [(0, batch, _batch_slopes(scores, 0))]
    return [(b, b + 1, _batch_slopes(scores, b)) for b in range(batch)]


def _batch_slopes(scores: Scores, b: int) -> np.ndarray | None:
    """Batch entry b's slopes as the kernels take them: a contiguous, writeable float32 copy."""
    return None if scores.alibi is None else np.array(scores.alibi[b], FLOAT32)


# ---------------------------------------------------------------------------------------------------------------
# The three calls.
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """dropout_p must be 0.0 (no dropout on the CPU). GQA: q's heads a multiple of k's, query head h reading KV
    head h // (nheads / nheads_k).

    If causal=True, the causal mask is aligned to the bottom right corner of the attention matrix: with
    seqlen_q = 2 and seqlen_k = 5 (1 = keep, 0 = masked out)::

        1 1 1 1 0
        1 1 1 1 1

    and with seqlen_q = 5 and seqlen_k = 2::

        0 0
        0 0
        0 0
        1 0
        1 1

    A row with no key gives zeros. window_size (left, right) != (-1, -1): query i attends to keys
    [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right] inclusive (-1: no bound on that side).

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim); k: (batch_size, seqlen_k, nheads_k, headdim); v:
            (batch_size, seqlen_k, nheads_k, headdim_v). float32, float16 or bfloat16 NumPy arrays or CPU torch
            tensors (any strides).
        softmax_scale: the scaling of QK^T before the softmax; default 1 / sqrt(headdim).
        softcap: > 0 caps the scores at softcap·tanh(s / softcap); 0.0 is off.
        alibi_slopes: (nheads,) or (batch_size, nheads) float32: a bias of -slope·|i + seqlen_k - seqlen_q - j|
            is added to the score of query i and key j.
        deterministic: accepted for FlashAttention's signature (the CPU forward pass is deterministic).
        return_attn_probs: also return softmax_lse (and None for the attention probabilities).
    Returns:
        out (batch_size, seqlen_q, nheads, headdim_v) of q's dtype; with return_attn_probs (out, softmax_lse
        (batch_size, nheads, seqlen_q) float32, None): the logsumexp of each row of the scores (+inf for a row
        with no visible key).
    """
    a = _args.parse_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_attn_probs, floats=FAST_FLOATS)
    batch, sq, heads, _ = q.shape
    out = np.empty((batch, sq, heads, v.shape[3]), FLOAT32)
    lse = np.empty((batch, heads, sq), FLOAT32) if a.return_lse else None
    q4, k4, v4 = _float32(q).transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    for b0, b1, slopes in _slope_groups(a.scores, batch):
        _attend(q4[b0:b1], k4[b0:b1], v4[b0:b1], a.scores, slopes, out[b0:b1], "auto",
                None if lse is None else lse[b0:b1])
    out = _in_dtype(out, q.dtype)
    return (out, lse, None) if a.return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Sequences of different lengths, packed. Masks, GQA, ALiBi and the other arguments as ``flash_attn_func``,
    per sequence (each sequence's causal mask aligned to its own bottom right corner).

    Arguments:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim[_v]), the sequences one after the other;
            with block_table, paged caches (num_blocks, page_block_size, nheads_k, headdim[_v]) instead (any page
            size; also ``fastattn.Quantized``).
        cu_seqlens_q, cu_seqlens_k: (batch_size + 1,) int32 (or int64): 0, then the cumulative lengths; non-
            decreasing, cu_seqlens_q ending at total_q (and cu_seqlens_k at total_k without block_table).
        max_seqlen_q, max_seqlen_k: at least the longest query / key sequence.
        block_table: (batch_size, max_num_blocks_per_seq) int32: the pages of each sequence's K/V rows.
    Returns:
        out (total_q, nheads, headdim_v) of q's dtype; with return_attn_probs (out, softmax_lse (nheads, total_q)
        float32, None).
    """
    a = _args.parse_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                           softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, block_table, floats=FAST_FLOATS)
    total, heads = q.shape[:2]
    out = np.empty((total, heads, v.shape[-1]), FLOAT32)
    lse = np.empty((heads, total), FLOAT32) if a.return_lse else None
    q32 = _float32(q)
    sequences = []
    for b in range(len(a.q_starts) - 1):
        q0, q1, k0, k1 = a.q_starts[b], a.q_starts[b + 1], a.k_starts[b], a.k_starts[b + 1]
        sequences.append((q32[q0:q1].transpose(1, 0, 2)[None], (k0, k1), _batch_slopes(a.scores, b),
                          out[q0:q1][None], None if lse is None else lse[:, q0:q1][None]))
    if a.block_table is not None:  # a sequence's live rows are its first k1 - k0 logical rows
        _paged_attention([(b, q4, (0, k1 - k0), slopes, o, rows_lse)
                          for b, (q4, (k0, k1), slopes, o, rows_lse) in enumerate(sequences)],
                         k, v, a.block_table, a.scores, "auto")
    else:
        for q4, (k0, k1), slopes, o, rows_lse in sequences:
            _attend(q4, k[k0:k1].transpose(1, 0, 2)[None], v[k0:k1].transpose(1, 0, 2)[None], a.scores, slopes,
                    o, "auto", rows_lse)
    out = _in_dtype(out, q.dtype)
    return (out, lse, None) if a.return_lse else out


def _paged_attention(sequences, k_cache, v_cache, block_table: np.ndarray, scores: Scores, path: str,
                     append=None, whole=None) -> None:
    """Attention over paged caches (num_blocks, page, Hk, D), K/V rows read through ``block_table`` by the kernels
    (``attention.paged``): ``append`` (None, or a function writing the new rows) runs first; then for each (b, q4
    (1, H, Sq, D) float32, (start, end) the live logical rows of sequence b, slopes, out (1, Sq, H, DV), lse
    (1, H, Sq) or None) of ``sequences``, the rows [start, end) of sequence b's pages, in the layout and with the
    rules of ``_attend``. ``whole``: None, or (q4, out, lse) of the batch whose entries 0, 1, ... the sequences
    are: when no sequence needs a mask (decode without window or ALiBi) they run in one kernel call, their
    (batch, KV head) units in parallel; otherwise one call per sequence, as its mask is its own. split_kv runs
    per sequence too: its chunks are then the sequence's own, as over a contiguous cache."""
    if append is not None:
        append()
    k_pages, v_pages = _pages_view(k_cache), _pages_view(v_cache)
    page = k_cache.shape[1]
    starts = [start for _, _, (start, _), _, _, _ in sequences]
    ends = [end for _, _, (_, end), _, _, _ in sequences]
    if whole is not None and path != "split_kv" and not any(_args.needs_mask(scores, q4.shape[2], end - start)
                                     for _, q4, (start, end), _, _, _ in sequences):
        q4, out, lse = whole
        if q4.shape[2] > 0 and any(end > start for start, end in zip(starts, ends)):
            flash_attn_ext_checked(q4, k_pages, v_pages, None, _ones(q4.shape[1]), scores.scale, scores.softcap,
                                   path, out, pages_of(block_table, page, starts, ends))
        else:  # no query row, or no key in any sequence
            out[...] = 0.0
        sequences = [(b, q4, live, None, None, rows_lse) for b, q4, live, _, _, rows_lse in sequences]
    for b, q4, (start, end), slopes, out, rows_lse in sequences:
        pages = pages_of(block_table[b:b + 1], page, starts[b:b + 1], ends[b:b + 1])
        if out is not None:
            _attend(q4, k_pages, v_pages, scores, slopes, out, path, None, pages)
        if rows_lse is not None and end == start:  # no key: +inf, as _attend gives
            rows_lse[...] = np.inf
        elif rows_lse is not None and q4.shape[2] > 0:
            _lse(q4, _gathered(k_cache, block_table[b], start, end), scores, slopes,
                 mask_view(scores, q4.shape[2], end - start), rows_lse)


def _pages_view(cache):
    """A paged cache (num_blocks, page, Hk, D) as the kernels read its pages: (num_blocks, Hk, page, D)."""
    if isinstance(cache, Quantized):
        return Quantized(cache.data.transpose(0, 2, 1, 3), cache.qtype)
    return cache.transpose(0, 2, 1, 3)


def _gathered(cache, table: np.ndarray, start: int, end: int):
    """Logical rows [start, end) of a paged cache's sequence of pages ``table``, gathered as (1, Hk, rows, D) (for
    the logsumexp pass, which copies its rows anyway)."""
    rows = np.arange(start, end)
    index = (table[rows // cache.shape[1]], rows % cache.shape[1])
    if isinstance(cache, Quantized):
        return Quantized(cache.data[index].transpose(1, 0, 2)[None], cache.qtype)
    return cache[index].transpose(1, 0, 2)[None]


def _cache_rows(cache) -> tuple[object, int] | None:
    """(the cache as (entries·rows, Hk, D) rows without a copy, rows per entry), or None when its first two axes
    do not merge."""
    entries, rows = cache.shape[:2]
    memory = cache.data if isinstance(cache, Quantized) else cache
    try:
        flat = memory.reshape((entries * rows,) + memory.shape[2:], copy=False)
    except ValueError:
        return None
    return (Quantized(flat, cache.qtype) if isinstance(cache, Quantized) else flat), rows


def _write_rows(dst, x: np.ndarray, idx: np.ndarray, rope: RopeCache | None) -> None:
    """x (N, Hk, D) into rows idx of dst (R, Hk, D) (an ndarray or a Quantized), rotated by ``rope`` when given."""
    if rope is not None:
        apply_rope_cache_set_rows(dst, x if x.dtype in (FLOAT32, FLOAT16) else x.astype(FLOAT32), rope, idx)
    elif isinstance(dst, Quantized):
        set_rows(Quantized(dst.data.transpose(1, 0, 2), dst.qtype), x.transpose(1, 0, 2), idx)
    else:
        set_rows(dst.transpose(1, 0, 2), x.transpose(1, 0, 2), idx)


def _write(cache, new: np.ndarray, entry: np.ndarray, row: np.ndarray, rope: RopeCache | None) -> None:
    """new (B, Sn, Hk, D) into cache[entry[t], row[t]] for its t-th row (batch-major), in one call over the cache's
    merged rows, or one per cache entry when they do not merge."""
    x = new.reshape((-1,) + new.shape[2:])
    merged = _cache_rows(cache)
    if merged is not None:
        flat, rows = merged
        _write_rows(flat, x, entry * rows + row, rope)
        return
    for e in dict.fromkeys(entry.tolist()):  # the entries in order of first use
        sel = np.flatnonzero(entry == e)
        part = None if rope is None else RopeCache(rope.cs[sel], rope.params, rope.pairing)
        dst = Quantized(cache.data[e], cache.qtype) if isinstance(cache, Quantized) else cache[e]
        _write_rows(dst, x[sel], row[sel], part)


def _append(a: _args.KVCache) -> None:
    """Write k (rotated when the tables are given) and v at rows cache_seqlens + t of each batch entry."""
    n_new = a.n_new
    positions = (np.asarray(a.seqlens, np.int64)[:, None] + np.arange(n_new)).ravel()
    if a.block_table is None:
        entry = np.repeat(np.asarray(a.batch_idx, np.int64), n_new)
        row = positions
    else:
        page = a.k_cache.shape[1]
        batch = np.repeat(np.arange(len(a.seqlens)), n_new)
        entry = a.block_table[batch, positions // page].astype(np.int64)
        row = positions % page
    rope = None
    if a.rotary is not None:
        rope = rope_cache_from_tables(a.rotary[0][positions], a.rotary[1][positions], interleaved=a.interleaved)
    _write(a.k_cache, a.k, entry, row, rope)
    _write(a.v_cache, a.v, entry, row, None)


def _query(a: _args.KVCache) -> np.ndarray:
    """q as float32, rotated at each row's position when the rotary tables are given (a new array)."""
    if a.rotary is None:
        return _float32(a.q)
    batch, sq, heads, dim = a.q.shape
    rows = np.array(a.q, FLOAT32).reshape(batch * sq, heads, dim)
    positions = np.concatenate([a.q_positions(b) for b in range(batch)])
    rope = rope_cache_from_tables(a.rotary[0][positions], a.rotary[1][positions], interleaved=a.interleaved)
    return apply_rope_cache(rows, rope, out=rows).reshape(batch, sq, heads, dim)


def _path(num_splits: int, sq: int) -> str:
    """FlashAttention's num_splits as a path: 0 auto; 1 no split (one_chunk for decode); > 1 the split-KV decode
    (its chunks are fastattn's, a function of Nkv)."""
    if num_splits == 0 or sq != 1:
        return "auto"
    return "one_chunk" if num_splits == 1 else "split_kv"


def _entry_rows(cache, entry: int, start: int, end: int, stop: int | None = None):
    """Rows [start, end) of cache entries [entry, stop) (one entry: stop None) as (entries, Hk, rows, D) views."""
    index = (slice(entry, stop if stop is not None else entry + 1), slice(start, end))
    if isinstance(cache, Quantized):
        return Quantized(cache.data[index].transpose(0, 2, 1, 3), cache.qtype)
    return cache[index].transpose(0, 2, 1, 3)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """If k and v are given, they are written *in place* into k_cache and v_cache at rows cache_seqlens,
    cache_seqlens + 1, ... of each batch entry (rotated first when rotary_cos and rotary_sin are given, and stored
    rotated); then q attends over each batch entry's live cache rows [cache_leftpad, cache_seqlens + seqlen_new).
    Nothing is written when an argument is refused.

    Rotary: k is rotated at positions (rows of the tables) cache_seqlens, cache_seqlens + 1, ...; q at
    cache_seqlens + i when causal or local (window_size != (-1, -1)), else at cache_seqlens for every row.
    rotary_interleaved: pairs (0, 1), (2, 3), ... (True) or (0, rotary_dim / 2), ... (GPT-NeoX style). Dims past
    rotary_dim are not rotated. Causal, window, softcap, ALiBi and GQA as ``flash_attn_func``, over each batch
    entry's live rows (seqlen_k = cache_seqlens + seqlen_new - cache_leftpad).

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim[_v]), or with block_table paged
            (num_blocks, page_block_size, nheads_k, headdim[_v]) with any page size; float32, float16, bfloat16
            or ``fastattn.Quantized`` (Q8_0 / Q4_0).
        k, v: (batch_size, seqlen_new, nheads_k, headdim[_v]) to append, of the caches' dtype (any float dtype into
            a Quantized cache), or None.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), 2 <= rotary_dim <= headdim, rows for every position
            rotated; only with k and v.
        cache_seqlens: int or (batch_size,) int32: the rows each cache holds before the append (required with k and
            v; None: the whole cache).
        cache_batch_idx: (batch_size,) int32: the cache entry of each batch entry (contiguous caches; default
            0, 1, ...). Duplicate entries are appended in batch order (the last write wins).
        cache_leftpad: (batch_size,) int32: the first live row of each cache entry (default 0).
        block_table: (batch_size, max_num_blocks_per_seq) int32: each sequence's pages of a paged cache.
        num_splits: 0 chooses the decode path automatically; 1 runs without splitting the keys; > 1 runs the
            split-KV decode (seqlen_q 1; its chunks are fastattn's own, set by the key count).
        return_softmax_lse: also return softmax_lse (batch_size, nheads, seqlen_q) float32.
    Returns:
        out (batch_size, seqlen_q, nheads, headdim_v) of q's dtype, or (out, softmax_lse).
    """
    a = _args.parse_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                            rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, floats=FAST_FLOATS)
    batch, sq, heads, _ = q.shape
    out = np.empty((batch, sq, heads, v_cache.shape[3]), FLOAT32)
    lse = np.empty((batch, heads, sq), FLOAT32) if a.return_lse else None
    path = _path(a.num_splits, sq)
    q4 = _query(a).transpose(0, 2, 1, 3)  # reads no cache row: made before the append
    if a.block_table is not None:
        sequences = [(b, q4[b:b + 1], a.live(b), _batch_slopes(a.scores, b), out[b:b + 1],
                      None if lse is None else lse[b:b + 1]) for b in range(batch)]
        _paged_attention(sequences, k_cache, v_cache, a.block_table, a.scores, path,
                         None if a.k is None else functools.partial(_append, a), (q4, out, lse))
    else:
        if a.k is not None:
            _append(a)
        _attend_cache(a, q4, path, out, lse)
    out = _in_dtype(out, q.dtype)
    return (out, lse) if a.return_lse else out


def _attend_cache(a: _args.KVCache, q4: np.ndarray, path: str, out: np.ndarray, lse: np.ndarray | None) -> None:
    """Each batch entry over its live rows of a contiguous cache; one call for the whole batch when the entries
    are the cache's first ones in order, with the same live rows and slopes."""
    batch = q4.shape[0]
    live = {a.live(b) for b in range(batch)}
    if (len(live) == 1 and a.batch_idx == list(range(batch))
            and (a.scores.alibi is None or batch == 1 or a.scores.alibi.strides[0] == 0)):
        start, end = live.pop()
        _attend(q4, _entry_rows(a.k_cache, 0, start, end, batch), _entry_rows(a.v_cache, 0, start, end, batch),
                a.scores, _batch_slopes(a.scores, 0), out, path, lse)
        return
    for b in range(batch):
        start, end = a.live(b)
        entry = a.batch_idx[b]
        _attend(q4[b:b + 1], _entry_rows(a.k_cache, entry, start, end), _entry_rows(a.v_cache, entry, start, end),
                a.scores, _batch_slopes(a.scores, b), out[b:b + 1], path, None if lse is None else lse[b:b + 1])


def _serialised(op):
    """``op`` under ``_threads.guard``, resolved on the first call (guard starts Numba's thread pool to learn its
    threading layer: not at import)."""
    chosen = None

    @functools.wraps(op)
    def call(*args, **kwargs):
        nonlocal chosen
        if chosen is None:
            chosen = _threads.guard(op)
        return chosen(*args, **kwargs)

    return call


flash_attn_func = tensors_in_tensors_out(_serialised(flash_attn_func))
flash_attn_varlen_func = tensors_in_tensors_out(_serialised(flash_attn_varlen_func))
flash_attn_with_kvcache = tensors_in_tensors_out(_serialised(flash_attn_with_kvcache))

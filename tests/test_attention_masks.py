"""Masks at mask cost: KV blocks a mask hides from every head are skipped, and skipping changes nothing.

A block of ``ROWS`` keys whose mask is ``-inf`` for every head of a GQA group adds nothing to the online softmax
(no new max, zero weights), so a call on a sliding window or a padded batch entry gives, bit for bit, what the
same call on the live keys alone gives when the live range starts and ends on block boundaries or at the cache's
end (one_chunk walks blocks from the first key; a block cut short sums its weights in another order), and its
hidden K/V rows are never read.
"""
from __future__ import annotations

import numpy as np
import pytest
from attention_cases import FLOOR, naive_f32

import fastattn
from fastattn import reference
from fastattn.attention.rows import ROWS
from fastattn.testing import assert_within_rule

HQ, HKV, D = 8, 2, 64
DECODE_PATHS = ["one_chunk", "split_kv"]


def _decode_inputs(rng, n_kv, dtype, batch=1):
    q = rng.standard_normal((batch, HQ, 1, D), dtype=np.float32)
    k = rng.standard_normal((batch, HKV, n_kv, D), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((batch, HKV, n_kv, D), dtype=np.float32).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_window_on_one_chunk_is_the_sliced_call_bit_for_bit(dtype, threads):
    rng = np.random.default_rng(0)
    n_kv, start = 40 * ROWS + 7, 29 * ROWS  # the window starts on a block boundary, the cache ends mid-block
    q, k, v = _decode_inputs(rng, n_kv, dtype)
    mask = np.full((1, n_kv), -np.inf, dtype)  # masks of the K/V dtype: the suite's kernel variants (strategies)
    mask[:, start:] = 0.0
    with fastattn.num_threads(threads), fastattn.testing.parallel_min_bytes(0):
        masked = fastattn.flash_attn_ext(q, k, v, mask, scale=0.125, path="one_chunk")
        sliced = fastattn.flash_attn_ext(q, k[:, :, start:], v[:, :, start:], mask[:, start:], scale=0.125,
                                         path="one_chunk")
    assert np.array_equal(masked, sliced)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_padded_batch_entries_are_their_single_calls_bit_for_bit(dtype):
    rng = np.random.default_rng(1)
    lengths = [ROWS, 3 * ROWS, 6 * ROWS, 8 * ROWS]  # whole blocks: a cut block would sum in another order
    n_kv = max(lengths)
    q, k, v = _decode_inputs(rng, n_kv, dtype, batch=len(lengths))
    mask = np.full((len(lengths), 1, 1, n_kv), -np.inf, dtype)
    for b, n in enumerate(lengths):
        mask[b, ..., :n] = 0.0
    with fastattn.num_threads(2), fastattn.testing.parallel_min_bytes(0):
        batch = fastattn.flash_attn_ext(q, k, v, mask, scale=0.125, path="one_chunk")
        for b, n in enumerate(lengths):
            single = fastattn.flash_attn_ext(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], scale=0.125,
                                             path="one_chunk")
            assert np.array_equal(batch[b:b + 1], single), b


@pytest.mark.parametrize("path", DECODE_PATHS + ["tiled"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_hidden_blocks_are_not_read_and_match_the_reference(path, dtype):
    rng = np.random.default_rng(2)
    n_q = 1 if path != "tiled" else 5
    n_kv = 48 * ROWS + 11
    q = rng.standard_normal((2, HQ, n_q, D), dtype=np.float32)
    k = rng.standard_normal((2, HKV, n_kv, D), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((2, HKV, n_kv, D), dtype=np.float32).astype(dtype)
    # per-head masks (Hm = 2): a window on head 0, a padded prefix and hidden runs on head 1, a block hidden from
    # one head only, and a partly hidden block
    mask = rng.uniform(-1, 1, (2, 2, n_q, n_kv)).astype(dtype)
    mask[0, 0, :, :30 * ROWS] = -np.inf
    mask[1, 1, :, 5 * ROWS:21 * ROWS + 3] = -np.inf
    mask[:, :, :, 40 * ROWS:41 * ROWS] = -np.inf
    mask[0, 1, :, 44 * ROWS:45 * ROWS] = -np.inf
    hidden = np.isneginf(mask).all(axis=(1, 2))  # (B, Nkv): hidden from every head and query of the batch entry
    poisoned_k, poisoned_v = k.copy(), v.copy()
    poisoned_k.transpose(0, 2, 1, 3)[hidden] = np.nan
    poisoned_v.transpose(0, 2, 1, 3)[hidden] = np.nan
    for threads in (1, 2):
        with fastattn.num_threads(threads), fastattn.testing.parallel_min_bytes(0):
            clean = fastattn.flash_attn_ext(q, k, v, mask, scale=0.125, path=path)
            poisoned = fastattn.flash_attn_ext(q, poisoned_k, poisoned_v, mask, scale=0.125, path=path)
        assert np.array_equal(clean, poisoned)
    expected = reference.flash_attn_ext(q, k, v, mask, scale=0.125, out=np.empty(clean.shape, np.float64))
    assert_within_rule(clean, expected, naive_f32(q, k, v, mask, scale=0.125), floor=FLOOR)


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_fully_hidden_cache_gives_zeros_and_sinks_alone_give_zeros(path):
    rng = np.random.default_rng(3)
    q, k, v = _decode_inputs(rng, 20 * ROWS, np.float16)
    mask = np.full((1, 20 * ROWS), -np.inf, np.float16)
    with fastattn.testing.parallel_min_bytes(0):
        out = fastattn.flash_attn_ext(q, k, v, mask, scale=0.125, path=path)
        with_sinks = fastattn.flash_attn_ext(q, k, v, mask, scale=0.125, path=path,
                                             sinks=np.ones(HQ, np.float32))
    assert not out.any() and not with_sinks.any()

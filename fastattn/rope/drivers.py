"""RoPE drivers: every token of x (B, N, H, D), its cos/sin row, and what happens to its rotated rows.

A driver walks the tokens and hands each one to a *step* (``_step``): ``_rotate_step`` writes ``out[b, n]``
(``rope_ext``, ``apply_rope_cache``; ``out`` may be ``x``), ``_cache_write_step`` writes the cache row
``out[idx[n]]`` of a token that ``keep`` marks (``rope_set_rows``: on threads only the last of duplicate indices
is written, so the last row wins as in ggml). The step is chosen from idx's type when a driver compiles, so a
compiled driver holds one step's loop; the pairing, in-place and layout flags are run-time arguments that choose
between loops compiled once (``rope.rotate.rope_block``), so one driver serves every combination and compiles
once per dtype combination.

- ``drive_serial``: the tokens in order, cos/sin from a prebuilt table ``cs`` (N, 2·n_pairs).
- ``drive_parallel``: the same on ``n_threads`` threads, which take tasks of TOKENS_PER_TASK tokens from a shared
  counter (``_core.kernel.fetch_add``), so a thread slowed down by another process runs fewer of them. Each thread
  runs ``_cached_tasks``, called by address (``_core.kernel.call_unit``: compiled once, not again inside every
  driver that launches it).
- ``drive_fused``: cos/sin made in the same pass: a task is one CACHE_BLOCK of tokens, whose rows go to the
  thread's scratch (the very values ``rope_cache`` stores: same blocks, same code) and are used at once.

The drivers are module-level functions, not closures made per step: Numba's cache key of a closure pickles its
cell contents, and a pickled dispatcher differs from process to process, so a closure would be compiled again in
every process instead of being loaded from the cache.
"""
from __future__ import annotations

import numpy as np
from numba import prange, types
from numba.extending import overload

from .._core.kernel import any_layout, assume_contiguous, call_unit, fetch_add, kernel, prefetch, work_unit
from .cache import CACHE_BLOCK, cache_block
from .rotate import (ROWS_STRIDED, TOKEN_BLOCK, ROTATION_FASTMATH, PICK_OPTIONS, rope_block, rotate_rows_adjacent,
                     rotate_rows_split)
from .._core.simd import LANES

#: Cache lines of the next token's x asked for (``prefetcht0``) before a token is rotated in place: 1 KiB.
PREFETCH_LINES = 16


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _prefetch_next_token(tokens, n, layout):
    """In place, start fetching the first lines of token n + 1's (H, D) block of ``tokens`` (N, H, D) while token
    n is rotated: in place the hardware prefetchers alone fall behind; out of place it does not help. Tokens that
    lie apart take ``_rows_ahead``."""
    if layout == TOKEN_BLOCK and n + 1 < tokens.shape[0]:
        first_row = tokens[n + 1, 0]
        for line in range(PREFETCH_LINES):
            prefetch(first_row, line * (64 // tokens.itemsize))


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _rows_ahead(tokens, n, layout):
    """In place on tokens that lie apart (Q or K of a fused QKV buffer: 16 KiB runs 24 KiB apart), the distance
    in elements from a row of token n to the same row of token n + 2, for the vector code to prefetch that token
    row by row while it rotates this one; 0 otherwise. Why: the hardware prefetchers start over at every run;
    two tokens ahead keeps a QKV view as fast as a contiguous x (docs/rope.md, "Performance")."""
    if layout != TOKEN_BLOCK or n + 2 >= tokens.shape[0]:
        return 0
    token_stride = tokens.strides[0] // tokens.itemsize
    if token_stride == tokens.shape[1] * tokens.shape[2]:
        return 0
    return 2 * token_stride


# The token steps: what a driver does with token n of x (B, N, H, D) and its cache row (module docstring).
@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _rotate_step(x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout):
    """rope_ext / apply_rope_cache: out[b, n] = rope(x[b, n]) for every b (out may be x); idx, keep unused."""
    for b in range(x.shape[0]):
        ahead = 0
        if in_place:
            ahead = _rows_ahead(any_layout(x[b]), n, layout)  # one compilation for contiguous and strided x
            if ahead == 0:
                _prefetch_next_token(x[b], n, layout)
        rope_block(x[b, n], out[b, n], cache_row, n_pairs, interleaved, in_place, layout, ahead)


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _cache_write_step(x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout):
    """rope_set_rows: x (1, N, H, D) K rows, out (R, H, D) the cache; token n goes to out[idx[n]] when keep[n]."""
    if keep[n]:
        rope_block(x[0, n], out[idx[n]], cache_row, n_pairs, interleaved, np.bool_(False), layout, np.int64(0))


def _step(x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout):
    """Token n: ``_rotate_step`` when idx is None, else ``_cache_write_step`` (chosen from idx's type when a
    driver compiles, so each compiled driver holds only one step's loop)."""


@overload(_step, jit_options=PICK_OPTIONS)
def _step_impl(x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout):
    if isinstance(idx, types.NoneType):
        return lambda x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout: _rotate_step(
            x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout)
    return lambda x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout: _cache_write_step(
        x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout)


#: Tokens per task of the parallel drivers: threads take tasks from a shared counter (``_core.kernel.fetch_add``), so
#: a thread slowed down by another process runs fewer of them. 8 tokens x 32 heads x 128 dims is ~32 KiB of x.
TOKENS_PER_TASK = 8


@kernel(fastmath=ROTATION_FASTMATH)
def drive_serial(x, out, idx, keep, cs, n_pairs, interleaved, in_place, layout):
    """``_step`` on every token of x (B, N, H, D) with its row of cs (N, 2·n_pairs) float32 (cos then sin; rows
    of adjacent elements, typed so)."""
    for n in range(x.shape[1]):
        _step(x, out, idx, keep, n, assume_contiguous(cs[n]), n_pairs, interleaved, in_place, layout)


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _whole_rows(x, out, n_pairs, in_place, layout):
    """The common prefill call: one batch, out of place, rows of adjacent elements rotated whole in chunks of 8
    pairs (n_pairs % 8 == 0, 2·n_pairs == D). The parallel drivers decide it once per call and then hand each
    such token straight to the vector code (``_rotate_whole``) instead of making ``_step``'s per-token choices
    and calls, a few percent of a prefill call."""
    return (x.shape[0] == 1 and not in_place and layout != ROWS_STRIDED and n_pairs % LANES == 0
            and 2 * n_pairs == x.shape[3])


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _rotate_rows(src, dst, cache_row, n_pairs, interleaved):
    """src (H, D) into dst (H, D) when ``_whole_rows``: the vector code alone (``rope_block``'s result)."""
    cos = cache_row[:n_pairs]
    sin = cache_row[n_pairs:2 * n_pairs]
    if interleaved:
        rotate_rows_adjacent(src, dst, cos, sin, 0)
    else:
        rotate_rows_split(src, dst, cos, sin, 0)


def _rotate_whole(x, out, idx, keep, n, cache_row, n_pairs, interleaved):
    """Token n of x (1, N, H, D) rotated whole into out[0, n] when idx is None, else into the cache row
    out[idx[n]] when ``keep`` marks it. Kernel-only."""


@overload(_rotate_whole, jit_options=PICK_OPTIONS)
def _rotate_whole_impl(x, out, idx, keep, n, cache_row, n_pairs, interleaved):
    if isinstance(idx, types.NoneType):
        return lambda x, out, idx, keep, n, cache_row, n_pairs, interleaved: _rotate_rows(
            x[0, n], out[0, n], cache_row, n_pairs, interleaved)

    def write(x, out, idx, keep, n, cache_row, n_pairs, interleaved):
        if keep[n]:
            _rotate_rows(x[0, n], out[idx[n]], cache_row, n_pairs, interleaved)
    return write


@kernel(fastmath=ROTATION_FASTMATH)
def _cached_tasks(x, out, idx, keep, cs, n_pairs, interleaved, in_place, layout, next_task):
    """One thread's share of ``drive_parallel``: tasks of TOKENS_PER_TASK tokens from ``next_task`` until none is
    left. A function of its own, so that the parallel region is one call (Numba's parfor passes then analyse a
    call, not the whole loop nest: seconds of compilation)."""
    n_tasks = (x.shape[1] + TOKENS_PER_TASK - 1) // TOKENS_PER_TASK
    whole = _whole_rows(x, out, n_pairs, in_place, layout)
    task = fetch_add(next_task)
    while task < n_tasks:
        for n in range(task * TOKENS_PER_TASK, min(x.shape[1], (task + 1) * TOKENS_PER_TASK)):
            cache_row = assume_contiguous(cs[n])
            if whole:
                _rotate_whole(x, out, idx, keep, n, cache_row, n_pairs, interleaved)
            else:
                _step(x, out, idx, keep, n, cache_row, n_pairs, interleaved, in_place, layout)
        task = fetch_add(next_task)


@kernel(parallel=True, fastmath=ROTATION_FASTMATH)
def drive_parallel(unit, x, out, idx, keep, cs, n_pairs, interleaved, in_place, layout, next_task, n_threads):
    """``drive_serial`` on ``n_threads`` threads, which take tasks of TOKENS_PER_TASK tokens from
    ``next_task`` (a zeroed int64 counter); ``unit``: the handle of ``_cached_tasks`` for these argument types
    (``_core.kernel.call_unit``)."""
    for _ in prange(n_threads):
        call_unit(unit, (x, out, idx, keep, cs, n_pairs, interleaved, in_place, layout, next_task))


@kernel(fastmath=ROTATION_FASTMATH)
def _fused_tasks(x, out, idx, keep, pos, table, interleaved, in_place, layout, next_task):
    """One thread's share of ``drive_fused`` (see ``_cached_tasks``), with its own cos/sin scratch."""
    n_tokens = x.shape[1]
    n_pairs = table.w.shape[0]
    n_tasks = (n_tokens + CACHE_BLOCK - 1) // CACHE_BLOCK
    whole = _whole_rows(x, out, n_pairs, in_place, layout)
    cs = np.empty((CACHE_BLOCK, 2 * n_pairs), np.float32)
    task = fetch_add(next_task)
    while task < n_tasks:
        n0 = task * CACHE_BLOCK
        n1 = min(n_tokens, n0 + CACHE_BLOCK)
        cache_block(pos, table, cs, n0, n1)
        for n in range(n0, n1):
            if whole:
                _rotate_whole(x, out, idx, keep, n, cs[n - n0], n_pairs, interleaved)
            else:
                _step(x, out, idx, keep, n, cs[n - n0], n_pairs, interleaved, in_place, layout)
        task = fetch_add(next_task)


@kernel(parallel=True, fastmath=ROTATION_FASTMATH)
def drive_fused(unit, x, out, idx, keep, pos, table, interleaved, in_place, layout, next_task, n_threads):
    """``drive_parallel`` with the cos/sin of positions ``pos`` (streams, N) made inside the same pass from the
    pair table ``table`` (``rope.pairs.PairTable``). A task is one CACHE_BLOCK of tokens: its cos/sin go to the
    thread's scratch (exactly the values ``rope_cache`` would store: same blocks, same code), then its tokens are
    stepped through while the scratch is in L1. ``unit``: the handle of ``_fused_tasks``."""
    for _ in prange(n_threads):
        call_unit(unit, (x, out, idx, keep, pos, table, interleaved, in_place, layout, next_task))


#: ``drive_parallel``'s unit (``_core.kernel.work_unit``): ``_cached_tasks`` on the driver's arguments of its names.
CACHED_UNIT = work_unit(_cached_tasks, drive_parallel)
#: ``drive_fused``'s unit: ``_fused_tasks`` on the driver's arguments of its names.
FUSED_UNIT = work_unit(_fused_tasks, drive_fused)

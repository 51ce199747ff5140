"""``rope_set_rows`` into a quantized cache (Q8_0, Q4_0): rotate, quantize and write K rows in one pass.

Per token n that writes (``keep[n]``: on threads only the last of duplicate indices, so the last row wins as in
ggml): its (H, D) head rows are rotated into a float32 scratch (H, D) of the thread (``_rope_rotate.rope_block``,
the float32 values ``rope_ext`` makes, with the cos/sin row ``cs[n]``), and each head row is quantized straight
into its blocks of the cache row ``idx[n]`` (``quant.quantize_row``: ggml's reference rounding). The bytes are
those of ``rope_ext`` followed by ``set_rows`` into the same ``Quantized``, without the rotated rows ever being
written out. Tokens are independent: above the threading rule's size, threads take tasks of TOKENS_PER_TASK tokens
from a shared counter (``_kernel.fetch_add``); a loop below it.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ._kernel import fetch_add
from ._rope_rotate import _EXACT, rope_block
from .quant import quantize_row

#: Tokens per parallel task (as ``_rope_drivers.TOKENS_PER_TASK``).
TOKENS_PER_TASK = 8


@numba.njit(**dict(_EXACT, inline="always"))
def _token(x, data, idx, keep, cs, n_pairs, interleaved, layout, code, n, scratch):
    if keep[n]:
        rope_block(x[n], scratch, cs[n], n_pairs, interleaved, np.bool_(False), layout, np.int64(0))
        row = data[idx[n]]
        for h in range(x.shape[1]):
            quantize_row(scratch[h], row[h], code)


@numba.njit(**_EXACT)
def rope_quantize_serial(x, data, idx, keep, cs, n_pairs, interleaved, layout, code):
    """Token by token in order: x (N, H, D) kernel view, data (R, H, bytes) the cache's bytes, cs (N, 2·n_pairs)."""
    scratch = np.empty((x.shape[1], x.shape[2]), np.float32)
    for n in range(x.shape[0]):
        _token(x, data, idx, keep, cs, n_pairs, interleaved, layout, code, n, scratch)


@numba.njit(**_EXACT)
def _tasks(x, data, idx, keep, cs, n_pairs, interleaved, layout, code, next_task):
    """One thread's share of ``rope_quantize_parallel``: the next task from ``next_task`` until none is left."""
    n_tokens = x.shape[0]
    n_tasks = (n_tokens + TOKENS_PER_TASK - 1) // TOKENS_PER_TASK
    scratch = np.empty((x.shape[1], x.shape[2]), np.float32)
    task = fetch_add(next_task)
    while task < n_tasks:
        for n in range(task * TOKENS_PER_TASK, min(n_tokens, (task + 1) * TOKENS_PER_TASK)):
            _token(x, data, idx, keep, cs, n_pairs, interleaved, layout, code, n, scratch)
        task = fetch_add(next_task)


@numba.njit(**dict(_EXACT, parallel=True))
def rope_quantize_parallel(x, data, idx, keep, cs, n_pairs, interleaved, layout, code, next_task, n_threads):
    """``rope_quantize_serial`` on ``n_threads`` threads, which take tasks of TOKENS_PER_TASK tokens from
    ``next_task`` (a zeroed int64 counter: a thread slowed down by another process takes fewer), each thread with
    its own scratch."""
    for _ in prange(n_threads):
        _tasks(x, data, idx, keep, cs, n_pairs, interleaved, layout, code, next_task)

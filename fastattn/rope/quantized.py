"""``rope_set_rows`` into a quantized cache (Q8_0, Q4_0): rotate, quantize and write K rows in one pass.

Per token n that writes (``keep[n]``: on threads only the last of duplicate indices, so the last row wins as in
ggml): its (H, D) head rows are rotated into a float32 scratch (H, D) of the thread (``rope.rotate.rope_block``,
the float32 values ``rope_ext`` makes, with the cos/sin row ``cs[n]``), and each head row is quantized straight
into its blocks of the cache row ``idx[n]`` (``quant.quantize_row``: ggml's reference rounding). The bytes are
those of ``rope_ext`` followed by ``set_rows`` into the same ``Quantized``, without the rotated rows ever being
written out. Tokens are independent: above the threading rule's size, threads take tasks from a shared counter
(``_core.kernel.fetch_add``); a loop below it. With a prebuilt table (``apply_rope_cache_set_rows``) a task is
TOKENS_PER_TASK tokens; otherwise (``rope_quantize_fused``) it is one CACHE_BLOCK of tokens whose cos/sin rows the
thread makes in its own scratch first (``rope.cache.cache_block``: the values ``rope_cache`` would store), as
``rope.drivers.drive_fused`` does for float caches, so the table is not built serially before the threads start.
The parallel drivers call their thread's task loop by address (``_core.kernel.call_unit``): linked into each driver,
its code would be optimised and emitted again there.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from .._core.kernel import call_unit, fetch_add, kernel, work_unit
from .cache import CACHE_BLOCK, cache_block
from .rotate import ROTATION_FASTMATH, rope_block
from ..quant.api import quantize_row

#: Tokens per parallel task (as ``rope.drivers.TOKENS_PER_TASK``).
TOKENS_PER_TASK = 8


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _token(x, data, idx, keep, cs_row, n_pairs, interleaved, layout, code, n, scratch):
    """Token n rotated with its cos/sin row ``cs_row`` and quantized into cache row idx[n], if ``keep[n]``."""
    if keep[n]:
        rope_block(x[n], scratch, cs_row, n_pairs, interleaved, np.bool_(False), layout, np.int64(0))
        row = data[idx[n]]
        for h in range(x.shape[1]):
            quantize_row(scratch[h], row[h], code)


@kernel(fastmath=ROTATION_FASTMATH)
def rope_quantize_serial(x, data, idx, keep, cs, n_pairs, interleaved, layout, code):
    """Token by token in order: x (N, H, D) kernel view, data (R, H, bytes) the cache's bytes, cs (N, 2·n_pairs)."""
    scratch = np.empty((x.shape[1], x.shape[2]), np.float32)
    for n in range(x.shape[0]):
        _token(x, data, idx, keep, cs[n], n_pairs, interleaved, layout, code, n, scratch)


@kernel(fastmath=ROTATION_FASTMATH)
def _tasks(x, data, idx, keep, cs, n_pairs, interleaved, layout, code, next_task):
    """One thread's share of ``rope_quantize_parallel``: the next task from ``next_task`` until none is left."""
    n_tokens = x.shape[0]
    n_tasks = (n_tokens + TOKENS_PER_TASK - 1) // TOKENS_PER_TASK
    scratch = np.empty((x.shape[1], x.shape[2]), np.float32)
    task = fetch_add(next_task)
    while task < n_tasks:
        for n in range(task * TOKENS_PER_TASK, min(n_tokens, (task + 1) * TOKENS_PER_TASK)):
            _token(x, data, idx, keep, cs[n], n_pairs, interleaved, layout, code, n, scratch)
        task = fetch_add(next_task)




@kernel(parallel=True, fastmath=ROTATION_FASTMATH)
def rope_quantize_parallel(unit, x, data, idx, keep, cs, n_pairs, interleaved, layout, code, next_task, n_threads):
    """``rope_quantize_serial`` on ``n_threads`` threads, which take tasks of TOKENS_PER_TASK tokens from
    ``next_task`` (a zeroed int64 counter: a thread slowed down by another process takes fewer), each thread with
    its own scratch. ``unit``: the handle of ``_tasks``."""
    for _ in prange(n_threads):
        call_unit(unit, (x, data, idx, keep, cs, n_pairs, interleaved, layout, code, next_task))


@kernel(fastmath=ROTATION_FASTMATH)
def _fused_tasks(x, data, idx, keep, pos, table, interleaved, layout, code, next_task):
    """One thread's share of ``rope_quantize_fused``: the next CACHE_BLOCK of tokens from ``next_task``, its cos/sin
    rows made in the thread's scratch, until none is left."""
    n_tokens = x.shape[0]
    n_pairs = table.w.shape[0]
    n_tasks = (n_tokens + CACHE_BLOCK - 1) // CACHE_BLOCK
    cs = np.empty((CACHE_BLOCK, 2 * n_pairs), np.float32)
    scratch = np.empty((x.shape[1], x.shape[2]), np.float32)
    task = fetch_add(next_task)
    while task < n_tasks:
        n0 = task * CACHE_BLOCK
        n1 = min(n_tokens, n0 + CACHE_BLOCK)
        cache_block(pos, table, cs, n0, n1)
        for n in range(n0, n1):
            _token(x, data, idx, keep, cs[n - n0], n_pairs, interleaved, layout, code, n, scratch)
        task = fetch_add(next_task)


@kernel(parallel=True, fastmath=ROTATION_FASTMATH)
def rope_quantize_fused(unit, x, data, idx, keep, pos, table, interleaved, layout, code, next_task, n_threads):
    """``rope_quantize_parallel`` with the cos/sin of positions ``pos`` (streams, N) made in the same pass from the
    pair table ``table`` (``rope.pairs.PairTable``), a CACHE_BLOCK of tokens per task. ``unit``: the handle of
    ``_fused_tasks``."""
    for _ in prange(n_threads):
        call_unit(unit, (x, data, idx, keep, pos, table, interleaved, layout, code, next_task))


#: ``rope_quantize_parallel``'s unit (``_core.kernel.work_unit``): ``_tasks`` on the driver's arguments of its names.
UNIT = work_unit(_tasks, rope_quantize_parallel)
#: ``rope_quantize_fused``'s unit: ``_fused_tasks`` on the driver's arguments of its names.
FUSED_UNIT = work_unit(_fused_tasks, rope_quantize_fused)

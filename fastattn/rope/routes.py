"""RoPE's routes (``_core.dispatch``): the entry kernels that take RoPE calls without Numba's dispatcher.

- ``rope.cached``: a decode-sized call with a prebuilt cos/sin table ``cs`` (``apply_rope_cache`` on 3-D x), run
  serially on the calling thread.
- ``rope.fused``: a call at int32 positions of one stream (``rope_ext`` on 3-D x), cos/sin made in the same pass:
  a prefill on ``n_threads`` threads (``rope.drivers.drive_fused``), a decode step on the calling thread (the
  same unit, called directly).
- ``rope.cached_quantized``: ``rope.cached``'s set-rows variant into a ``Quantized`` cache (its bytes): each
  token rotated into a scratch, its head rows quantized into the cache row.
- ``rope.cached_prefill``: a prefill-sized ``apply_rope_cache`` on 3-D x, on threads (``drive_parallel``): right
  after a kernel that streamed megabytes the general path's Python alone cost a fifth of such a call.

The first two have a set-rows variant, chosen by whether there is an index (``idx`` None or an int array: the
type picks the variant when the entry compiles): the rotated rows go to rows ``idx`` of a KV cache ``out``
((R, H·D) or (R, H, D)) instead of ``out``'s own token rows (``apply_rope_cache_set_rows``, ``rope_set_rows``);
their key is ``(x dtype, out dtype, out.ndim, idx dtype or None)``.

Every entry kernel checks what it relies on before it writes anything and returns False to decline (the op's
general path then runs the call, or raises its error).
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .._core.dispatch import (Route, aligned, array_type, c_contiguous, meta, overlaps, rows_writable, same_view,
                              unit_rows)
from .._core.kernel import any_layout, assume_contiguous, call_unit, kernel, unit_address, use_threads
from .drivers import CACHED_UNIT, FUSED_UNIT, drive_fused, drive_parallel
from .rotate import ROTATION_FASTMATH, PICK_OPTIONS, ROWS_UNIT, rope_block, token_layout_of
from .._core.validate import FLOAT32
from ..quant.api import blocks_fill, quantize_row

_F32_TABLE = array_type(FLOAT32, 2)
_INT64 = np.dtype(np.int64)
_UINT8 = np.dtype(np.uint8)
_FLOAT64 = np.dtype(np.float64)


def _out_types(x_dtype, out_dtype, out_ndim, idx_dtype) -> tuple:
    idx_type = types.none if idx_dtype is None else array_type(idx_dtype, 1)
    return array_type(x_dtype, 3), array_type(out_dtype, out_ndim), idx_type


# ---------------------------------------------------------------------------------------------------------------
# rope.cached
@kernel(fastmath=ROTATION_FASTMATH)
def _fits_table(n, d, cs, min_head_dim, exact_head_dim):
    """n tokens of head dim d fit the table: one cs row per token, d >= min_head_dim (== when exact), and cs
    has aligned unit-stride rows."""
    return (n == cs.shape[0] and d >= min_head_dim and not (exact_head_dim and d != min_head_dim)
            and unit_rows(meta(cs)))


def _cache_row(dst, r, n_heads, head_dim):
    """Row ``r`` of a KV cache (R, H·D) or (R, H, D) as its (H, D) block. Kernel-only."""
    raise NotImplementedError


@overload(_cache_row, jit_options=PICK_OPTIONS)
def _cache_row_impl(dst, r, n_heads, head_dim):
    if dst.ndim == 2:  # typed as the 3-D cache's rows are, so that rope_block compiles once for both
        return lambda dst, r, n_heads, head_dim: any_layout(assume_contiguous(dst[r]).reshape((n_heads, head_dim)))
    return lambda dst, r, n_heads, head_dim: dst[r]


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _rotate_tokens(x, out, cs, n_pairs, interleaved, max_bytes):
    """``apply_rope_cache``: out (N, H, D) of x's dtype (x itself in place), unless it declines."""
    n, h, d = x.shape
    if out.shape != x.shape or 2 * x.size * x.itemsize >= max_bytes:
        return False
    mx, mo = meta(x), meta(out)
    in_place = same_view(mo, mx)
    if not (unit_rows(mx) and unit_rows(mo)) or (overlaps(mo, mx) and not in_place) or overlaps(mo, meta(cs)):
        return False
    for i in range(n):
        rope_block(x[i], out[i], assume_contiguous(cs[i]), n_pairs, interleaved, in_place, np.int64(ROWS_UNIT),
                   np.int64(0))
    return True


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _write_tokens(x, dst, idx, cs, n_pairs, interleaved, max_bytes):
    """``apply_rope_cache_set_rows``: token i into row idx[i] of the cache dst, in order (the last of duplicate
    indices wins), unless it declines."""
    n, h, d = x.shape
    n_rows = dst.shape[0]
    if idx.shape[0] != n or dst.size != n_rows * h * d or x.size * (x.itemsize + dst.itemsize) >= max_bytes:
        return False
    if dst.shape[dst.ndim - 1] != (h * d if dst.ndim == 2 else d):
        return False
    if not rows_writable(dst, x, idx) or overlaps(meta(dst), meta(cs)):
        return False
    for i in range(n):
        rope_block(x[i], _cache_row(dst, idx[i], h, d), assume_contiguous(cs[i]), n_pairs, interleaved,
                   np.bool_(False), np.int64(ROWS_UNIT), np.int64(0))
    return True


def _cached_variant(x, out, idx, cs, n_pairs, interleaved, max_bytes):
    """``_rotate_tokens`` when idx is None, else ``_write_tokens``. Kernel-only."""
    raise NotImplementedError


@overload(_cached_variant, jit_options=PICK_OPTIONS)
def _cached_variant_impl(x, out, idx, cs, n_pairs, interleaved, max_bytes):
    if isinstance(idx, types.NoneType):
        return lambda x, out, idx, cs, n_pairs, interleaved, max_bytes: _rotate_tokens(
            x, out, cs, n_pairs, interleaved, max_bytes)
    return lambda x, out, idx, cs, n_pairs, interleaved, max_bytes: _write_tokens(
        x, out, idx, cs, n_pairs, interleaved, max_bytes)


@kernel(fastmath=ROTATION_FASTMATH)
def cached_entry(x, out, idx, cs, pairing, max_bytes):
    """Rotate x (N, H, D) by the table cs (N, 2·n_pairs) into out (idx None) or into rows idx of the cache out;
    ``pairing`` = (n_pairs, interleaved, min_head_dim, exact_head_dim) of the table (``RopeCache.pairing``).
    Returns False, having written nothing, unless x fits the table, the shapes match, fewer than ``max_bytes``
    move, the arrays have aligned unit-stride rows, out overlaps none of x (unless it is x, in place), idx and
    cs, and every index is in range."""
    n_pairs, interleaved, min_head_dim, exact_head_dim = pairing
    if not _fits_table(x.shape[0], x.shape[2], cs, min_head_dim, exact_head_dim):
        return False
    return _cached_variant(x, out, idx, cs, n_pairs, interleaved, max_bytes)


#: the types of a table's ``pairing``
PAIRING_TYPE = types.Tuple((types.int64, types.boolean, types.int64, types.boolean))
CACHED = Route("rope.cached", cached_entry, lambda x_dtype, out_dtype, out_ndim, idx_dtype: _out_types(
    x_dtype, out_dtype, out_ndim, idx_dtype) + (_F32_TABLE, PAIRING_TYPE, types.int64))


# ---------------------------------------------------------------------------------------------------------------
# rope.cached_quantized
@kernel(fastmath=ROTATION_FASTMATH)
def cached_quantized_entry(x, data, idx, cs, pairing, code, max_bytes):
    """``apply_rope_cache_set_rows`` into a quantized cache of type ``code`` whose bytes are ``data`` (R, H·row
    bytes) or (R, H, row bytes): token i rotated by the table cs into a float32 scratch (H, D), then each head row
    quantized into row idx[i] (as ``rope.quantized`` does), in order (the last of duplicate indices wins).
    Returns False, having written nothing, unless x fits the table, D values fill a head row's bytes, fewer than
    ``max_bytes`` move, x and data have aligned unit-stride rows, idx is aligned, data overlaps none of x, idx
    and cs, and every index is in range."""
    n_pairs, interleaved, min_head_dim, exact_head_dim = pairing
    n, h, d = x.shape
    last = data.shape[data.ndim - 1]
    if data.ndim == 2:
        if h == 0 or last % h != 0:
            return False
        row_bytes = last // h
    else:
        if data.shape[1] != h:
            return False
        row_bytes = last
    if (not _fits_table(n, d, cs, min_head_dim, exact_head_dim) or idx.shape[0] != n
            or not blocks_fill(d, row_bytes, code) or x.size * (x.itemsize + 1) >= max_bytes):
        return False
    if not rows_writable(data, x, idx) or overlaps(meta(data), meta(cs)):
        return False
    scratch = np.empty((h, d), np.float32)
    for i in range(n):
        rope_block(x[i], scratch, assume_contiguous(cs[i]), n_pairs, interleaved, np.bool_(False),
                   np.int64(ROWS_UNIT), np.int64(0))
        row = _cache_row(data, idx[i], h, row_bytes)
        for g in range(h):
            quantize_row(scratch[g], row[g], code)
    return True


#: Decode-sized ``apply_rope_cache_set_rows`` into a quantized cache, keyed on (x dtype, the cache's number of
#: axes, idx dtype).
CACHED_QUANTIZED = Route("rope.cached_quantized", cached_quantized_entry, lambda x_dtype, data_ndim, idx_dtype: (
    array_type(x_dtype, 3), array_type(_UINT8, data_ndim), array_type(idx_dtype, 1), _F32_TABLE, PAIRING_TYPE,
    types.int64, types.int64))


# ---------------------------------------------------------------------------------------------------------------
# rope.fused
@kernel(fastmath=ROTATION_FASTMATH)
def _increasing_in(idx, n_rows):
    """idx strictly increasing (no duplicates) and within [0, n_rows)."""
    n = idx.shape[0]
    if n == 0 or idx[0] < 0 or idx[n - 1] >= n_rows:
        return False
    for i in range(n - 1):
        if idx[i] >= idx[i + 1]:
            return False
    return True


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _fused_tokens(unit, x, out, pos, plan, min_bytes, n_threads):
    """``rope_ext``: out (N, H, D) of x's dtype (x itself in place), unless it declines."""
    streams, w, step_cos, step_sin, cos_scale, sin_scale, interleaved, n_dims = plan
    n_tokens, _, head_dim = x.shape
    if out.shape != x.shape:
        return False
    mx, mo, mp = meta(x), meta(out), meta(pos)
    in_place = same_view(mo, mx)
    if (overlaps(mo, mx) and not in_place) or overlaps(mo, mp) or not (aligned(mx) and aligned(mo)):
        return False
    x4, out4, pos2 = x[np.newaxis], out[np.newaxis], pos[np.newaxis]
    layout = token_layout_of(mx, mo, head_dim)
    if n_threads == 1 or 2 * x.size * x.itemsize < min_bytes:  # a decode step: the unit on this thread
        call_unit(unit, (x4, out4, None, None, pos2, streams, w, step_cos, step_sin, cos_scale, sin_scale,
                         interleaved, in_place, layout, np.zeros(1, np.int64)))
        return True
    use_threads(n_threads)
    drive_fused(unit, x4, out4, None, None, pos2, streams, w, step_cos, step_sin, cos_scale, sin_scale, interleaved,
                in_place, layout, np.zeros(1, np.int64), n_threads)
    return True


@kernel(inline=True, fastmath=ROTATION_FASTMATH)
def _fused_write(unit, x, dst, idx, pos, plan, min_bytes, n_threads):
    """``rope_set_rows``: token i into row idx[i] of the C-contiguous cache dst, idx strictly increasing (other
    indices: the general path, which sorts out duplicates), unless it declines."""
    streams, w, step_cos, step_sin, cos_scale, sin_scale, interleaved, n_dims = plan
    n_tokens, n_heads, head_dim = x.shape
    n_rows = dst.shape[0]
    md, mx, mi, mp = meta(dst), meta(x), meta(idx), meta(pos)
    if (dst.size != n_rows * n_heads * head_dim or dst.shape[dst.ndim - 1] != (head_dim if dst.ndim == 3 else
                                                                                 n_heads * head_dim)
            or idx.shape[0] != n_tokens):
        return False
    if not (c_contiguous(md) and aligned(mx) and aligned(mi)):
        return False
    if overlaps(md, mx) or overlaps(md, mi) or overlaps(md, mp) or not _increasing_in(idx, n_rows):
        return False
    # (R, H, D), typed as the general path's (R, H, D) caches are: one compiled _fused_tasks for both
    rows = any_layout(assume_contiguous(dst).reshape((n_rows, n_heads, head_dim)))
    x4, keep, pos2 = x[np.newaxis], np.ones(n_tokens, np.bool_), pos[np.newaxis]
    layout = token_layout_of(mx, meta(rows), head_dim)
    if n_threads == 1 or x.size * (x.itemsize + dst.itemsize) < min_bytes:  # a decode step: on this thread
        call_unit(unit, (x4, rows, idx, keep, pos2, streams, w, step_cos, step_sin, cos_scale, sin_scale,
                         interleaved, np.bool_(False), layout, np.zeros(1, np.int64)))
        return True
    use_threads(n_threads)
    drive_fused(unit, x4, rows, idx, keep, pos2, streams, w, step_cos, step_sin, cos_scale, sin_scale, interleaved,
                np.bool_(False), layout, np.zeros(1, np.int64), n_threads)
    return True


def _fused_variant(unit, x, out, idx, pos, plan, min_bytes, n_threads):
    """``_fused_tokens`` when idx is None, else ``_fused_write``. Kernel-only."""
    raise NotImplementedError


@overload(_fused_variant, jit_options=PICK_OPTIONS)
def _fused_variant_impl(unit, x, out, idx, pos, plan, min_bytes, n_threads):
    if isinstance(idx, types.NoneType):
        return lambda unit, x, out, idx, pos, plan, min_bytes, n_threads: _fused_tokens(
            unit, x, out, pos, plan, min_bytes, n_threads)
    return lambda unit, x, out, idx, pos, plan, min_bytes, n_threads: _fused_write(
        unit, x, out, idx, pos, plan, min_bytes, n_threads)


@kernel(fastmath=ROTATION_FASTMATH)
def fused_entry(unit, x, out, idx, pos, plan, min_bytes, n_threads):
    """RoPE of x (N, H, D) at positions pos (N,) (one stream: NORMAL or NEOX) with cos/sin made in the pass
    (``plan``: the parameters' tables, ``_args.rope.RopeParams.plan``), into out (idx None) or rows idx of the
    cache out, on ``n_threads`` threads, or on the calling thread (the unit called directly) when
    ``n_threads`` is 1 or fewer than ``min_bytes`` move (a decode step). Returns False, having written nothing,
    unless pos has one position per token, n_dims <= D, every array is aligned and out overlaps none of the
    inputs (unless it is x, in place); with idx: out C-contiguous and idx strictly increasing within range."""
    if pos.shape[0] != x.shape[0] or x.shape[2] < plan[7] or not aligned(meta(pos)):
        return False
    return _fused_variant(unit, x, out, idx, pos, plan, min_bytes, n_threads)


#: the types of a parameter set's ``plan`` (streams, w, step_cos, step_sin, cos_scale, sin_scale, interleaved,
#: n_dims)
PLAN_TYPE = types.Tuple((array_type(_INT64, 1),) + (array_type(_FLOAT64, 1),) * 3
                        + (types.float64, types.float64, types.boolean, types.int64))


def _fused_unit(x_dtype, out_dtype, out_ndim, idx_dtype) -> tuple:
    """The handle of ``_fused_tasks`` for the types ``_fused_tokens`` / ``_fused_write`` hand ``drive_fused``."""
    x4 = array_type(x_dtype, 4)
    if idx_dtype is None:
        out, idx, keep, in_place = array_type(out_dtype, 4), types.none, types.none, types.boolean
    else:  # the cache as (R, H, D); a fresh keep mask
        out = array_type(out_dtype, 3)
        idx, keep, in_place = array_type(idx_dtype, 1), types.Array(types.boolean, 1, "C"), types.boolean
    return (unit_address(FUSED_UNIT[0], (x4, out, idx, keep, array_type(np.dtype(np.int32), 2))
                         + tuple(PLAN_TYPE.types[:6]) + (types.boolean, in_place, types.int64,
                                                         types.Array(types.int64, 1, "C"))),)


FUSED = Route("rope.fused", fused_entry, lambda x_dtype, out_dtype, out_ndim, idx_dtype: _out_types(
    x_dtype, out_dtype, out_ndim, idx_dtype) + (array_type(np.dtype(np.int32), 1), PLAN_TYPE, types.int64,
                                                types.int64), _fused_unit)


# ---------------------------------------------------------------------------------------------------------------
# rope.cached_prefill
@kernel(fastmath=ROTATION_FASTMATH)
def cached_prefill_entry(unit, x, out, cs, pairing, min_bytes, n_threads):
    """``apply_rope_cache`` of a prefill: x and out (N, H, D) of one dtype (out may be x), the table cs, on
    ``n_threads`` threads. Returns False, having written nothing, unless out has x's shape, x fits the table, at
    least ``min_bytes`` move over two tokens or more, x and out are aligned and out overlaps neither x (unless it
    is x) nor cs."""
    n_pairs, interleaved, min_head_dim, exact_head_dim = pairing
    n, _, d = x.shape
    if out.shape != x.shape or n < 2 or 2 * x.size * x.itemsize < min_bytes:
        return False
    if not _fits_table(n, d, cs, min_head_dim, exact_head_dim):
        return False
    mx, mo = meta(x), meta(out)
    in_place = same_view(mo, mx)
    if (overlaps(mo, mx) and not in_place) or overlaps(mo, meta(cs)) or not (aligned(mx) and aligned(mo)):
        return False
    use_threads(n_threads)
    drive_parallel(unit, x[np.newaxis], out[np.newaxis], None, None, cs, n_pairs, interleaved, in_place,
                   token_layout_of(mx, mo, d), np.zeros(1, np.int64), n_threads)
    return True


CACHED_PREFILL = Route("rope.cached_prefill", cached_prefill_entry, lambda x_dtype: (
    array_type(x_dtype, 3), array_type(x_dtype, 3), _F32_TABLE, PAIRING_TYPE, types.int64, types.int64),
    lambda x_dtype: (unit_address(CACHED_UNIT[0], (array_type(x_dtype, 4), array_type(x_dtype, 4), types.none,
                                                   types.none, _F32_TABLE, types.int64, types.boolean,
                                                   types.boolean, types.int64, types.Array(types.int64, 1, "C"))),))


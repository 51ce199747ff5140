"""The decode paths' row arithmetic (``attention.rows``): every variant against float64 NumPy, and the variants
against each other bit for bit where the module says they agree."""
from __future__ import annotations

import numba
import numpy as np
import pytest

import fastattn
from fastattn import reference
from fastattn.attention import rows as _attention_rows
from fastattn.attention.rows import axpy1, axpy4, axpy4x2, axpy4x4, dot1, dot4, dot4x2
from fastattn._core.kernel import kernel_view
from strategies import BFLOAT16


@numba.njit(cache=False)
def _all_dots(qs, kf, o1, o2, kcs):
    """Scores of query rows 0..3 against the K rows at o1 and o2 by dot4x2, dot4 and dot1: (3, 2, 4)."""
    out = np.empty((3, 2, 4), np.float32)
    s = dot4x2(qs, np.int64(0), kf, o1, o2, kcs)
    for x in range(8):
        out[0, x // 4, x % 4] = s[x]
    for r, o in enumerate((o1, o2)):
        a, b, c, d = dot4(qs, np.int64(0), kf, o, kcs)
        out[1, r, 0], out[1, r, 1], out[1, r, 2], out[1, r, 3] = a, b, c, d
        for h in range(4):
            out[2, r, h] = dot1(qs, np.int64(h), kf, o, kcs)
    return out


@numba.njit(cache=False)
def _all_updates(A, p, vf, offsets, vcs):
    """A (3, 4 * DV): row 0 by axpy4x4, row 1 by axpy4x2 twice, row 2 by axpy4 and axpy1 row after row."""
    DV = A.shape[1] // 4
    o1, o2, o3, o4 = offsets[0], offsets[1], offsets[2], offsets[3]
    axpy4x4(A[0], 0, DV, p, np.int64(0), (0, 1, 2, 3), vf, (o1, o2, o3, o4), vcs)
    axpy4x2(A[1], 0, DV, p, np.int64(0), (0, 1), vf, (o1, o2), vcs)
    axpy4x2(A[1], 0, DV, p, np.int64(0), (2, 3), vf, (o3, o4), vcs)
    for r in range(4):
        axpy4(A[2], 0, DV, p, np.int64(0), r, vf, offsets[r], vcs)


@numba.njit(cache=False)
def _updates_by_one_head(A, p, vf, offsets, vcs):
    DV = A.shape[0] // 4
    for r in range(4):
        for h in range(4):
            axpy1(A, h * DV, DV, p[h, r], vf, offsets[r], vcs)


def _rows(rng, n, width, stride, dtype):
    """A flat 1-D C array holding n rows of ``width`` values at column stride ``stride`` (as the kernels see it),
    the rows' offsets and their values in float64."""
    flat = rng.standard_normal(3 + n * width * stride).astype(dtype)
    offsets = np.array([3 + r * width * stride for r in range(n)], np.int64)
    values = np.stack([flat[o:o + width * stride:stride] for o in offsets]).astype(np.float64)
    return kernel_view(flat), offsets, values


_KERNELS_BY_LANES: dict = {}


@pytest.fixture(params=[8, 16], ids=["8 lanes", "16 lanes"])
def row_kernels(request, monkeypatch):
    """The test kernels compiled afresh with the row code's vectors of 8 or 16 floats (``wide_lanes`` picks by
    the machine: both are checked on every machine); one set of dispatchers per lane count, each compiling a
    signature the first time a test calls it (with that lane count patched in)."""
    monkeypatch.setattr(_attention_rows, "wide_lanes", lambda: request.param)
    if request.param not in _KERNELS_BY_LANES:
        _KERNELS_BY_LANES[request.param] = tuple(numba.njit(cache=False)(f.py_func)
                                                 for f in (_all_dots, _all_updates, _updates_by_one_head))
    return _KERNELS_BY_LANES[request.param]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("D,stride", [(128, 1), (40, 1), (13, 1), (7, 1), (24, 3)])
def test_dot_products_match_float64_and_agree_bit_for_bit(dtype, D, stride, row_kernels):
    _all_dots, _, _ = row_kernels
    rng = np.random.default_rng(D + stride)
    qs = rng.standard_normal((4, D)).astype(np.float32)
    flat, offsets, k = _rows(rng, 2, D, stride, dtype)
    got = _all_dots(qs, flat, offsets[0], offsets[1], stride)
    want = (qs.astype(np.float64) @ k.T).T  # (row, head)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5 * np.sqrt(D))
    assert np.array_equal(got[0], got[1]) and np.array_equal(got[0], got[2])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("D,stride", [(128, 1), (40, 1), (13, 1), (7, 1), (24, 3)])
def test_row_updates_match_float64_and_single_rows_agree_bit_for_bit(dtype, D, stride, row_kernels):
    _, _all_updates, _updates_by_one_head = row_kernels
    rng = np.random.default_rng(D * stride)
    p = rng.random((4, 32)).astype(np.float32)
    flat, offsets, v = _rows(rng, 4, D, stride, dtype)
    start = rng.standard_normal((4 * D,)).astype(np.float32)
    A = np.tile(start, (3, 1))
    _all_updates(A, p, flat, offsets, stride)
    want = start.astype(np.float64).reshape(4, D) + p[:, :4].astype(np.float64) @ v
    for row in A:
        np.testing.assert_allclose(row.reshape(4, D), want, rtol=1e-5, atol=1e-5)
    one = start.copy()
    _updates_by_one_head(one, p, flat, offsets, stride)
    assert np.array_equal(one, A[2])


def _quantized_rows(rng, n, width, qtype):
    """A flat byte array holding n quantized rows of ``width`` values (3 guard bytes first, 5 between rows), the
    rows' byte offsets and their dequantized values in float64."""
    x = rng.standard_normal((n, width)).astype(np.float32)
    rows = fastattn.quantize(x, qtype).data
    pitch = rows.shape[1] + 5
    flat = np.full(3 + n * pitch, 0xFF, np.uint8)
    offsets = np.array([3 + r * pitch for r in range(n)], np.int64)
    for r, o in enumerate(offsets):
        flat[o:o + rows.shape[1]] = rows[r]
    values = reference.dequantize(fastattn.Quantized(rows, qtype)).astype(np.float64)
    return flat.view(np.int8 if qtype == "q8_0" else np.uint8), offsets, values


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("D", [32, 128])
def test_quantized_dot_products_match_float64_and_agree_bit_for_bit(qtype, D, row_kernels):
    _all_dots, _, _ = row_kernels
    rng = np.random.default_rng(D)
    qs = rng.standard_normal((4, D)).astype(np.float32)
    flat, offsets, k = _quantized_rows(rng, 2, D, qtype)
    got = _all_dots(qs, flat, offsets[0], offsets[1], 1)
    want = (qs.astype(np.float64) @ k.T).T
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5 * np.sqrt(D))
    assert np.array_equal(got[0], got[1]) and np.array_equal(got[0], got[2])


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("D", [32, 128])
def test_quantized_row_updates_match_float64_and_single_rows_agree_bit_for_bit(qtype, D, row_kernels):
    _, _all_updates, _updates_by_one_head = row_kernels
    rng = np.random.default_rng(D + 1)
    p = rng.random((4, 32)).astype(np.float32)
    flat, offsets, v = _quantized_rows(rng, 4, D, qtype)
    start = rng.standard_normal((4 * D,)).astype(np.float32)
    A = np.tile(start, (3, 1))
    _all_updates(A, p, flat, offsets, 1)
    want = start.astype(np.float64).reshape(4, D) + p[:, :4].astype(np.float64) @ v
    for row in A:
        np.testing.assert_allclose(row.reshape(4, D), want, rtol=1e-5, atol=1e-5)
    one = start.copy()
    _updates_by_one_head(one, p, flat, offsets, 1)
    assert np.array_equal(one, A[2])


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantized_rows_with_an_infinite_scale_give_the_dequantized_values_infinities_and_nans(qtype,
                                                                                              row_kernels):
    """A block whose float16 scale is inf: each product with its dequantized values (inf · q, NaN where q is 0)
    comes out as NumPy's float32 evaluation on them (a NaN where they hold one, the same infinities elsewhere),
    and the other row of a pair keeps its finite value."""
    _all_dots, _all_updates, _ = row_kernels
    rng = np.random.default_rng(7)
    D = 64
    # positive queries: a block's partial sums all have one sign, so d · (q · k) would be inf where the
    # dequantized values' products hold a NaN (inf · 0)
    qs = (np.abs(rng.standard_normal((4, D))) + 0.1).astype(np.float32)
    p = rng.random((4, 32)).astype(np.float32)
    for with_zero in (True, False):
        flat, offsets, _ = _quantized_rows(rng, 4, D, qtype)
        raw = flat.view(np.uint8)
        width = 34 if qtype == "q8_0" else 18
        block = raw[offsets[1] + width:offsets[1] + 2 * width]  # row 1's second block
        block[:2] = np.array([np.inf], np.float16).view(np.uint8)
        if qtype == "q8_0":  # values 5, or 5 and 0 alternating
            block[2:] = 5
            block[2::2] = 0 if with_zero else 5
        else:  # byte 0x9n holds the values n - 8 and 1
            block[2:] = 0x99
            block[2::2] = 0x98 if with_zero else 0x99
        rows = np.stack([raw[o:o + 2 * width] for o in offsets])
        with np.errstate(invalid="ignore", over="ignore"):
            values = reference.dequantize(fastattn.Quantized(rows.copy(), qtype)).astype(np.float32)
            want_dots = (qs @ values.T).T  # (row, head)
            want_update = p[:, :4] @ values
        dots = _all_dots(qs, flat, offsets[0], offsets[1], 1)
        for variant in dots:
            assert np.array_equal(np.isnan(variant), np.isnan(want_dots[:2]))
            finite = np.isfinite(want_dots[:2])
            np.testing.assert_allclose(variant[finite], want_dots[:2][finite], rtol=1e-5, atol=1e-4)
            assert np.array_equal(variant[np.isinf(want_dots[:2])], want_dots[:2][np.isinf(want_dots[:2])])
        A = np.zeros((3, 4 * D), np.float32)
        _all_updates(A, p, flat, offsets, 1)
        for row in A:
            got = row.reshape(4, D)
            assert np.array_equal(np.isnan(got), np.isnan(want_update))
            assert np.array_equal(got[np.isinf(want_update)], want_update[np.isinf(want_update)])


def _lane_sums(n: int, lanes: int):
    """A kernel writing hsum_any and hsum_many of n vectors of ``lanes`` floats from x: out[:n], out[n:]."""
    from numba import types
    from numba.extending import intrinsic

    from fastattn._core.simd import const, hsum_any, hsum_many, load_floats

    @intrinsic
    def both(typingctx, x, out):
        def codegen(context, builder, signature, args):
            xs = context.make_array(signature.args[0])(context, builder, args[0])
            outs = context.make_array(signature.args[1])(context, builder, args[1])
            vectors = [load_floats(builder, xs.data, const(i * lanes), lanes) for i in range(n)]
            for i, total in enumerate([hsum_any(builder, v) for v in vectors] + hsum_many(builder, vectors)):
                builder.store(total, builder.gep(outs.data, [const(i)]))
            return context.get_dummy_value()
        return types.none(x, out), codegen

    return numba.njit(cache=False)(lambda x, out: both(x, out))


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_side_by_side_lane_sums_equal_one_by_one_sums(n, lanes):
    sums = _lane_sums(n, lanes)
    rng = np.random.default_rng(n * lanes)
    for _ in range(50):
        x = (rng.standard_normal(n * lanes) * 10.0 ** rng.integers(-6, 7, n * lanes)).astype(np.float32)
        out = np.empty(2 * n, np.float32)
        sums(x, out)
        np.testing.assert_array_equal(out[n:], out[:n])
        np.testing.assert_allclose(out[:n], x.reshape(n, lanes).astype(np.float64).sum(axis=1), rtol=1e-5,
                                   atol=1e-5 * np.abs(x).reshape(n, lanes).sum(axis=1).max())

"""The shared kernel plumbing: half-precision conversions, the polynomial exp, compile flags."""
import collections
import re
import subprocess
import sys

import numba
import numpy as np
import pytest

from numba import prange

from fastattn._core.kernel import (FASTMATH, KERNEL_OPTIONS, call_any_layout, call_unit, check_unit, fast_exp,
                                   from_f32, kernel, kernel_view, to_f32, unit_address)
from fastattn._core import validate as _validate
from strategies import BFLOAT16

ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@kernel
def _widen(bits, out):
    for i in range(bits.size):
        out[i] = to_f32(bits[i])


@kernel
def _narrow(values, out):
    for i in range(values.size):
        out[i] = from_f32(values[i], out)


@kernel
def _exp_all(x, out):
    for i in range(x.size):
        out[i] = fast_exp(x[i])


@kernel
def _weighted_sum(strided, plain, out):
    """out[0] = sum of strided[i, j] * (i + 1) + plain[i, j] * (j + 1)."""
    total = 0.0
    for i in range(strided.shape[0]):
        for j in range(strided.shape[1]):
            total += strided[i, j] * (i + 1) + plain[i, j] * (j + 1)
    out[0] = total


def _same_floats(a, b):
    return np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[~np.isnan(a)].view(np.uint32),
                                                                     b[~np.isnan(b)].view(np.uint32))


def test_float16_widening_is_exact_on_all_65536_patterns():
    out = np.empty(ALL_BITS.size, np.float32)
    _widen(ALL_BITS, out)
    assert _same_floats(out, ALL_BITS.view(np.float16).astype(np.float32))


@pytest.mark.skipif(BFLOAT16 is None, reason="ml_dtypes not installed")
def test_bfloat16_widening_is_exact_on_all_65536_patterns():
    out = np.empty(ALL_BITS.size, np.float32)
    _widen(ALL_BITS.view(np.int16), out)
    assert _same_floats(out, ALL_BITS.view(BFLOAT16).astype(np.float32))


def _hard_float32_values():
    rng = np.random.default_rng(7)
    mixed = rng.standard_normal(200_000) * 10.0 ** rng.uniform(-10, 6, 200_000)
    # every float16 value and the midpoints between neighbours: the ties that test round-to-nearest-even
    halves = ALL_BITS.view(np.float16).astype(np.float32)
    halves = halves[np.isfinite(halves)]
    halves.sort()
    mids = (halves[:-1].astype(np.float64) + halves[1:]) / 2
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 65519.99, 6e-8, 3e-8, 1e-9])
    return np.concatenate([mixed, halves, mids, special]).astype(np.float32)


def test_float16_narrowing_rounds_to_nearest_even_like_numpy():
    values = _hard_float32_values()
    out = np.empty(values.size, np.uint16)
    _narrow(values, out)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(out[~nan], expected[~nan])
    assert np.isnan(out[nan].view(np.float16)).all()


@pytest.mark.skipif(BFLOAT16 is None, reason="ml_dtypes not installed")
def test_bfloat16_narrowing_rounds_to_nearest_even_like_ml_dtypes():
    values = _hard_float32_values()
    out = np.empty(values.size, np.int16)
    _narrow(values, out)
    expected = values.astype(BFLOAT16).view(np.int16)
    nan = np.isnan(values)
    assert np.array_equal(out[~nan], expected[~nan])
    assert np.isnan(out[nan].view(BFLOAT16).astype(np.float32)).all()


def test_kernel_view_maps_dtypes_to_kernel_types():
    assert kernel_view(np.zeros(3, np.float16)).dtype == np.uint16
    assert kernel_view(np.zeros(3, np.float32)).dtype == np.float32
    if BFLOAT16 is not None:
        assert _validate.is_bfloat16(BFLOAT16) and not _validate.is_bfloat16(np.dtype("V2"))
        assert kernel_view(np.zeros(3, BFLOAT16)).dtype == np.int16


BFLOAT16_AFTER_IMPORT = """
import sys
import numpy as np
import fastattn
import fastattn.reference as reference
assert "ml_dtypes" not in sys.modules, "import fastattn imported ml_dtypes"
import ml_dtypes
dst = np.zeros((8, 64), ml_dtypes.bfloat16)
expected = dst.copy()
src = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
reference.set_rows(expected, src, np.array([1, 5]))
assert expected.any()
fastattn.set_rows(dst, src, np.array([1, 5]))
assert np.array_equal(dst.view(np.int16), expected.view(np.int16))
try:
    fastattn.set_rows(dst.astype(np.float64), src, np.array([1, 5]))
except TypeError as error:
    assert "bfloat16" in str(error), error
else:
    raise AssertionError("float64 dst was taken")
"""


@pytest.mark.skipif(BFLOAT16 is None, reason="ml_dtypes not installed")
def test_import_leaves_ml_dtypes_alone_and_bfloat16_works_once_imported():
    """``import fastattn`` does not import ml_dtypes (over a second); a bfloat16 array made after it is taken."""
    subprocess.run([sys.executable, "-c", BFLOAT16_AFTER_IMPORT], check=True)


def test_fast_exp_relative_error_and_limits():
    x = np.linspace(-87.0, 88.0, 1_000_001, dtype=np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    exact = np.exp(x.astype(np.float64))
    rel = np.abs(out - exact) / exact
    assert rel.max() < 3e-7
    special = np.array([-np.inf, -1e4, -200.0, 0.0, 1e4, np.inf], np.float32)
    out = np.empty_like(special)
    _exp_all(special, out)
    assert out.tolist() == [0.0, 0.0, 0.0, 1.0, np.inf, np.inf]


def test_fastmath_flags_exclude_nnan_and_ninf():
    assert "nnan" not in FASTMATH and "ninf" not in FASTMATH and "fast" not in FASTMATH


def test_masked_softmax_guard_survives_the_flags():
    """The failure fastmath=True causes: an `== -inf` guard folded away, a fully masked row turning NaN."""

    @kernel
    def softmax_row(scores, out):
        m = -np.inf
        for s in scores:
            m = max(m, s)
        if m == -np.inf:
            out[:] = 0.0
            return
        total = 0.0
        for i in range(scores.size):
            out[i] = fast_exp(scores[i] - m)
            total += out[i]
        for i in range(scores.size):
            out[i] /= total

    out = np.full(4, 7.0, np.float32)
    softmax_row(np.full(4, -np.inf, np.float32), out)
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]
    softmax_row(np.array([-np.inf, 0.0, -np.inf, 0.0], np.float32), out)
    assert out.tolist() == [0.0, 0.5, 0.0, 0.5]


def test_contiguous_exp_loop_vectorises_to_wide_fma():
    """8-wide (ymm) FMAs on AVX2 machines; LLVM picks 16-wide (zmm) ones on AVX-512 hosts (znver4)."""
    def exp_loop(x, out):
        for i in range(x.size):
            out[i] = fast_exp(x[i])

    uncached = numba.njit(**dict(KERNEL_OPTIONS, cache=False))(exp_loop)  # cached code cannot be inspected
    x = np.zeros(64, np.float32)
    uncached(x, np.empty_like(x))
    asm = uncached.inspect_asm(uncached.signatures[0])
    assert re.search(r"vfmadd\w+\s+.*[yz]mm", asm), "the float32 exp loop did not vectorise to 8/16-wide FMAs"


def test_import_reference_does_not_load_numba():
    code = "import sys, fastattn.reference; assert 'numba' not in sys.modules, 'numba was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_call_any_layout_keys_every_layout_it_types():
    """One entry per layout typeof tells apart at the positions not typed 'A' (C, F, neither; read-only), and
    one for every layout at the 'A' positions: each call reads its arrays through their own strides."""
    base = np.arange(24.0).reshape(4, 6)
    readonly = base.copy()
    readonly.flags.writeable = False
    # C, F, neither (a column slice), read-only; F comes before the slice, which an F entry would misread
    layouts = [base, np.asfortranarray(base), np.arange(48.0).reshape(4, 12)[:, ::2], readonly]
    for plain in layouts:
        for strided in layouts:
            out = np.zeros(1)
            call_any_layout(_weighted_sum, (0,), strided, plain, out)
            i, j = np.indices(plain.shape)
            assert out[0] == pytest.approx(np.sum(strided * (i + 1) + plain * (j + 1)))


_Group = collections.namedtuple("_Group", "values scale")


@kernel
def _group_sum(group, extra, out):
    """sum(group.values) * group.scale + extra[0]: a parameter group (named tuple) holding an array and a scalar."""
    total = 0.0
    for i in range(group.values.shape[0]):
        for j in range(group.values.shape[1]):
            total += group.values[i, j]
    out[0] = total * group.scale + extra[0]


def test_call_any_layout_keys_parameter_groups_by_their_elements():
    """A tuple argument is keyed by its class and its elements: arrays of other dtypes or layouts and scalars of
    other types inside it get entries of their own (one shared key would run code compiled for other types)."""
    values = np.arange(12.0).reshape(3, 4)
    for group in (_Group(values, 2.0), _Group(values.astype(np.float32), np.float32(2.0)),
                  _Group(values[:, ::2], 2), _Group(np.asfortranarray(values), 0.5)):
        out = np.zeros(1)
        call_any_layout(_group_sum, (0,), group, np.array([1.0]), out)
        assert out[0] == np.sum(group[0], dtype=np.float64) * group[1] + 1.0
    # float64 values of every layout with a float scale, with an int scale, float32 values with a float32 scale
    assert len(_group_sum.signatures) == 3
    assert all(sig[0].types[0].layout == "A" for sig in _group_sum.signatures)


@kernel
def _add_row_unit(a, out, i):
    """The work unit of the driver below: out[i] = the sum of row i of a."""
    total = 0.0
    for j in range(a.shape[1]):
        total += a[i, j]
    out[i] = total


@kernel
def _rows_driver(unit, a, out):
    for i in range(a.shape[0]):
        call_unit(unit, (a, out, i))


@kernel(parallel=True)
def _rows_driver_parallel(unit, a, out):
    for i in prange(a.shape[0]):
        call_unit(unit, (a, out, np.int64(i)))


@pytest.mark.parametrize("driver", [_rows_driver, _rows_driver_parallel])
def test_a_driver_runs_its_unit_by_address(driver):
    """``call_any_layout(..., unit=...)``: the unit compiled once for the driver's argument types and called by
    address, serially and from prange threads, on strided and contiguous views."""
    for a in (np.arange(35.0).reshape(5, 7), np.arange(70.0).reshape(5, 14)[:, ::2]):
        out = np.zeros(5)
        call_any_layout(driver, (0, 1), a, out, unit=(_add_row_unit, (0, 1), (numba.types.int64,)))
        assert np.array_equal(out, a.sum(axis=1))


def test_a_unit_of_other_argument_types_is_not_called():
    """A handle whose tag is another signature's (here the unit compiled for float32 rows, handed to a driver of
    float64 rows) is never called: nothing is written and the Python side raises."""
    wrong = unit_address(_add_row_unit, (numba.types.Array(numba.types.float32, 2, "A"),
                                         numba.types.Array(numba.types.float64, 1, "A"), numba.types.int64))
    a = np.arange(6.0).reshape(2, 3)
    out = np.zeros(2)
    _rows_driver(wrong, a, out)
    assert np.array_equal(out, np.zeros(2))
    with pytest.raises(RuntimeError, match="other argument types"):
        check_unit(wrong)
    wrong[2] = 0

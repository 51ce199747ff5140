"""SET_ROWS: fast == reference bit for bit on every dtype, layout, index broadcast and thread count."""
import re
import sys

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fastattn
import fastattn.reference as ref
from fastattn._core import threads as _threads
from fastattn._core.kernel import HALF_VIEW, KERNEL_OPTIONS
from fastattn._core.validate import FLOAT16, FLOAT32, INDEX_INTS
from strategies import STORAGE_FLOATS
from strategies import dims, fill, float_dtypes, index_sets, seeds, strided, thread_counts


@st.composite
def set_rows_cases(draw, max_rows=40, max_d=70):
    lead = tuple(draw(st.lists(dims(1, 3), min_size=0, max_size=2)))
    n_rows, n, d = draw(dims(1, max_rows)), draw(st.one_of(st.just(0), dims(1, 12))), draw(dims(1, max_d))
    idx_lead = tuple(draw(st.sampled_from((m, 1))) for m in lead[len(lead) - draw(st.integers(0, len(lead))):])
    dst = draw(strided(lead + (n_rows, d), draw(float_dtypes)))
    src = draw(strided(lead + (n, d), draw(float_dtypes), kind=draw(st.sampled_from(("normal", "mixed")))))
    rows = [draw(index_sets(n_rows, n)) for _ in range(int(np.prod(idx_lead)))]
    values = np.array(rows, np.int64).reshape(idx_lead + (n,))
    idx = draw(strided(idx_lead + (n,), draw(st.sampled_from(INDEX_INTS)), values=values)).array
    return dst, src, idx


def check_against_reference(dst, src, idx):
    expected = dst.array.copy()
    ref.set_rows(expected, src.array, idx)
    assert fastattn.set_rows(dst.array, src.array, idx) is dst.array
    assert dst.array.tobytes() == expected.tobytes(), "not bit-exact with the reference"
    dst.assert_outside_unchanged()
    src.assert_all_unchanged()


@given(case=set_rows_cases(), threads=thread_counts)
def test_fast_matches_reference_bit_for_bit(case, threads):
    with fastattn.num_threads(threads):
        check_against_reference(*case)


@given(dst_dtype=st.sampled_from((FLOAT16, FLOAT32)), src_dtype=st.sampled_from((FLOAT32, FLOAT16)),
       n_slots=st.sampled_from((4, 64, 4096)), step=st.sampled_from((1, 2, 3)), data=st.data())
def test_parallel_writes_keep_last_row_wins(dst_dtype, src_dtype, n_slots, step, data):
    """> 1 MiB moved, so the prange kernel runs; few slots force many duplicates, ``step`` skews the slots."""
    rng = np.random.default_rng(data.draw(seeds))
    n, d = 512, 1024 + data.draw(st.sampled_from((0, 5)))
    dst = data.draw(strided((step * n_slots, d), dst_dtype))
    src = data.draw(strided((n, d), src_dtype))
    idx = (rng.integers(0, n_slots, n) * step).astype(data.draw(st.sampled_from(INDEX_INTS)))
    assert src.array.size * (src.array.itemsize + dst.array.itemsize) >= _threads.PARALLEL_MIN_BYTES
    with fastattn.num_threads(2):
        check_against_reference(dst, src, idx)


def test_last_row_wins_explicitly():
    dst = np.zeros((3, 4), np.float16)
    src = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)
    fastattn.set_rows(dst, src, np.array([2, 0, 2, 0, 2]))
    assert dst.tolist() == [src[3].tolist(), [0] * 4, src[4].tolist()]


def test_conversion_rounds_to_nearest_even_like_astype():
    """Every float16 value and every midpoint between neighbours (the ties) plus specials, through set_rows."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    halves = np.sort(halves[np.isfinite(halves)])
    mids = ((halves[:-1].astype(np.float64) + halves[1:]) / 2).astype(np.float32)
    values = np.concatenate([halves, mids, np.float32([65520, 65519.99, 1e9, -1e9, 3e-8])])
    values = values[: values.size // 64 * 64].reshape(-1, 64)
    for dtype in STORAGE_FLOATS:
        dst = np.zeros_like(values, dtype=dtype)
        fastattn.set_rows(dst, values, np.arange(values.shape[0]))
        with np.errstate(over="ignore"):
            assert dst.tobytes() == values.astype(dtype).tobytes()


def test_index_broadcast_over_leading_axes_as_ggml():
    """idx (2, 1, n) against src (2, 3, n, D): batch (a, b) uses idx[a, 0]."""
    rng = np.random.default_rng(4)
    dst = np.zeros((2, 3, 6, 4), np.float32)
    src = fill(rng, (2, 3, 2, 4), FLOAT32)
    idx = np.array([[[5, 1]], [[0, 3]]])
    fastattn.set_rows(dst, src, idx)
    for a in range(2):
        for b in range(3):
            assert np.array_equal(dst[a, b, idx[a, 0]], src[a, b])
            assert not dst[a, b, [r for r in range(6) if r not in idx[a, 0]]].any()


def test_leading_axes_that_do_not_merge_run_block_by_block():
    """A permuted (batch-transposed) dst cannot be viewed as one batch axis: the Python loop over blocks."""
    rng = np.random.default_rng(5)
    parent = np.zeros((3, 2, 8, 16), np.float16)
    dst = parent.transpose(1, 0, 2, 3)  # (2, 3, 8, 16), leading strides not mergeable
    src = fill(rng, (2, 3, 4, 16), FLOAT32)
    idx = rng.integers(0, 8, (3, 4))
    expected = dst.copy()
    ref.set_rows(expected, src, idx)
    fastattn.set_rows(dst, src, idx)
    assert dst.tobytes() == expected.tobytes()
    before = parent.tobytes()
    bad = idx.copy()
    bad[2, 3] = 8  # in the last block: the earlier blocks must not have been written either
    with pytest.raises(ValueError, match=r"idx must be in \[0, 8\).*got 8 at idx\[2, 3\]"):
        fastattn.set_rows(dst, src + 1, bad)
    assert parent.tobytes() == before


def test_zero_rows_is_a_no_op():
    dst = np.ones((4, 8), np.float16)
    assert fastattn.set_rows(dst, np.zeros((0, 8), np.float32), np.zeros(0, np.int64)) is dst
    assert (dst == 1).all()


def _bad_calls():
    """(description, call(module, dst, src, idx), exception, message pattern)."""
    return [
        ("index R", lambda m, d, s, i: m.set_rows(d, s, np.array([0, 1, 16, 2])), ValueError,
         r"idx must be in \[0, 16\).*got 16 at idx\[2\]"),
        ("index negative", lambda m, d, s, i: m.set_rows(d, s, np.array([0, -1, 3, 2], np.int32)), ValueError,
         r"got -1 at idx\[1\]"),
        ("dst dtype", lambda m, d, s, i: m.set_rows(d.astype(np.float64), s, i), TypeError, "dst must have dtype"),
        ("dst 1-d", lambda m, d, s, i: m.set_rows(d[0], s[0], i), ValueError, "dst must have at least 2"),
        ("src dtype", lambda m, d, s, i: m.set_rows(d, s.astype(np.int16), i), TypeError, "src must have dtype"),
        ("src rank", lambda m, d, s, i: m.set_rows(d, s[None], i), ValueError, "src must have 2 axes"),
        ("src width", lambda m, d, s, i: m.set_rows(d, s[:, :3], i), ValueError, "src must have shape"),
        ("idx dtype", lambda m, d, s, i: m.set_rows(d, s, i.astype(np.float32)), TypeError, "idx must have dtype"),
        ("idx length", lambda m, d, s, i: m.set_rows(d, s, i[:3]), ValueError, "idx must have src's row count"),
        ("idx rank", lambda m, d, s, i: m.set_rows(d, s, i[None]), ValueError, "idx must have at most 1"),
        ("idx not a divisor", lambda m, d, s, i: m.set_rows(d[None].repeat(3, 0), s[None].repeat(3, 0),
                                                            i[None].repeat(2, 0)), ValueError, "must each divide"),
        ("overlap", lambda m, d, s, i: m.set_rows(d, d[4:8], i), ValueError, "dst overlaps src"),
    ]


@pytest.mark.parametrize("module", [fastattn, ref], ids=["fast", "reference"])
@pytest.mark.parametrize("what, bad_call, error, message", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_inputs_raise_naming_the_argument_and_write_nothing(module, what, bad_call, error, message):
    rng = np.random.default_rng(6)
    dst = fill(rng, (16, 8), FLOAT32)
    src = fill(rng, (4, 8), FLOAT32)
    idx = np.array([3, 1, 4, 15])
    before = [a.tobytes() for a in (dst, src, idx)]
    with pytest.raises(error, match=message):
        bad_call(module, dst, src, idx)
    assert [a.tobytes() for a in (dst, src, idx)] == before


@pytest.mark.parametrize("module", [fastattn, ref], ids=["fast", "reference"])
def test_bad_index_in_a_parallel_call_writes_nothing(module):
    dst = np.zeros((4096, 1024), np.float16)
    src = np.ones((512, 1024), np.float32)
    idx = np.arange(512)
    idx[-1] = 4096
    with fastattn.num_threads(2), pytest.raises(ValueError, match=r"got 4096 at idx\[511\]"):
        module.set_rows(dst, src, idx)
    assert not dst.any()


def test_read_only_dst_is_refused():
    dst = np.zeros((4, 8), np.float16)
    dst.flags.writeable = False
    for module in (fastattn, ref):
        with pytest.raises(ValueError, match="dst must be writeable"):
            module.set_rows(dst, np.zeros((1, 8), np.float32), np.zeros(1, np.int64))


#: 8 or more float32 narrowed to float16 by one instruction: F16C's ``vcvtps2ph`` from a ymm/zmm register, or
#: AVX512-FP16's ``vcvtps2phx`` from 256 or 512 bits (AT&T suffix ``y``/``z``, or a ymm/zmm source register).
EIGHT_WIDE_TO_FLOAT16 = r"vcvtps2ph\s+.*[yz]mm|vcvtps2phx(?:[yz]\s|\s+%[yz]mm)"


def test_contiguous_float32_to_float16_rows_vectorise():
    """The 0.1 ms target needs 8-wide conversion (``EIGHT_WIDE_TO_FLOAT16``; checked on an uncached copy,
    compiled for any-layout arrays with adjacent rows as the general path calls it)."""
    from numba import types

    def array_type(dtype, ndim):
        return types.Array(numba.from_dtype(HALF_VIEW.get(dtype, dtype)), ndim, "A")

    set_rows_module = sys.modules[fastattn.set_rows.__module__]
    uncached = numba.njit(**dict(KERNEL_OPTIONS, cache=False))(set_rows_module._set_rows_serial.py_func)
    signature = (array_type(FLOAT16, 3), array_type(FLOAT32, 3), array_type(INDEX_INTS[1], 2), types.boolean)
    uncached.compile(signature)
    asm = uncached.inspect_asm(signature)
    assert re.search(EIGHT_WIDE_TO_FLOAT16, asm), "the float32 -> float16 row copy did not vectorise"


def test_read_only_and_unaligned_caches():
    dst = np.zeros((4, 8), np.float16)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="dst must be writeable"):
        fastattn.set_rows(dst, np.zeros((1, 8), np.float32), np.zeros(1, np.int64))
    unaligned = np.zeros(2 * 4 * 8 + 1, np.uint8)[1:].view(np.float16).reshape(4, 8)
    assert not unaligned.flags.aligned
    fastattn.set_rows(unaligned, np.ones((1, 8), np.float32), np.array([2]))
    assert unaligned[2].tolist() == [1.0] * 8 and not unaligned[[0, 1, 3]].any()



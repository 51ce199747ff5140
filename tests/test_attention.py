"""flash_attn_ext: every path (one_chunk, split_kv, tiled, auto) against the float64 reference.

The contract's rule: max |fast - reference| <= 2 x max |naive float32 - reference| + a small floor, where the naive
float32 evaluation is the formula written straight in float32 NumPy (``attention_cases.naive_f32``). Inputs are strided
views with guard bands; ``out`` is checked to be written in full and nothing around it touched.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from fastattn.testing import assert_within_rule
from attention_cases import FLOOR, naive_f32
from strategies import attention_masks, attention_variants, dims, fill, strided, thread_counts

import fastattn
from fastattn.attention import split_kv as _attention_split_kv
from fastattn._core import threads as _threads
from fastattn import reference
import fastattn.attention.api
from fastattn.attention.api import choose_path

PATHS = ["one_chunk", "split_kv", "tiled", "auto"]


def logit_rounding_bound(q, k, v, scale) -> float:
    """An explicit bound for huge logits: 4 float32 ulps of the largest |logit| times the largest |v|.

    With logits near 1e3-1e4 the error of any float32 evaluation is dominated by the rounding of the logits
    themselves (a softmax weight moves by about the logit's absolute error); which of two float32 evaluations
    rounds luckier is then a coin toss (measured: fast/naive error ratios from 0.1 to 3.5 over seeds), so the
    contract's 2x-naive rule alone is not a meaningful yardstick there and this first-order bound is added.
    """
    logits = scale * np.abs(q.astype(np.float64)).sum(axis=-1).max() * np.abs(k.astype(np.float64)).max()
    return 4.0 * float(np.spacing(np.float32(logits))) * float(np.abs(v.astype(np.float64)).max())


def check(q, k, v, mask=None, *, path, threads=1, out=None, what="", big_logits=False, **params):
    """Run ``path`` and assert the contract's rule (plus ``logit_rounding_bound`` for huge logits)."""
    with fastattn.num_threads(threads):
        fast = fastattn.flash_attn_ext(q, k, v, mask, path=path, out=out, **params)
    if out is not None:
        assert fast is out
    ref = reference.flash_attn_ext(q, k, v, mask, out=np.empty(fast.shape, np.float64), **params)
    naive = naive_f32(q, k, v, mask, **params)
    assert fast.dtype == np.float32 and fast.shape == ref.shape
    assert np.isfinite(fast).all(), f"{what}: non-finite output"
    floor = FLOOR + (logit_rounding_bound(q, k, v, params["scale"]) if big_logits else 0.0)
    assert_within_rule(fast, ref, naive, floor=floor, what=f"{path} {what}")
    return fast


# ---------------------------------------------------------------------------------------------------------------
# Properties over shapes, dtypes, views, masks and parameters.
HEAD_SIZES = st.sampled_from([(16, 16), (40, 40), (64, 64), (72, 72), (80, 80), (24, 40), (48, 32)])


@st.composite
def attention_problems(draw, path):
    B = draw(st.sampled_from((1, 1, 2)))
    Bk = draw(st.sampled_from(sorted({1, B})))
    dtype, mask_dtype, per_head = draw(attention_variants)
    Hkv = draw(st.sampled_from((1, 2, 3)))
    Hq = Hkv * draw(st.sampled_from((2, 3, 4, 5, 8) if per_head and Hkv == 1 else (1, 2, 3, 4, 5, 8)))
    Nq = 1 if path == "split_kv" else draw(st.one_of(st.sampled_from((1, 3, 63, 64, 65)), dims(1, 40)))
    Nkv = draw(st.one_of(st.sampled_from((1, 31, 32, 33, 63, 64, 65, 129)), dims(1, 100)))
    DK, DV = draw(HEAD_SIZES)
    big_logits = draw(st.booleans())
    scale = 1.0 / np.sqrt(DK) if not big_logits else 400.0 / np.sqrt(DK)  # logits up to about +-1e4
    q = draw(strided((B, Hq, Nq, DK), np.float32))
    k = draw(strided((Bk, Hkv, Nkv, DK), dtype))
    v = draw(strided((Bk, Hkv, Nkv, DV), dtype))
    mask = None if mask_dtype is None else draw(attention_masks(B, Hq, Nq, Nkv, mask_dtype, per_head))
    params = dict(scale=scale,
                  max_bias=draw(st.sampled_from((0.0, 0.0, 8.0))) if mask is not None else 0.0,
                  logit_softcap=draw(st.sampled_from((0.0, 0.0, 30.0))))
    if draw(st.booleans()):
        params["sinks"] = (np.random.default_rng(draw(st.integers(0, 99))).standard_normal(Hq) * 3).astype(
            np.float32)
    out = draw(st.none() | strided((B, Nq, Hq, DV), np.float32, contiguous_ok=False))
    return q, k, v, mask, params, out, big_logits


@pytest.mark.parametrize("path", PATHS)
@given(data=st.data(), threads=thread_counts)
def test_path_matches_reference(path, data, threads):
    q, k, v, mask, params, out, big_logits = data.draw(attention_problems(path))
    what = (f"q {q.array.shape} k {k.array.shape} {k.array.dtype} v {v.array.shape} mask "
            f"{None if mask is None else (mask.shape, mask.dtype)} {params}")
    check(q.array, k.array, v.array, mask, path=path, threads=threads,
          out=None if out is None else out.array, what=what, big_logits=big_logits, **params)
    for view in (q, k, v):
        view.assert_all_unchanged()
    if out is not None:
        out.assert_outside_unchanged()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("Nkv", [512, 1025])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_decode_and_short_prefill_around_the_split_threshold(path, Nkv, dtype):
    """Llama-like heads (GQA 4) at the split_kv threshold and past a chunk boundary, causal mask, 1 and 2 threads."""
    rng = np.random.default_rng(Nkv)
    Nq = 1 if path == "split_kv" else 5
    q = fill(rng, (1, 8, Nq, 64), np.float32)
    cache_k = fill(rng, (1, 2, Nkv + 7, 64), dtype)
    cache_v = fill(rng, (1, 2, Nkv + 7, 64), dtype)
    mask = np.where(np.arange(Nkv)[None, :] > np.arange(Nq)[:, None] + Nkv - Nq, -np.inf, 0.0).astype(dtype)
    for threads in (1, 2):
        check(q, cache_k[:, :, :Nkv], cache_v[:, :, :Nkv], mask, path=path, threads=threads, scale=0.125,
              what=f"Nkv {Nkv} threads {threads}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("DK,DV", [(192, 128), (576, 512)])
def test_large_and_unequal_head_sizes(path, DK, DV):
    rng = np.random.default_rng(DK)
    Nq = 1 if path == "split_kv" else 3
    q = fill(rng, (1, 4, Nq, DK), np.float32)
    k = fill(rng, (1, 1, 37, DK), np.float16)
    v = fill(rng, (1, 1, 37, DV), np.float16)
    check(q, k, v, path=path, scale=DK ** -0.5, sinks=np.zeros(4, np.float32))


@pytest.mark.parametrize("path", PATHS)
def test_mixed_kv_dtypes_and_token_major_cache(path):
    """K float16 and V float32; K read from a token-major cache (Nkv, Hkv, D) through a transposed view."""
    rng = np.random.default_rng(5)
    Nq = 1 if path == "split_kv" else 4
    cache = fill(rng, (50, 2, 32), np.float16)
    k = cache[:45].transpose(1, 0, 2)[None]
    v = fill(rng, (1, 2, 45, 32), np.float32)
    q = fill(rng, (1, 6, Nq, 32), np.float32)
    check(q, k, v, path=path, scale=0.2, logit_softcap=5.0)


@pytest.mark.parametrize("path", PATHS)
def test_fully_masked_rows_give_exact_zeros(path):
    rng = np.random.default_rng(1)
    Nq = 1 if path == "split_kv" else 70
    q = fill(rng, (1, 4, Nq, 16), np.float32)
    k = fill(rng, (1, 2, 70, 16), np.float32)
    v = fill(rng, (1, 2, 70, 16), np.float32)
    mask = np.zeros((Nq, 70), np.float32)
    mask[0] = -np.inf
    mask[Nq // 2:, :40] = -np.inf
    out = fastattn.flash_attn_ext(q, k, v, mask, scale=1.0, path=path)
    assert (out[:, 0] == 0.0).all()
    # a sink alone (every key masked) still gives zero output: it has no value
    out = fastattn.flash_attn_ext(q, k, v, mask, scale=1.0, path=path, sinks=np.ones(4, np.float32))
    assert (out[:, 0] == 0.0).all()


def test_split_kv_is_bit_identical_for_one_and_two_threads():
    rng = np.random.default_rng(2)
    for dtype, Nkv in ((np.float32, 1025), (np.float16, 4100)):
        q = fill(rng, (1, 32, 1, 64), np.float32)
        k = fill(rng, (1, 8, Nkv, 64), dtype)
        v = fill(rng, (1, 8, Nkv, 64), dtype)
        mask = np.where(rng.random((1, Nkv)) < 0.1, -np.inf, 0.0).astype(dtype)
        assert 8 * Nkv * 128 * k.itemsize >= _threads.PARALLEL_MIN_BYTES  # the 2-thread call runs in parallel
        sinks = fill(rng, (32,), np.float32)
        results = []
        for threads in (1, 2, 1, 2):
            with fastattn.num_threads(threads):
                results.append(fastattn.flash_attn_ext(q, k, v, mask, scale=0.125, sinks=sinks, path="split_kv"))
        for other in results[1:]:
            assert np.array_equal(results[0].view(np.uint32), other.view(np.uint32))


def test_split_kv_ranges_of_units_cover_every_unit_once():
    """15 units (5 KV heads x 3 chunks) over 2 threads: ranges of 8 and 7 units, each thread helping the other's
    range when its own is done. Every head's output must match the reference, at 1 and 2 threads alike."""
    rng = np.random.default_rng(5)
    Nkv = 1025  # 3 chunks
    q = fill(rng, (1, 10, 1, 128), np.float32)
    k = fill(rng, (1, 5, Nkv, 128), np.float32)
    v = fill(rng, (1, 5, Nkv, 128), np.float32)
    assert 5 * Nkv * 256 * 4 >= _threads.PARALLEL_MIN_BYTES  # the 2-thread call runs in parallel
    one = check(q, k, v, path="split_kv", threads=1, scale=0.1)
    # the partial buffers are reused per shape: poison them, so that a unit the 2-thread run skipped cannot
    # pass on the 1-thread run's values
    for buffer in _attention_split_kv._partials(1, 5, 3, 2, 128):
        buffer.fill(np.nan)
    two = check(q, k, v, path="split_kv", threads=2, scale=0.1)
    assert np.array_equal(one.view(np.uint32), two.view(np.uint32))


@pytest.mark.parametrize("path", ["one_chunk", "split_kv"])
def test_float32_decode_value_updates_agree_bit_for_bit(path):
    """The float32 decode loop adds V rows by 16-column slices when V's rows are unit-stride and DV is a multiple
    of 16, row by row otherwise, with the same FMAs in the same order: the bits must agree. Masked rows (skipped
    by both) and G = 5 (a head block of four and one single head) included."""
    rng = np.random.default_rng(7)
    q = fill(rng, (1, 10, 1, 64), np.float32)
    k = fill(rng, (1, 2, 300, 64), np.float32)
    v = fill(rng, (1, 2, 300, 64), np.float32)
    v_strided = np.zeros((1, 2, 300, 128), np.float32)[..., ::2]  # column stride 2: the row-by-row loop
    v_strided[...] = v
    mask = np.where(rng.random((1, 300)) < 0.3, -np.inf, 0.0).astype(np.float32)
    by_slices = fastattn.flash_attn_ext(q, k, v, mask, scale=0.125, path=path)
    by_rows = fastattn.flash_attn_ext(q, k, v_strided, mask, scale=0.125, path=path)
    assert np.array_equal(by_slices.view(np.uint32), by_rows.view(np.uint32))
    assert_within_rule(by_slices, reference.flash_attn_ext(q, k, v, mask, scale=0.125),
                       naive_f32(q, k, v, mask, scale=0.125), floor=FLOOR)


def test_split_kv_refuses_prefill_and_leaves_out_untouched():
    q = np.ones((1, 2, 3, 8), np.float32)
    k = np.ones((1, 1, 5, 8), np.float32)
    out = np.full((1, 3, 2, 8), 7.0, np.float32)
    with pytest.raises(ValueError, match="split_kv.*Nq = 1"):
        fastattn.flash_attn_ext(q, k, k, scale=1.0, path="split_kv", out=out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("path", ["one_chunk", "split_kv", "auto"])
def test_concurrent_calls_from_python_threads(path):
    """Several Python threads at once (kernels release the GIL; scratch and partials are per call/thread)."""
    rng = np.random.default_rng(3)
    problems = []
    for i in range(4):
        Nq = 1 if path == "split_kv" else 1 + i
        Hkv = 8 if i == 3 else 2  # the last one is large enough for the prange driver at 2 threads
        q = fill(rng, (1, 4 * Hkv, Nq, 64), np.float32)
        k = fill(rng, (1, Hkv, 600 + 100 * i, 64), np.float16)
        v = fill(rng, (1, Hkv, 600 + 100 * i, 64), np.float16)
        problems.append((q, k, v))
    assert 8 * 900 * 128 * 2 >= _threads.PARALLEL_MIN_BYTES
    expected = [fastattn.flash_attn_ext(q, k, v, scale=0.125, path=path) for q, k, v in problems]
    got = [[] for _ in problems]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                got[i].append(fastattn.flash_attn_ext(*problems[i], scale=0.125, path=path))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    for want, results in zip(expected, got):
        for result in results:
            assert np.array_equal(want, result)


# ---------------------------------------------------------------------------------------------------------------
# auto
def test_auto_follows_ggml_rule_with_units_per_thread():
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    # ggml's decode rule, when the KV heads are too few to give every thread 4 units and do not share evenly
    assert choose_path(1, 1, 1, 512, f16, f16, 2) == "split_kv"
    assert choose_path(1, 1, 3, 4096, f32, f32, 2) == "split_kv"
    assert choose_path(1, 1, 6, 4096, f16, f16, 4) == "split_kv"
    assert choose_path(1, 1, 1, 511, f16, f16, 2) == "one_chunk"
    assert choose_path(2, 1, 1, 4096, f16, f16, 4) == "one_chunk"
    assert choose_path(1, 1, 1, 4096, f16, f32, 4) == "one_chunk"
    assert choose_path(1, 5, 1, 4096, f16, f16, 4) == "one_chunk"
    assert choose_path(1, 512, 8, 512, f16, f16, 2) == "tiled"
    # enough KV heads, or as many per thread: one_chunk (measured faster at 2, 4 and 8 KV heads on 2 threads)
    assert choose_path(1, 1, 8, 4096, f16, f16, 2) == "one_chunk"
    assert choose_path(1, 1, 2, 4096, f32, f32, 2) == "one_chunk"
    assert choose_path(1, 1, 8, 4096, f16, f16, 4) == "one_chunk"
    assert choose_path(1, 1, 9, 4096, f16, f16, 2) == "one_chunk"
    # one thread: split_kv's partials and fold buy nothing
    assert choose_path(1, 1, 1, 4096, f32, f32, 1) == "one_chunk"
    assert choose_path(1, 1, 3, 4096, f32, f32, 1) == "one_chunk"


def test_auto_decode_takes_the_chosen_path():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, 1, 16)).astype(np.float32)
    kv = {n: rng.standard_normal((2, 1, n, 600, 16)).astype(np.float16) for n in (1, 2, 4)}
    for n_kv_heads, threads, path in ((1, 2, "split_kv"), (1, 1, "one_chunk"), (2, 2, "one_chunk"),
                                      (2, 1, "one_chunk"), (4, 1, "one_chunk")):
        k, v = kv[n_kv_heads]
        with fastattn.num_threads(threads):
            auto = fastattn.flash_attn_ext(q, k, v, scale=0.25)
            assert np.array_equal(auto, fastattn.flash_attn_ext(q, k, v, scale=0.25, path=path))


# ---------------------------------------------------------------------------------------------------------------
# Bad input: clear errors, nothing written.
def _good():
    return (np.ones((1, 4, 2, 8), np.float32), np.ones((1, 2, 5, 8), np.float16), np.ones((1, 2, 5, 8), np.float16))


@pytest.mark.parametrize("change,error,match", [
    (lambda q, k, v, m: (q.astype(np.float16), k, v, m), TypeError, "q must have dtype"),
    (lambda q, k, v, m: (q, k.astype(np.int32), v, m), TypeError, "k must have dtype"),
    (lambda q, k, v, m: (q[0], k, v, m), ValueError, "q must have 4 axes"),
    (lambda q, k, v, m: (q, k[..., :4], v, m), ValueError, "head size DK"),
    (lambda q, k, v, m: (q[:, :3], k, v, m), ValueError, "must divide q heads"),
    (lambda q, k, v, m: (q, k, v, m[:1]), ValueError, "at least Nq"),
    (lambda q, k, v, m: (q, k, v, m[:, :4]), ValueError, "exactly Nkv"),
    (lambda q, k, v, m: (q, k, v, m.astype(np.float64)), TypeError, "mask must have dtype"),
])
def test_bad_inputs_raise_and_leave_out_untouched(change, error, match):
    q, k, v = _good()
    q, k, v, mask = change(q, k, v, np.zeros((2, 5), np.float32))
    out = np.full((q.shape[0], q.shape[2] if q.ndim == 4 else 1, 4, 8), 7.0, np.float32)
    with pytest.raises(error, match=match):
        fastattn.flash_attn_ext(q, k, v, mask, scale=1.0, out=out)
    assert (out == 7.0).all()


def test_bad_out_and_path():
    q, k, v = _good()
    with pytest.raises(ValueError, match="out must have shape"):
        fastattn.flash_attn_ext(q, k, v, scale=1.0, out=np.zeros((1, 2, 4, 9), np.float32))
    with pytest.raises(TypeError, match="out must have dtype"):
        fastattn.flash_attn_ext(q, k, v, scale=1.0, out=np.zeros((1, 2, 4, 8), np.float64))
    with pytest.raises(ValueError, match="path must be one of"):
        fastattn.flash_attn_ext(q, k, v, scale=1.0, path="fast")


@pytest.mark.parametrize("ops", [fastattn, reference], ids=["fast", "reference"])
def test_token_major_heads_are_refused_with_the_transpose(ops):
    """FlashAttention's (B, N, H, D) arrays of 512 tokens read as 512 heads, and every count divides: refused
    (no model has more than 256 heads), naming the transpose, before anything is written."""
    q = np.ones((1, 512, 32, 128), np.float32)  # 512 tokens of 32 query heads
    k = np.ones((1, 512, 8, 128), np.float32)  # 512 keys of 8 KV heads
    out = np.full((1, 32, 512, 128), 7.0, np.float32)  # the (B, Nq, Hq, DV) of the misread call
    with pytest.raises(ValueError, match=r"at most 256 heads.*\(B, H, N, D\).*x\.transpose\(0, 2, 1, 3\)"):
        ops.flash_attn_ext(q, k, k, scale=0.125, out=out)
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="transpose"):  # without out
        ops.flash_attn_ext(q, k, k, scale=0.125)


@pytest.mark.parametrize("ops", [fastattn, reference], ids=["fast", "reference"])
def test_token_major_single_head_decode_shape_is_refused(ops):
    """One head of 300 tokens, token-major, reads as 300 heads of one query row: the shape of a decode call. It
    is refused, writing nothing."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 300, 1, 64), np.float32)  # (B, N, H, D): 300 tokens, 1 head
    k = rng.standard_normal((1, 300, 1, 64), np.float32)
    out = np.full((1, 1, 300, 64), 7.0, np.float32)  # (B, Nq, Hq, DV) of the misread call
    with pytest.raises(ValueError, match="at most 256 heads"):
        ops.flash_attn_ext(q, k, k, scale=0.125, out=out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("ops", [fastattn, reference], ids=["fast", "reference"])
def test_out_with_heads_and_rows_swapped_names_both_fixes(ops):
    """Token-major q, k, v with out in their (B, N, H, D) layout: out reads as (B, Hq, Nq, DV) swapped. The
    message gives both fixes (q, k, v transposed, or out transposed), and out is not written."""
    q = np.ones((1, 6, 4, 16), np.float32)  # 6 tokens of 4 heads, read as 6 heads of 4 rows
    k = np.ones((1, 6, 2, 16), np.float32)
    out = np.full((1, 6, 4, 16), 7.0, np.float32)
    with pytest.raises(ValueError, match=r"swaps Hq = 6 and Nq = 4.*x\.transpose\(0, 2, 1, 3\).*out\.transpose"):
        ops.flash_attn_ext(q, k, k, scale=0.25, out=out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("ops", [fastattn, reference], ids=["fast", "reference"])
def test_legitimate_layouts_next_to_the_token_major_checks_pass(ops):
    """Nq == Hq with out given, decode (Nq == 1) with out, and 256 heads: all valid (B, H, N, D) calls."""
    rng = np.random.default_rng(8)
    for q_shape, k_shape in [((1, 4, 4, 16), (1, 2, 5, 16)), ((2, 8, 1, 16), (2, 2, 7, 16)),
                             ((1, 256, 2, 16), (1, 256, 3, 16))]:
        q, k = rng.standard_normal(q_shape, np.float32), rng.standard_normal(k_shape, np.float32)
        out = np.full((q_shape[0], q_shape[2], q_shape[1], 16), 7.0, np.float32)
        ops.flash_attn_ext(q, k, k, scale=0.25, out=out)
        assert np.array_equal(out, ops.flash_attn_ext(q, k, k, scale=0.25))
        assert_within_rule(out, reference.flash_attn_ext(q, k, k, scale=0.25, out=np.empty(out.shape)),
                           naive_f32(q, k, k, None, scale=0.25), floor=FLOOR)


@pytest.mark.parametrize("ops", [fastattn, reference], ids=["fast", "reference"])
@pytest.mark.parametrize("Nq", [1, 5])  # decode and prefill
def test_scale_defaults_to_head_size_to_the_minus_half(ops, Nq):
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 4, Nq, 48), np.float32)
    k = rng.standard_normal((1, 2, 11, 48), np.float32)
    v = rng.standard_normal((1, 2, 11, 32), np.float32)
    explicit = ops.flash_attn_ext(q, k, v, scale=48 ** -0.5)
    got = ops.flash_attn_ext(q, k, v)
    assert got.tobytes() == explicit.tobytes()
    assert not np.array_equal(got, ops.flash_attn_ext(q, k, v, scale=1.0))
    out = np.empty_like(got)
    ops.flash_attn_ext(q, k, v, out=out)
    assert out.tobytes() == explicit.tobytes()


# ---------------------------------------------------------------------------------------------------------------
# torch, when installed
def test_against_torch_sdpa():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q = fill(rng, (1, 8, 5, 32), np.float32)
    k = fill(rng, (1, 2, 40, 32), np.float16)
    v = fill(rng, (1, 2, 40, 32), np.float16)
    mask = np.where(np.arange(40)[None, :] > np.arange(5)[:, None] + 35, -np.inf, 0.0).astype(np.float16)
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q.astype(np.float64)), torch.from_numpy(k.astype(np.float64)),
        torch.from_numpy(v.astype(np.float64)), attn_mask=torch.from_numpy(mask.astype(np.float64)), scale=0.3,
        enable_gqa=True).numpy().transpose(0, 2, 1, 3)
    for path in ("one_chunk", "tiled", "auto"):
        got = fastattn.flash_attn_ext(q, k, v, mask, scale=0.3, path=path)
        assert np.abs(got - want).max() < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# flash_attn_ext_slopes: the caller's ALiBi slopes (FlashAttention's alibi_slopes)
@pytest.mark.parametrize("path", PATHS)
def test_caller_slopes_equal_ggmls_max_bias_slopes(path):
    """The slopes ggml derives from max_bias, passed explicitly, give flash_attn_ext's bytes."""
    from fastattn.attention.api import flash_attn_ext_slopes
    from fastattn.attention.args import alibi_slopes

    rng = np.random.default_rng(11)
    Nq = 1 if path == "split_kv" else 6
    q = fill(rng, (1, 6, Nq, 32), np.float32)
    k = fill(rng, (1, 2, 700, 32), np.float16)
    v = fill(rng, (1, 2, 700, 32), np.float16)
    mask = -np.abs(np.arange(700)[None, :] - 699 + Nq - 1 - np.arange(Nq)[:, None]).astype(np.float32)
    mask[:, :40] = -np.inf
    expected = fastattn.flash_attn_ext(q, k, v, mask, scale=0.2, max_bias=8.0, path=path)
    slopes = alibi_slopes(6, 8.0).astype(np.float32)
    slopes.flags.writeable = False  # a read-only argument is taken as well
    got = flash_attn_ext_slopes(q, k, v, mask, slopes, scale=0.2, path=path)
    assert got.tobytes() == expected.tobytes()


def test_zero_slopes_still_hide_minus_inf_keys_and_bad_slopes_are_refused():
    from fastattn.attention.api import flash_attn_ext_slopes

    rng = np.random.default_rng(12)
    q = fill(rng, (1, 2, 3, 16), np.float32)
    k = fill(rng, (1, 1, 5, 16), np.float32)
    v = fill(rng, (1, 1, 5, 16), np.float32)
    k[0, 0, 4] = v[0, 0, 4] = np.nan  # hidden from every row: never read
    mask = np.where(np.arange(5)[None, :] > 3, -np.inf, -1.0).astype(np.float32).repeat(3, axis=0)
    got = flash_attn_ext_slopes(q, k, v, mask, np.zeros(2, np.float32))
    expected = reference.flash_attn_ext(q, k[:, :, :4], v[:, :, :4])
    assert np.isfinite(got).all() and np.abs(got - expected).max() < 1e-6
    for slopes, match in ((np.zeros(3, np.float32), r"\(2,\) float32"), (np.zeros(2), r"\(2,\) float32"),
                          (np.array([0.0, np.inf], np.float32), "finite")):
        with pytest.raises(ValueError, match=match):
            flash_attn_ext_slopes(q, k, v, mask, slopes)

"""The tiled attention path (``run_tiled``) against the float64 reference, under the contract's error rule.

Shapes straddle the tile sizes (Nq around Q_TILE, Nkv around KV_TILE and 1), head sizes include 40, 72, 80,
192/128 and 576/512, GQA ratios 1..8 and MQA, K/V batch broadcast, float32/float16/bfloat16 K/V, strided views
with guard bands, every mask kind (none, causal, random -inf blocks, fully masked rows and tiles) broadcast over
heads and batch, ALiBi, softcap, sinks, logits up to 1e4, 1 and 2 threads, concurrent Python callers.
"""
from __future__ import annotations

import re
import threading

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from attention_cases import FLOOR, MASK_KINDS, make_mask, naive_f32
from fastattn.attention import tiled
from fastattn.attention.args import alibi_slopes
from fastattn._core.kernel import EXP_MIN as EXP_MIN
from fastattn._core.kernel import KERNEL_OPTIONS, kernel_view
from fastattn._core.validate import FLOAT32
from fastattn.quant.api import bytes_view
from fastattn.reference import flash_attn_ext
from fastattn.testing import assert_within_rule
from strategies import BFLOAT16, attention_variants, seeds, strided, thread_counts

QT, KT = tiled.Q_TILE, tiled.KV_TILE


def q_rows():
    return st.sampled_from((1, 3, QT - 1, QT, QT + 1, 2 * QT + 5)) | st.integers(1, 2 * QT + 7)


def kv_rows():
    return st.sampled_from((1, 2, KT - 1, KT, KT + 1, 2 * KT + 3)) | st.integers(1, 3 * KT)


def call_tiled(q, k, v, mask, *, scale, max_bias=0.0, logit_softcap=0.0, sinks=None, out=None):
    """run_tiled with the public API's conversions (kernel views, 4-D mask, float32 slopes)."""
    B, Hq, Nq, _ = q.shape
    if out is None:
        out = np.full((B, Nq, Hq, v.shape[3]), np.nan, np.float32)
    if mask is not None:
        mask = kernel_view(mask.reshape((1,) * (4 - mask.ndim) + mask.shape))
    slopes = alibi_slopes(Hq, max_bias).astype(np.float32)
    tiled.run_tiled(q, kernel_view(k), kernel_view(v), mask, slopes, sinks, scale, logit_softcap, out)
    return out


def check(q, k, v, mask, out=None, **params):
    fast = call_tiled(q, k, v, mask, out=out, **params)
    ref = flash_attn_ext(q, k, v, mask, out=np.empty(fast.shape), **params)
    naive = naive_f32(q, k, v, mask, **params)
    assert np.isfinite(fast).all()
    assert_within_rule(fast, ref, naive, floor=FLOOR, what="tiled")
    assert (fast[np.all(ref == 0, axis=-1)] == 0).all(), "a fully masked row must give exact zeros"
    return fast


@st.composite
def attention_case(draw, head_sizes=((64, 64), (40, 40), (72, 72), (80, 80), (128, 128), (16, 24)),
                   n_q=None, n_kv=None):
    ratio = draw(st.integers(1, 8))
    Hkv = draw(st.sampled_from((1, 2)))
    Hq = ratio * Hkv
    B = draw(st.sampled_from((1, 2)))
    Bk = draw(st.sampled_from((1, B)))
    DK, DV = draw(st.sampled_from(head_sizes))
    Nq = draw(n_q if n_q is not None else q_rows())
    Nkv = draw(n_kv if n_kv is not None else kv_rows())
    kv_dtype, mask_dtype, _ = draw(attention_variants)  # the tiled kernels do not specialise on per-head masks
    big_logits = draw(st.booleans())
    q_values = k_values = None
    if big_logits:
        # Logits near 1e4 turn every rounding of q·k into a visible change of the softmax weights, and the
        # rule's float32 evaluation rounds differently: multiples of 1/8 make every q·k exact in both, so the
        # check is about the softmax (no overflow, no NaN) and not about two equally valid roundings of q·k.
        rng = np.random.default_rng(draw(seeds))
        q_values = np.round(rng.standard_normal((B, Hq, Nq, DK)) * 8) / 8
        k_values = np.round(rng.standard_normal((Bk, Hkv, Nkv, DK)) * 8) / 8
    q = draw(strided((B, Hq, Nq, DK), FLOAT32, values=q_values))
    k = draw(strided((Bk, Hkv, Nkv, DK), kv_dtype, values=k_values))
    v = draw(strided((Bk, Hkv, Nkv, DV), kv_dtype))
    kind = draw(st.sampled_from([k for k in MASK_KINDS if k != "none"])) if mask_dtype is not None else "none"
    mask = None
    if kind != "none":
        Bm = draw(st.sampled_from((1, B)))
        Hm = draw(st.sampled_from(sorted({1, Hkv, Hq})))
        Nm = Nq + draw(st.sampled_from((0, 0, 3)))  # ggml pads the mask's rows
        rng = np.random.default_rng(draw(seeds))
        values = make_mask(rng, kind, (Bm, Hm, Nm, Nkv), tile=(QT, KT))
        mask = draw(strided((Bm, Hm, Nm, Nkv), mask_dtype, values=values))
    params = dict(scale=(1e4 if big_logits else 1.0) / np.sqrt(DK),
                  max_bias=draw(st.sampled_from((0.0, 0.0, 8.0))),
                  logit_softcap=draw(st.sampled_from((0.0, 0.0, 30.0))))
    if draw(st.booleans()):
        sinks = np.random.default_rng(draw(seeds)).standard_normal(Hq).astype(np.float32)
        sinks[0] = draw(st.sampled_from((sinks[0], -np.inf, 20.0)))
        params["sinks"] = sinks
    out = draw(strided((B, Nq, Hq, DV), FLOAT32))
    return q, k, v, mask, out, params


def run_case(case, threads):
    q, k, v, mask, out, params = case
    mask_array = None if mask is None else mask.array
    with fastattn.num_threads(threads):
        fast = call_tiled(q.array, k.array, v.array, mask_array, out=out.array, **params)
    ref = flash_attn_ext(q.array, k.array, v.array, mask_array, out=np.empty(fast.shape), **params)
    naive = naive_f32(q.array, k.array, v.array, mask_array, **params)
    assert np.isfinite(fast).all(), "NaN or inf in the output"
    assert_within_rule(fast, ref, naive, floor=FLOOR, what="tiled")
    assert (fast[np.all(ref == 0, axis=-1)] == 0).all(), "a fully masked row must give exact zeros"
    out.assert_outside_unchanged()
    for view in (q, k, v) + (() if mask is None else (mask,)):
        view.assert_all_unchanged()


@settings(max_examples=max(60, settings().max_examples))  # cheap examples: more than the profile's
@given(attention_case(), thread_counts)
def test_tiled_matches_reference(case, threads):
    run_case(case, threads)


@settings(max_examples=max(8, settings().max_examples // 3))  # big head sizes: fewer
@given(attention_case(head_sizes=((192, 128), (576, 512)), n_q=st.integers(1, QT + 2),
                      n_kv=st.sampled_from((1, 5, KT + 1))), thread_counts)
def test_large_head_sizes(case, threads):
    run_case(case, threads)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_causal_prefill_gqa(kv_dtype):
    rng = np.random.default_rng(1)
    B, Hq, Hkv, N, D = 1, 8, 2, 3 * QT + 1, 64
    q = rng.standard_normal((B, Hq, N, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, N, D)).astype(kv_dtype)
    v = rng.standard_normal((B, Hkv, N, D)).astype(kv_dtype)
    mask = make_mask(rng, "causal", (N, N)).astype(kv_dtype)  # the suite's kernel variants (strategies)
    for threads in (1, 2):
        with fastattn.num_threads(threads):
            check(q, k, v, mask, scale=D ** -0.5)


def test_mixed_kv_dtypes():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, QT + 3, 40)).astype(np.float32)
    k = rng.standard_normal((1, 2, KT + 9, 40)).astype(np.float16)
    v = rng.standard_normal((1, 2, KT + 9, 24)).astype(np.float32)
    check(q, k, v, make_mask(rng, "blocks", (QT + 3, KT + 9)).astype(np.float32), scale=0.2)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k_size", [2.0, 3.0])
def test_one_dominant_key_over_many_tiles_within_the_rule(k_size, seed):
    """An output that is one key's V row (values of size ~100) plus a little of each of the others, over 32 KV
    tiles: the softmax denominator must not drift tile after tile (summed key by key, it did by ~5 ulp of the
    output per tile, past the rule for (2.0, 1) and (3.0, 1))."""
    rng = np.random.default_rng(seed)
    D, n_kv = 32, 2048
    q = rng.standard_normal((1, 1, 1, D)).astype(np.float32)
    k = (rng.standard_normal((1, 1, n_kv, D)) * k_size).astype(np.float32)
    scale = D ** -0.5
    k[0, 0, 4] = q[0, 0, 0] * (15.0 / (scale * float(q[0, 0, 0] @ q[0, 0, 0])))  # logit 15, the others ~N(0, 4)
    v = (rng.standard_normal((1, 1, n_kv, D)) * 30.0).astype(np.float32)
    got = call_tiled(q, k, v, None, scale=scale)
    expected = flash_attn_ext(q, k, v, None, scale=scale, out=np.empty(got.shape))
    naive = naive_f32(q, k, v, None, scale=scale)
    assert_within_rule(got, expected, naive, floor=FLOOR * float(np.abs(v).max()), what="tiled")


def test_huge_logits_do_not_overflow():
    rng = np.random.default_rng(3)
    q = (np.round(rng.standard_normal((1, 2, 2 * QT, 32)) * 8) / 8).astype(np.float32)  # exact q·k: see
    k = (np.round(rng.standard_normal((1, 1, 3 * KT, 32)) * 8) / 8).astype(np.float32)  # attention_case
    v = rng.standard_normal((1, 1, 3 * KT, 32)).astype(np.float32)
    for scale in (1e4 / np.sqrt(32), -1e4 / np.sqrt(32)):
        check(q, k, v, None, scale=scale)
        check(q, k, v, make_mask(rng, "tiles", (2 * QT, 3 * KT), tile=(QT, KT)).astype(np.float32), scale=scale)


def test_fully_masked_tiles_are_never_read():
    """A KV tile whose mask block is all -inf is skipped: NaN in its K/V rows cannot reach the output."""
    rng = np.random.default_rng(4)
    Nq, Nkv, D = 2 * QT, 3 * KT, 32
    q = rng.standard_normal((1, 4, Nq, D)).astype(np.float32)
    k = rng.standard_normal((1, 2, Nkv, D)).astype(np.float32)
    v = rng.standard_normal((1, 2, Nkv, D)).astype(np.float32)
    mask = rng.uniform(-1, 1, (Nq, Nkv)).astype(np.float32)
    mask[:, KT:2 * KT] = -np.inf  # the middle KV tile, for every Q tile
    mask[QT:, :] = -np.inf  # the second Q tile: every KV tile (fully masked rows)
    poisoned_k, poisoned_v = k.copy(), v.copy()
    poisoned_k[:, :, KT:2 * KT] = np.nan
    poisoned_v[:, :, KT:2 * KT] = np.inf
    expected = call_tiled(q, k, v, mask, scale=0.3)
    for threads in (1, 2):
        with fastattn.num_threads(threads):
            got = call_tiled(q, poisoned_k, poisoned_v, mask, scale=0.3)
        assert np.array_equal(got, expected)
    assert (got[:, QT:] == 0).all()
    check(q, k, v, mask, scale=0.3)


def test_result_does_not_depend_on_thread_count():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 8, 2 * QT + 3, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 2 * KT + 7, 64)).astype(np.float16)
    v = rng.standard_normal((1, 2, 2 * KT + 7, 64)).astype(np.float16)
    mask = make_mask(rng, "causal", (2 * QT + 3, 2 * KT + 7)).astype(np.float16)
    with fastattn.num_threads(1):
        one = call_tiled(q, k, v, mask, scale=0.125, max_bias=8.0)
    with fastattn.num_threads(2):
        two = call_tiled(q, k, v, mask, scale=0.125, max_bias=8.0)
    assert np.array_equal(one, two)


def test_concurrent_python_callers():
    rng = np.random.default_rng(6)
    jobs = []
    for i in range(6):
        q = rng.standard_normal((1, 8, QT + 5 * i, 64)).astype(np.float32)
        k = rng.standard_normal((1, 2, KT + 11 * i, 64)).astype(np.float16)
        v = rng.standard_normal((1, 2, KT + 11 * i, 64)).astype(np.float16)
        mask = make_mask(rng, "causal", (QT + 5 * i, KT + 11 * i)).astype(np.float32)
        jobs.append((q, k, v, mask, call_tiled(q, k, v, mask, scale=0.125)))
    results = [None] * len(jobs)
    errors = []

    def work(i):
        try:
            q, k, v, mask, _ = jobs[i]
            with fastattn.num_threads(1 + i % 2):
                for _ in range(3):
                    results[i] = call_tiled(q, k, v, mask, scale=0.125)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (_, _, _, _, expected), got in zip(jobs, results):
        assert np.array_equal(got, expected)


@pytest.mark.parametrize("D", [40, 128, 576])
def test_scores_at_huge_logits_within_the_rule(D):
    """The score product (``block_scores``: a K tile times the Q tile transposed) at logits up to about +-1e4:
    its max error against float64 is at most twice that of a float32 matmul (the rule, applied to the scores:
    end to end, at such logits which of two float32 roundings of a near tie wins is a coin toss). One FMA chain
    over all of D failed this at D 576 (up to 2.6x); the product sums D in runs of SCORE_CHUNK."""
    def scores(ks, qt, st_):
        for i in range(0, ks.shape[0], tiled.BLOCK_ROWS):
            for j in range(0, qt.shape[1], tiled.BLOCK_COLS):
                tiled.block_scores(ks, qt, st_, i, j, ks.shape[1])

    product = numba.njit(**dict(KERNEL_OPTIONS, cache=False))(scores)
    n_kv = -(-KT // tiled.BLOCK_ROWS) * tiled.BLOCK_ROWS
    for seed in range(6):
        rng = np.random.default_rng(seed)
        q = rng.standard_normal((QT, D)).astype(np.float32)
        k = rng.standard_normal((n_kv, D)).astype(np.float32)
        scale = np.float32(2500 / np.sqrt(D))  # logits of standard deviation 2500
        exact = (k.astype(np.float64) @ q.astype(np.float64).T) * float(scale)
        got = np.zeros((n_kv, QT), np.float32)
        product(k, np.ascontiguousarray(q.T), got)
        naive = (q @ k.T).T * scale
        err, naive_err = np.abs(got * scale - exact).max(), np.abs(naive - exact).max()
        assert err <= 2 * naive_err, f"seed {seed}: error {err:.3g} > 2 x float32 matmul's {naive_err:.3g}"


def _products(ks, qt, st_, vs, o, alpha):
    tiled.block_scores(ks, qt, st_, 0, 0, ks.shape[1])
    tiled.block_values(st_, vs, o, alpha, 0, 0, st_.shape[0])


def _products_with_lanes(monkeypatch, lanes):
    """``_products`` compiled afresh (uncached: its assembly can be inspected) with rows of ``lanes`` floats."""
    from fastattn.attention import tiled_products as _attention_tiled_products
    monkeypatch.setattr(_attention_tiled_products, "wide_lanes", lambda: lanes)
    return numba.njit(**dict(KERNEL_OPTIONS, cache=False))(_products)


@pytest.mark.parametrize("lanes", [8, 16])
def test_block_products_compile_to_vector_fmas(monkeypatch, lanes):
    uncached = _products_with_lanes(monkeypatch, lanes)
    z, rows = np.zeros, tiled.BLOCK_ROWS
    uncached(z((rows, 8), np.float32), z((8, 16), np.float32), z((rows, 16), np.float32),
             z((rows, 16), np.float32), z((rows, 16), np.float32), z(rows, np.float32))
    asm = uncached.inspect_asm(uncached.signatures[0])
    ymm, zmm = (len(re.findall(rf"vfmadd\w*ps\s+.*{reg}", asm)) for reg in ("ymm", "zmm"))
    assert ymm >= 24 or (lanes == 16 and zmm >= 12), f"the {rows} x 16 blocks did not compile to vector FMAs"


def test_block_products_give_the_same_bits_in_8_and_16_float_vectors(monkeypatch):
    rng = np.random.default_rng(0)
    rows = tiled.BLOCK_ROWS  # one register block: (rows, 16) scores, then rows x 16 of the output
    ks, qt = rng.standard_normal((rows, 200)).astype(np.float32), rng.standard_normal((200, 16)).astype(np.float32)
    vs, alpha = rng.standard_normal((rows, 16)).astype(np.float32), rng.random(rows).astype(np.float32)
    start = rng.standard_normal((rows, 16)).astype(np.float32)
    results = []
    for lanes in (8, 16):
        st_, o = np.zeros((rows, 16), np.float32), start.copy()
        _products_with_lanes(monkeypatch, lanes)(ks, qt, st_, vs, o, alpha)
        results.append((st_, o))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


def _widen_tile(plane, j0, n, dst):
    return tiled.widen_rows(plane, j0, n, dst)


_widen_tile_kernel = numba.njit(**dict(KERNEL_OPTIONS, cache=False))(_widen_tile)


@pytest.mark.parametrize("dtype, width", [(dtype, width) for dtype in ("float32", "float16", "bfloat16")
                                          for width in (32, 40, 96, 200)]
                         + [(qtype, width) for qtype in ("q8_0", "q4_0") for width in (32, 96)])
def test_widen_rows_gives_the_float32_values_and_flags_non_finite_ones(dtype, width):
    """A tile's rows widened into the scratch are exactly the values the reference reads (float rows:
    ``astype(float32)``; quantized rows: ``dequantize``), for rows with a vector tail and strided rows, the scratch's
    other entries untouched; the result says whether a widened value is an inf or NaN."""
    rng = np.random.default_rng(width)
    values = rng.standard_normal((12, width)).astype(np.float32)
    for special in (None, np.inf, -np.inf, np.nan):
        x = values.copy()
        if special is not None:
            x[7, width - 3] = special  # in the rows widened below, in a vector's tail lanes or the scalar tail
        if dtype in ("q8_0", "q4_0"):
            data = fastattn.quantize(x, dtype)
            with np.errstate(invalid="ignore"):  # an inf scale times a zero q
                expected = fastattn.reference.dequantize(data)
            plane = bytes_view(data)
        else:
            if dtype == "bfloat16" and BFLOAT16 is None:
                pytest.skip("bfloat16 needs ml_dtypes")
            stored = x.astype(BFLOAT16 if dtype == "bfloat16" else dtype)
            plane, expected = kernel_view(stored), stored.astype(np.float32)
        planes = [plane]
        if dtype not in ("q8_0", "q4_0"):  # float rows may be strided (quantized rows are contiguous by rule)
            planes.append(kernel_view(np.repeat(plane, 2, axis=1))[:, ::2])
        for p in planes:
            dst = np.full((9, width + 16), 7.0, np.float32)
            bad = _widen_tile_kernel(p, 2, 8, dst)
            np.testing.assert_array_equal(dst[:8, :width], expected[2:10])
            assert np.all(dst[:8, width:] == 7.0) and np.all(dst[8] == 7.0)
            assert bad == (special is not None and not np.all(np.isfinite(expected[2:10])))


def _exp_pass_call(st_, lo, hi, c0, t_max, t_sum):
    tiled.exp_pass(st_, lo, hi, c0, t_max, t_sum)


_exp_pass_kernel = numba.njit(**dict(KERNEL_OPTIONS, cache=False))(_exp_pass_call)


@pytest.mark.parametrize("width", [tiled.Q_TILE, 20])
def test_exp_pass_gives_the_softmax_weights_and_their_sums(width):
    """The tile's weights exp(s - max) in vectors: within float32 rounding of exp in float64, exactly 0 for a
    -inf score (a hidden key) or one far below the max, NaN for a NaN score, and each column's sum added to t_sum
    in row order; the cells outside the rows and columns asked for stay as they were."""
    rng = np.random.default_rng(width)
    st_ = (rng.standard_normal((12, 80)) * 30).astype(np.float32)
    st_[3, 5:9] = -np.inf
    st_[4, 6] = np.nan
    st_[5, 7] = -200.0
    c0, lo, hi = 5, 2, 9
    t_max = np.nanmax(np.where(np.isinf(st_[lo:hi, c0:c0 + width]), np.nan, st_[lo:hi, c0:c0 + width]), axis=0)
    t_max = t_max.astype(np.float32)
    t_sum = rng.random(width).astype(np.float32)
    before, sums_before = st_.copy(), t_sum.copy()
    _exp_pass_kernel(st_, lo, hi, c0, t_max, t_sum)
    with np.errstate(invalid="ignore"):
        shifted = before[lo:hi, c0:c0 + width] - t_max  # in float32, as the pass subtracts
        expected = np.exp(shifted.astype(np.float64))
    got = st_[lo:hi, c0:c0 + width]
    assert np.array_equal(np.isnan(got), np.isnan(shifted))
    underflow = shifted < EXP_MIN  # -inf and far below the max: exactly 0, as fast_exp
    assert np.all(got[underflow] == 0.0) and got[5 - lo, 7 - c0] == 0.0
    live = np.isfinite(shifted) & ~underflow
    np.testing.assert_allclose(got[live], expected[live], rtol=3e-7, atol=0)
    outside = np.ones(st_.shape, bool)
    outside[lo:hi, c0:c0 + width] = False
    assert np.array_equal(st_[outside], before[outside])
    running = sums_before.copy()
    for row in got:  # the sums in row order, as the pass adds them
        running += row
    assert np.array_equal(t_sum, running, equal_nan=True)

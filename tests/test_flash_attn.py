"""FlashAttention's API (``fastattn.integrations.flash_attn``) against its float64 definition
(``fastattn.reference.flash_attn``).

float32 outputs meet the contract's rule (2x a straightforward float32 evaluation's error, ``naive_attend``, plus a
floor); float16 and bfloat16 outputs are within 1 ulp of the correctly rounded reference (or within the float32
rule's bound where the value cancels). Properties over lengths (0 included), windows, causal, ALiBi, softcap, GQA
ratios, dtypes and page sizes; FlashAttention's documented causal examples; a cross-check against torch's SDPA;
bad input refused, naming the argument, with nothing written. Paged caches: the fast side within the rule of the
reference, and bit-identical to the same rows passed contiguously (the kernels walk the same blocks).
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from attention_cases import FLOOR
from strategies import BFLOAT16, fill, seeds

import fastattn
from fastattn import reference
from fastattn.attention import flash_args
from fastattn._core.tensors import as_array
from fastattn.integrations import flash_attn as fa
from fastattn.reference import flash_attn as ref_fa
from fastattn.testing import assert_half_within_1ulp, assert_within_rule, max_abs_error

F32, F16, F64 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)
DTYPES = [F32, F16] + ([BFLOAT16] if BFLOAT16 is not None else [])
LIBS = [fa, ref_fa]


# ---------------------------------------------------------------------------------------------------------------
# The naive float32 evaluation and the comparison rule.
def naive_attend(q, k, v, scores: flash_args.Scores, slopes):
    """``reference.flash_attn.attend`` written straight in float32: q (Sq, H, D), k, v (Sk, Hk, D|DV)."""
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    sq, heads, _ = q.shape
    sk, heads_k, dv = v.shape
    out = np.zeros((sq, heads, dv), np.float32)
    lse = np.full((heads, sq), np.inf, np.float32)
    if sq == 0 or sk == 0:
        return out, lse
    d = np.arange(sk)[None, :] - (np.arange(sq)[:, None] + sk - sq)
    bias = flash_args.mask_values(d, scores.left, scores.right, slopes is not None).astype(np.float32)
    seen = bias != -np.inf
    group = heads // heads_k
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for h in range(heads):
            s = np.float32(scores.scale) * (q[:, h] @ k[:, h // group].T)
            if scores.softcap:
                s = np.float32(scores.softcap) * np.tanh(s / np.float32(scores.softcap))
            if slopes is not None:
                s = s + np.float32(slopes[h]) * bias
            s = np.where(seen, s, -np.inf)
            top = s.max(axis=1)
            w = np.where(seen, np.exp(s - top[:, None]), np.float32(0))
            total = w.sum(axis=1)
            live = top != -np.inf
            out[:, h] = np.where(live[:, None], (w @ v[:, h // group]) / total[:, None], 0)
            lse[h] = np.where(live, top + np.log(total), np.inf)
    return out, lse


def check_out(fast: np.ndarray, ref64: np.ndarray, naive: np.ndarray, what: str = "") -> None:
    """float32: the rule; float16/bfloat16: 1 ulp, or the float32 rule's bound where the value cancels."""
    assert fast.shape == ref64.shape, (fast.shape, ref64.shape)
    if fast.dtype == F32:
        assert_within_rule(fast, ref64, naive, floor=FLOOR, what=what)
    else:
        bound = 2 * max_abs_error(naive, ref64) + FLOOR
        assert_half_within_1ulp(fast, ref64, what, floor=bound)


def check_lse(fast: np.ndarray, ref64: np.ndarray, naive: np.ndarray, what: str = "") -> None:
    assert fast.dtype == F32 and fast.shape == ref64.shape
    assert np.array_equal(np.isposinf(fast), np.isposinf(ref64)), f"{what}: rows without keys differ"
    finite = np.isfinite(ref64)
    assert_within_rule(fast[finite], ref64[finite], naive[finite],
                       floor=FLOOR * (1 + float(np.abs(ref64[finite]).max(initial=0))), what=f"lse {what}")


def naive_func(q, k, v, scores):
    outs, lses = zip(*(naive_attend(q[b], k[b], v[b], scores, None if scores.alibi is None else scores.alibi[b])
                       for b in range(q.shape[0])))
    return np.stack(outs), np.stack(lses)


# ---------------------------------------------------------------------------------------------------------------
# Strategies.
@st.composite
def score_rules(draw, max_len: int):
    """Keyword arguments of the score rule: causal, window, softcap, ALiBi (None, (H,) or (B, H) drawn later)."""
    kwargs = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        kwargs["window_size"] = (draw(st.integers(-1, max_len)), draw(st.integers(-1, max_len)))
    kwargs["softcap"] = draw(st.sampled_from((0.0, 0.0, 2.5)))
    kwargs["softmax_scale"] = draw(st.sampled_from((None, 0.3)))
    return kwargs, draw(st.sampled_from((None, "heads", "batch")))


def alibi(kind, batch: int, heads: int, rng) -> np.ndarray | None:
    if kind is None:
        return None
    shape = (heads,) if kind == "heads" else (batch, heads)
    slopes = (rng.random(shape) * 0.5).astype(np.float32)
    slopes.flat[0] = 0.0  # a zero slope must still hide what the window hides
    return slopes


HEADS = st.sampled_from(((1, 1), (2, 1), (4, 2), (6, 3), (8, 2)))


@given(data=st.data(), dtype=st.sampled_from(DTYPES), heads=HEADS, seed=seeds)
def test_func_matches_reference(data, dtype, heads, seed):
    rng = np.random.default_rng(seed)
    batch = data.draw(st.sampled_from((1, 2)))
    sq = data.draw(st.one_of(st.integers(0, 9), st.sampled_from((48, 53))))  # 48+: the tiled path
    sk = data.draw(st.one_of(st.integers(0, 12), st.sampled_from((60, 70))))
    h, hk = heads
    d, dv = data.draw(st.sampled_from(((16, 16), (32, 32), (40, 24))))
    kwargs, alibi_kind = data.draw(score_rules(max(sq, sk)))
    q, k, v = (fill(rng, (batch, n, hh, dd), dtype) for n, hh, dd in ((sq, h, d), (sk, hk, d), (sk, hk, dv)))
    kwargs["alibi_slopes"] = alibi(alibi_kind, batch, h, rng)
    out, lse, probs = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert probs is None and out.dtype == dtype and lse.dtype == F32
    ref_out, ref_lse, _ = reference.flash_attn_func(q.astype(F64), k, v, return_attn_probs=True, **kwargs)
    scores = flash_args.parse_func(q, k, v, 0.0, kwargs["softmax_scale"], kwargs["causal"],
                                   kwargs.get("window_size", (-1, -1)), kwargs["softcap"], kwargs["alibi_slopes"],
                                   False, True, floats=flash_args.FAST_FLOATS).scores
    naive_out, naive_lse = naive_func(q, k, v, scores)
    what = f"q {q.shape} k {k.shape} {dtype} {kwargs}"
    check_out(out, ref_out, naive_out, what)
    check_lse(lse, ref_lse, naive_lse, what)
    assert np.array_equal(fa.flash_attn_func(q, k, v, **kwargs), out)  # without the lse: the same output


def _one_hot_values(n: int) -> np.ndarray:
    return np.eye(n, dtype=np.float32)[:, None, :]  # (Sk, 1, Sk): row j of the output weights is key j's weight


@pytest.mark.parametrize("lib", LIBS, ids=["fast", "reference"])
@pytest.mark.parametrize("sq,sk,expected", [
    (2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
    (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]),
])
def test_flashattentions_documented_causal_examples(lib, sq, sk, expected):
    """FlashAttention's docstring: the causal mask aligned to the bottom right corner (1 = keep); a row with no key
    gives zeros (and a logsumexp of +inf)."""
    rng = np.random.default_rng(sq)
    q = rng.standard_normal((1, sq, 1, sk)).astype(np.float32)
    k = rng.standard_normal((1, sk, 1, sk)).astype(np.float32)
    out, lse, _ = lib.flash_attn_func(q, k, _one_hot_values(sk)[None], causal=True, return_attn_probs=True)
    weights = out[0, :, 0, :]
    assert np.array_equal(weights > 0, np.array(expected, bool))
    assert np.allclose(weights.sum(axis=1), np.array(expected).any(axis=1), atol=1e-6)
    assert np.array_equal(np.isposinf(lse[0, 0]), ~np.array(expected, bool).any(axis=1))


@pytest.mark.parametrize("lib", LIBS, ids=["fast", "reference"])
def test_window_follows_the_docstring(lib):
    """window (left, right): query i sees keys [i + Sk - Sq - left, i + Sk - Sq + right]; -1 is unbounded."""
    sq, sk = 4, 9
    q = np.random.default_rng(0).standard_normal((1, sq, 1, sk)).astype(np.float32)
    k = np.random.default_rng(1).standard_normal((1, sk, 1, sk)).astype(np.float32)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    for left, right in ((2, 1), (0, 0), (-1, 1), (3, -1), (20, 20)):
        out = lib.flash_attn_func(q, k, _one_hot_values(sk)[None], window_size=(left, right))
        lo = i + sk - sq - (left if left >= 0 else 10 ** 6)
        hi = i + sk - sq + (right if right >= 0 else 10 ** 6)
        assert np.array_equal(out[0, :, 0, :] > 0, (j >= lo) & (j <= hi)), (left, right)


@pytest.mark.parametrize("lib", LIBS, ids=["fast", "reference"])
def test_alibi_adds_minus_slope_times_distance(lib):
    """Equal keys: the weights are softmax(-slope·|i + Sk - Sq - j|) exactly as FlashAttention documents them."""
    sq, sk = 3, 6
    q = np.zeros((2, sq, 2, 8), np.float32)
    k = np.zeros((2, sk, 1, 8), np.float32)
    slopes = np.array([[0.5, 0.0], [1.5, 0.25]], np.float32)
    out = lib.flash_attn_func(q, k, np.broadcast_to(_one_hot_values(sk), (2, sk, 1, sk)), alibi_slopes=slopes)
    d = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
    for b in range(2):
        for h in range(2):
            w = np.exp(-float(slopes[b, h]) * d)
            assert np.allclose(out[b, :, h], w / w.sum(axis=1, keepdims=True), rtol=1e-6, atol=1e-7)


def test_torch_sdpa_agrees_where_the_semantics_coincide():
    """Non-causal (any lengths) and causal with Sq == Sk, where torch's top-left alignment is FlashAttention's
    bottom-right one; GQA through enable_gqa; torch tensors in, torch tensors out."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    for sq, sk, causal in ((7, 11, False), (9, 9, True), (1, 30, False)):
        q = torch.from_numpy(rng.standard_normal((2, sq, 8, 32)).astype(np.float32))
        k = torch.from_numpy(rng.standard_normal((2, sk, 2, 32)).astype(np.float32))
        v = torch.from_numpy(rng.standard_normal((2, sk, 2, 32)).astype(np.float32))
        out = fa.flash_attn_func(q, k, v, causal=causal)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True)
        assert torch.allclose(out, sdpa.transpose(1, 2), atol=2e-6, rtol=1e-5), (sq, sk, causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_half_tensors_give_tensors_of_their_dtype(dtype):
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((1, 5, 4, 32), generator=gen).to(getattr(torch, dtype)) for _ in range(3))
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and out.shape == q.shape
    ref_out = reference.flash_attn_func(q.to(torch.float64), k, v, causal=True)
    assert isinstance(ref_out, torch.Tensor)
    naive, _ = naive_func(q.float().numpy(), k.float().numpy(), v.float().numpy(),
                          flash_args.Scores(32 ** -0.5, -1, 0, 0.0, None))
    check_out(as_array("out", out), ref_out.numpy(), naive)


# ---------------------------------------------------------------------------------------------------------------
# Masks as strided views.
@given(sq=st.integers(1, 40), sk=st.integers(1, 40), left=st.integers(-1, 45), right=st.integers(-1, 45),
       with_alibi=st.booleans())
def test_mask_views_are_the_dense_rule(sq, sk, left, right, with_alibi):
    scores = flash_args.Scores(1.0, left, right, 0.0, np.ones((1, 1), np.float32) if with_alibi else None)
    view = fa.mask_view(scores, sq, sk)
    d = np.arange(sk)[None, :] - (np.arange(sq)[:, None] + sk - sq)
    dense = flash_args.mask_values(d, left, right, with_alibi).astype(np.float32)
    if view is None:
        assert not with_alibi and (dense == 0).all()
    else:
        assert view.dtype == F32 and not view.flags.writeable and np.array_equal(view, dense)


def test_mask_tables_grow_for_long_sequences():
    scores = flash_args.Scores(1.0, 5, 0, 0.0, None)
    n = fa.MIN_TABLE_RADIUS * 3 + 7
    view = fa.mask_view(scores, n, n + 2)
    assert view[n - 1, n + 1] == 0 and view[n - 1, n - 5] == -np.inf and view[n - 1, n - 4] == 0
    assert view[0, 3] == -np.inf and view[0, 2] == 0


# ---------------------------------------------------------------------------------------------------------------
# Varlen.
def _packed(rng, lengths, heads, dim, dtype):
    return fill(rng, (int(sum(lengths)), heads, dim), dtype)


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@given(data=st.data(), dtype=st.sampled_from(DTYPES), heads=HEADS, seed=seeds)
def test_varlen_matches_reference_and_the_separate_calls(data, dtype, heads, seed):
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(1, 4))
    lq = data.draw(st.lists(st.one_of(st.integers(0, 8), st.just(50)), min_size=n, max_size=n))
    lk = data.draw(st.lists(st.integers(0, 14), min_size=n, max_size=n))
    h, hk = heads
    kwargs, alibi_kind = data.draw(score_rules(14))
    kwargs["alibi_slopes"] = alibi(alibi_kind, n, h, rng)
    q, k, v = _packed(rng, lq, h, 32, dtype), _packed(rng, lk, hk, 32, dtype), _packed(rng, lk, hk, 16, dtype)
    cu_q, cu_k = _cu(lq), _cu(lk)
    args = (cu_q, cu_k, max(lq), max(lk))
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, *args, return_attn_probs=True, **kwargs)
    assert out.dtype == dtype and out.shape == (q.shape[0], h, 16) and lse.shape == (h, q.shape[0])
    ref_out, ref_lse, _ = reference.flash_attn_varlen_func(q.astype(F64), k, v, *args, return_attn_probs=True,
                                                           **kwargs)
    scores = flash_args.parse_func(q[None], k[None], v[None], 0.0, kwargs["softmax_scale"], kwargs["causal"],
                                   kwargs.get("window_size", (-1, -1)), kwargs["softcap"], None, False, False,
                                   floats=flash_args.FAST_FLOATS).scores
    naive_out = np.empty(out.shape, F32)
    naive_lse = np.empty(lse.shape, F32)
    for b in range(n):
        sl = slice(cu_q[b], cu_q[b + 1])
        kl = slice(cu_k[b], cu_k[b + 1])
        slopes = None if kwargs["alibi_slopes"] is None else np.broadcast_to(kwargs["alibi_slopes"], (n, h))[b]
        naive_out[sl], naive_lse[:, sl] = naive_attend(q[sl], k[kl], v[kl], scores, slopes)
        # each sequence runs the kernels on its own rows: flash_attn_func on that sequence gives the same bytes
        one = fa.flash_attn_func(q[sl][None], k[kl][None], v[kl][None], **{
            **kwargs, "alibi_slopes": None if slopes is None else slopes.copy()})
        assert one[0].tobytes() == out[sl].tobytes()
    what = f"lengths q {lq} k {lk} {dtype} {kwargs}"
    check_out(out, ref_out, naive_out, what)
    check_lse(lse, ref_lse, naive_lse, what)


@pytest.mark.parametrize("lib", LIBS, ids=["fast", "reference"])
def test_varlen_reads_strided_packed_views(lib):
    """q, k, v as column slices of one fused projection (strided rows): no copy is needed, the result is the
    contiguous call's."""
    rng = np.random.default_rng(5)
    lengths = [3, 6, 1]
    qkv = rng.standard_normal((10, 4 * 16 + 2 * 2 * 16)).astype(np.float32)
    q = qkv[:, :64].reshape(10, 4, 16)
    k = qkv[:, 64:96].reshape(10, 2, 16)
    v = qkv[:, 96:].reshape(10, 2, 16)
    args = (_cu(lengths), _cu(lengths), 6, 6)
    got = lib.flash_attn_varlen_func(q, k, v, *args, causal=True)
    expected = lib.flash_attn_varlen_func(q.copy(), k.copy(), v.copy(), *args, causal=True)
    assert got.tobytes() == expected.tobytes()


# ---------------------------------------------------------------------------------------------------------------
# KV caches: append (rotated) in place, then attention over the live rows.
CACHE_KINDS = DTYPES + ["q8_0", "q4_0"]


def make_cache(rng, kind, shape):
    values = rng.standard_normal(shape).astype(np.float32)
    if isinstance(kind, str):
        return fastattn.quantize(values, kind)
    return values.astype(kind)


def new_rows_dtype(kind):
    return F16 if isinstance(kind, str) else kind  # into a Quantized cache: any float dtype (float16 here)


def memory(cache) -> np.ndarray:
    return cache.data if isinstance(cache, fastattn.Quantized) else cache


def copy_cache(cache):
    if isinstance(cache, fastattn.Quantized):
        return fastattn.Quantized(cache.data.copy(), cache.qtype)
    return cache.copy()


def naive_rotary(x32, cos, sin, interleaved):
    """``reference.flash_attn.apply_rotary`` in float32."""
    n = cos.shape[1]
    first = np.arange(0, 2 * n, 2) if interleaved else np.arange(n)
    second = first + 1 if interleaved else first + n
    c, s = cos.astype(F32)[:, None], sin.astype(F32)[:, None]
    out = x32.copy()
    out[..., first] = x32[..., first] * c - x32[..., second] * s
    out[..., second] = x32[..., first] * s + x32[..., second] * c
    return out


def expected_from_caches(a: flash_args.KVCache, q, k_cache, v_cache):
    """The reference's attention (float64) and the naive float32 one over given caches (the fast side's, after its
    append), the query rotated as the call rotates it: the output check that does not depend on how the cache
    rows were rounded."""
    batch, sq, heads, _ = q.shape
    out64 = np.empty((batch, sq, heads, v_cache.shape[3]))
    naive = np.empty(out64.shape, F32)
    for b in range(batch):
        keys, values = ref_fa._live_rows(a, k_cache, b), ref_fa._live_rows(a, v_cache, b)
        q64, q32 = q[b].astype(F64), q[b].astype(F32)
        if a.rotary is not None:
            cos, sin = a.rotary[0][a.q_positions(b)], a.rotary[1][a.q_positions(b)]
            q64 = ref_fa.apply_rotary(q64, cos, sin, a.interleaved)
            q32 = naive_rotary(q32, cos, sin, a.interleaved)
        slopes = None if a.scores.alibi is None else a.scores.alibi[b]
        out64[b] = ref_fa.attend(q64, keys, values, a.scores, slopes)[0]
        naive[b] = naive_attend(q32, keys, values, a.scores, slopes)[0]
    return out64, naive


def written(a: flash_args.KVCache, cache) -> np.ndarray:
    """bool mask over the cache's (entry, row) of the rows the append writes."""
    mask = np.zeros(cache.shape[:2], bool)
    for b in range(a.q.shape[0]):
        for r in range(a.seqlens[b], a.seqlens[b] + a.n_new):
            mask[ref_fa._cache_row(a, b, r)] = True
    return mask


def check_appended(a: flash_args.KVCache, name: str, fast, before, reference_written) -> None:
    """Rows outside the append untouched; appended V rows (and K rows without rotary) byte-identical to the
    reference's; rotated K rows within the rotation's rounding of it (composition for a Quantized cache)."""
    rows = written(a, fast)
    fast_m, before_m, ref_m = memory(fast), memory(before), memory(reference_written)
    assert np.array_equal(fast_m[~rows].view(np.uint8), before_m[~rows].view(np.uint8)), f"{name}: other rows"
    if name == "v_cache" or a.rotary is None:
        assert fast_m.tobytes() == ref_m.tobytes(), f"{name}: appended rows"
        return
    positions = np.concatenate([a.seqlens[b] + np.arange(a.n_new) for b in range(a.q.shape[0])])
    cos, sin = a.rotary[0][positions], a.rotary[1][positions]
    new = a.k.reshape((-1,) + a.k.shape[2:])
    where = tuple(np.array([ref_fa._cache_row(a, b, r) for b in range(a.q.shape[0])
                            for r in range(a.seqlens[b], a.seqlens[b] + a.n_new)]).T)
    if isinstance(fast, fastattn.Quantized):  # the fused rotate + quantize writes quantize(rotated float32 rows)
        rope = fastattn.rope.api.rope_cache_from_tables(cos, sin, interleaved=a.interleaved)
        rotated = fastattn.apply_rope_cache(new.astype(F32), rope)
        assert np.array_equal(fast.data[where], fastattn.quantize(rotated, fast.qtype).data), "k_cache rows"
        return
    ref64 = ref_fa.apply_rotary(new.astype(F64), cos, sin, a.interleaved)
    got = fast[where]
    if got.dtype == F32:
        assert_within_rule(got, ref64, naive_rotary(new.astype(F32), cos, sin, a.interleaved),
                           floor=4e-7 * (1 + float(np.abs(ref64).max())), what="rotated k rows")
    else:
        assert_half_within_1ulp(got, ref64, "rotated k rows", floor=4e-7 * (1 + float(np.abs(ref64).max())))


@st.composite
def kvcache_calls(draw):
    """(arguments of flash_attn_with_kvcache, cache kind) for a contiguous cache."""
    rng = np.random.default_rng(draw(seeds))
    kind = draw(st.sampled_from(CACHE_KINDS))
    h, hk = draw(HEADS)
    d = draw(st.sampled_from((32, 64)))
    batch = draw(st.integers(1, 3))
    sq = draw(st.one_of(st.integers(1, 5), st.just(49)))
    n_new = draw(st.sampled_from((0, 1, 3)))
    sc = draw(st.integers(max(n_new, 1), 40))
    with_idx = draw(st.booleans())
    entries = batch + (2 if with_idx else 0)
    kwargs, alibi_kind = draw(score_rules(sc))
    kwargs["alibi_slopes"] = alibi(alibi_kind, batch, h, rng)
    kwargs["num_splits"] = draw(st.sampled_from((0, 1, 2)))
    seqlens = rng.integers(0, sc - n_new + 1, batch).astype(np.int32)
    call = dict(q=fill(rng, (batch, sq, h, d), draw(st.sampled_from(DTYPES))),
                k_cache=make_cache(rng, kind, (entries, sc, hk, d)),
                v_cache=make_cache(rng, kind, (entries, sc, hk, d)),
                cache_seqlens=seqlens if draw(st.booleans()) or batch > 1 else int(seqlens[0]), **kwargs)
    if with_idx:
        call["cache_batch_idx"] = rng.permutation(entries)[:batch].astype(np.int32)
    if draw(st.booleans()):
        call["cache_leftpad"] = (rng.random(batch) * (seqlens + 1)).astype(np.int32)
    if n_new:
        call["k"] = fill(rng, (batch, n_new, hk, d), new_rows_dtype(kind))
        call["v"] = fill(rng, (batch, n_new, hk, d), new_rows_dtype(kind))
        if draw(st.booleans()):
            rotary_dim = draw(st.sampled_from((8, d // 2, d)))
            angles = rng.uniform(0, 2 * np.pi, (sc + sq, rotary_dim // 2))
            table_dtype = draw(st.sampled_from(DTYPES))
            call.update(rotary_cos=np.cos(angles).astype(table_dtype), rotary_sin=np.sin(angles).astype(table_dtype),
                        rotary_interleaved=draw(st.booleans()))
    return call


def _parsed(call: dict) -> flash_args.KVCache:
    names = list(inspect.signature(fa.flash_attn_with_kvcache).parameters)
    defaults = {n: p.default for n, p in inspect.signature(fa.flash_attn_with_kvcache).parameters.items()}
    return flash_args.parse_kvcache(*[call.get(n, defaults[n]) for n in names], floats=flash_args.FAST_FLOATS)


def run_kvcache(call: dict, lib=fa, q=None):
    """The call on copies of its caches: (result, k_cache, v_cache)."""
    caches = {n: copy_cache(call[n]) for n in ("k_cache", "v_cache")}
    result = lib.flash_attn_with_kvcache(**{**call, **caches, **({} if q is None else {"q": q})},
                                         return_softmax_lse=True)
    return result, caches["k_cache"], caches["v_cache"]


@given(call=kvcache_calls())
def test_kvcache_appends_then_attends_as_the_reference(call):
    a = _parsed(call)
    q = call["q"]
    (out, lse), k_fast, v_fast = run_kvcache(call)
    (ref_out, ref_lse), k_ref, v_ref = run_kvcache(call, reference, q=q.astype(F64))
    what = (f"q {q.shape} {q.dtype} cache {call['k_cache']!r} new {a.n_new} rotary {a.rotary is not None} "
            f"{ {n: call[n] for n in ('cache_seqlens', 'causal', 'softcap') } }")
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    check_appended(a, "k_cache", k_fast, call["k_cache"], k_ref)
    check_appended(a, "v_cache", v_fast, call["v_cache"], v_ref)
    expected, naive = expected_from_caches(a, q, k_fast, v_fast)
    check_out(out, expected, naive, what)
    # the reference's own caches: its output is the same composition over them
    own, _ = expected_from_caches(a, q, k_ref, v_ref)
    assert np.allclose(ref_out, own, rtol=1e-12, atol=1e-12)
    if a.rotary is None:  # identical caches: the lse against the reference's directly
        naive_lse = np.stack([naive_attend(q[b], ref_fa._live_rows(a, k_fast, b), ref_fa._live_rows(a, v_fast, b),
                                           a.scores, None if a.scores.alibi is None else a.scores.alibi[b])[1]
                              for b in range(q.shape[0])])
        check_lse(lse, ref_lse, naive_lse, what)


# ---------------------------------------------------------------------------------------------------------------
# Paged caches: the reference gathers through block_table (the definition); the fast side reads the pages in place.
def paged(rng, cache, page: int):
    """The contiguous cache (entries, S, Hk, D) as shuffled pages of ``page`` rows (and 3 spare pages, NaN-filled
    where values are floats): (paged cache, block_table (entries, ceil(S / page)) int32)."""
    entries, rows = cache.shape[:2]
    n_pages = -(-rows // page)
    table = rng.permutation(entries * n_pages + 3)[:entries * n_pages].reshape(entries, n_pages).astype(np.int32)
    source = memory(cache)
    pages = np.zeros((entries * n_pages + 3, page) + source.shape[2:], source.dtype)
    if not isinstance(cache, fastattn.Quantized):
        pages[...] = np.nan
    for e in range(entries):
        for j in range(n_pages):
            part = source[e, j * page:(j + 1) * page]
            pages[table[e, j], :part.shape[0]] = part
    return (fastattn.Quantized(pages, cache.qtype) if isinstance(cache, fastattn.Quantized) else pages), table


def unpaged(pages, table: np.ndarray, rows: int) -> np.ndarray:
    """The logical rows [0, rows) of every sequence of a paged cache, as a contiguous cache's memory."""
    source = memory(pages)
    page = source.shape[1]
    r = np.arange(rows)
    return np.stack([source[table[e, r // page], r % page] for e in range(table.shape[0])])


@st.composite
def paged_kvcache_calls(draw):
    call = draw(kvcache_calls())
    call.pop("cache_batch_idx", None)  # not with a block table (FlashAttention's rule)
    batch = call["q"].shape[0]
    for name in ("k_cache", "v_cache"):
        call[name] = call[name] if call[name].shape[0] == batch else _first(call[name], batch)
    return call, draw(st.sampled_from((1, 3, 16)))


def _first(cache, n):
    return fastattn.Quantized(cache.data[:n].copy(), cache.qtype) if isinstance(cache, fastattn.Quantized) \
        else cache[:n].copy()


@given(case=paged_kvcache_calls(), seed=seeds)
def test_reference_paged_cache_is_the_contiguous_cache_read_through_its_pages(case, seed):
    call, page = case
    rng = np.random.default_rng(seed)
    rows = call["k_cache"].shape[1]
    k_pages, table = paged(rng, call["k_cache"], page)
    v_pages, _ = paged(np.random.default_rng(seed), call["v_cache"], page)  # the same shuffle
    q64 = call["q"].astype(F64)
    (contiguous, lse), k_after, v_after = run_kvcache(call, reference, q=q64)
    paged_call = {**call, "k_cache": k_pages, "v_cache": v_pages, "block_table": table}
    (out, paged_lse), k_pages_after, v_pages_after = run_kvcache(paged_call, reference, q=q64)
    assert out.tobytes() == contiguous.tobytes() and paged_lse.tobytes() == lse.tobytes()
    assert unpaged(k_pages_after, table, rows).tobytes() == memory(k_after).tobytes()
    assert unpaged(v_pages_after, table, rows).tobytes() == memory(v_after).tobytes()


@given(case=paged_kvcache_calls(), seed=seeds)
def test_fast_paged_kvcache_matches_reference(case, seed):
    call, page = case
    rng = np.random.default_rng(seed)
    k_pages, table = paged(rng, call["k_cache"], page)
    v_pages, _ = paged(np.random.default_rng(seed), call["v_cache"], page)
    paged_call = {**call, "k_cache": k_pages, "v_cache": v_pages, "block_table": table}
    a = _parsed(paged_call)
    (out, lse), k_fast, v_fast = run_kvcache(paged_call)
    _, k_ref, v_ref = run_kvcache(paged_call, reference, q=call["q"].astype(F64))
    check_appended(a, "k_cache", k_fast, k_pages, k_ref)
    check_appended(a, "v_cache", v_fast, v_pages, v_ref)
    expected, naive = expected_from_caches(a, call["q"], k_fast, v_fast)
    check_out(out, expected, naive, f"page {page}")


def _paged_varlen_case(seed, page, dtype=F32):
    rng = np.random.default_rng(seed)
    lq, lk = [2, 0, 5, 1], [7, 3, 20, 0]
    q = _packed(rng, lq, 4, 32, dtype)
    cache = make_cache(rng, dtype, (4, 20, 2, 32))
    k_pages, table = paged(np.random.default_rng(seed), cache, page)
    packed = np.concatenate([memory(cache)[b, :n] for b, n in enumerate(lk)])
    return q, k_pages, table, packed, (_cu(lq), _cu(lk), 5, 20)


@pytest.mark.parametrize("page", [1, 3, 16])
def test_reference_paged_varlen_is_the_packed_call(page):
    q, k_pages, table, packed, args = _paged_varlen_case(page, page)
    got = reference.flash_attn_varlen_func(q, k_pages, k_pages, *args, causal=True, block_table=table)
    assert got.tobytes() == reference.flash_attn_varlen_func(q, packed, packed, *args, causal=True).tobytes()


@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_fast_paged_varlen_matches_the_packed_call(page, dtype):
    q, k_pages, table, packed, args = _paged_varlen_case(page, page, dtype)
    got = fa.flash_attn_varlen_func(q, k_pages, k_pages, *args, causal=True, window_size=(4, 0), block_table=table)
    expected = fa.flash_attn_varlen_func(q, packed, packed, *args, causal=True, window_size=(4, 0))
    assert got.tobytes() == expected.tobytes()  # the same rows through the pages: the same kernels' result


@pytest.mark.parametrize("page", [1, 16, 32, 48, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 2])
def test_fast_paged_kvcache_is_the_contiguous_call(page, num_splits):
    """Decode over a batch of paged sequences of other lengths and left pads (one kernel call for the batch, or
    split_kv per sequence): bit-identical to the same call over the contiguous caches, for pages smaller than a
    block of the kernels (every block copied), multiples of it (read in place) and neither."""
    rng = np.random.default_rng(page)
    k_cache, v_cache = fill(rng, (3, 600, 2, 32), F16), fill(rng, (3, 600, 2, 32), F16)
    k_pages, table = paged(np.random.default_rng(page), k_cache, page)
    v_pages, _ = paged(np.random.default_rng(page), v_cache, page)
    q = fill(rng, (3, 1, 8, 32), F32)
    live = dict(cache_seqlens=np.array([600, 37, 300], np.int32), cache_leftpad=np.array([5, 0, 70], np.int32),
                num_splits=num_splits, causal=True, return_softmax_lse=True)
    out, lse = fa.flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table, **live)
    expected, expected_lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, **live)
    assert out.tobytes() == expected.tobytes() and lse.tobytes() == expected_lse.tobytes()


# ---------------------------------------------------------------------------------------------------------------
# Bad input: refused by both sides, naming the argument, before anything is written.
def _kv_case(**changes):
    rng = np.random.default_rng(0)
    call = dict(q=fill(rng, (2, 1, 4, 32), F32), k_cache=fill(rng, (2, 10, 2, 32), F16),
                v_cache=fill(rng, (2, 10, 2, 32), F16), k=fill(rng, (2, 2, 2, 32), F16),
                v=fill(rng, (2, 2, 2, 32), F16), cache_seqlens=np.array([3, 8], np.int32))
    call.update(changes)
    return {n: c for n, c in call.items() if c is not None or n in ("k", "v")}


_TABLE = np.array([[0, 1], [2, 5]], np.int32)
KV_BAD = [
    ("cache too small", dict(cache_seqlens=np.array([3, 9], np.int32)), ValueError, "cache is too small"),
    ("paged cache too small", dict(k_cache=np.zeros((6, 4, 2, 32), F16), v_cache=np.zeros((6, 4, 2, 32), F16),
                                   block_table=_TABLE, cache_seqlens=np.array([3, 7], np.int32)),
     ValueError, "cache is too small"),
    ("block table out of range", dict(k_cache=np.zeros((5, 8, 2, 32), F16), v_cache=np.zeros((5, 8, 2, 32), F16),
                                      block_table=_TABLE), ValueError, r"block_table entries must be in \[0, 5\)"),
    ("batch idx with block table", dict(k_cache=np.zeros((6, 8, 2, 32), F16), v_cache=np.zeros((6, 8, 2, 32), F16),
                                        block_table=_TABLE, cache_batch_idx=np.array([0, 1], np.int32)),
     ValueError, "cache_batch_idx"),
    ("k dtype", dict(k=np.zeros((2, 2, 2, 32), F32)), TypeError, "k must have k_cache's dtype float16"),
    ("v dtype", dict(v=np.zeros((2, 2, 2, 32), F32)), TypeError, "v must have v_cache's dtype float16"),
    ("heads", dict(q=np.zeros((2, 1, 3, 32), F32)), ValueError, r"k's heads \(2\) must divide q's heads \(3\)"),
    ("k without v", dict(v=None), ValueError, "k and v must be given together"),
    ("no seqlens", dict(cache_seqlens=None), ValueError, "cache_seqlens is required"),
    ("leftpad", dict(cache_leftpad=np.array([4, 0], np.int32)), ValueError, "cache_leftpad"),
    ("batch idx", dict(cache_batch_idx=np.array([0, 2], np.int32)), ValueError, r"cache_batch_idx must be in \[0, 2\)"),
    ("rotary without k", dict(k=None, v=None, rotary_cos=np.ones((20, 8), F32), rotary_sin=np.ones((20, 8), F32)),
     ValueError, "need k and v"),
    ("rotary too short", dict(rotary_cos=np.ones((9, 8), F32), rotary_sin=np.ones((9, 8), F32), causal=True),
     ValueError, "rotary_cos and rotary_sin must have a row for every position"),
    ("rotary too wide", dict(rotary_cos=np.ones((20, 17), F32), rotary_sin=np.ones((20, 17), F32)),
     ValueError, "rotary_dim <= headdim"),
    ("rotary alone", dict(rotary_cos=np.ones((20, 8), F32)), ValueError, "rotary_cos and rotary_sin must be given"),
    ("alibi shape", dict(alibi_slopes=np.ones(3, F32)), ValueError, "alibi_slopes must have shape"),
    ("alibi dtype", dict(alibi_slopes=np.ones(4)), TypeError, "alibi_slopes must have dtype float32"),
    ("window", dict(window_size=3), TypeError, "window_size must be a pair"),
    ("softcap", dict(softcap=-1.0), ValueError, "softcap must be 0"),
    ("num_splits", dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
    ("cache dtype", dict(k_cache=np.zeros((2, 10, 2, 32), np.int8)), TypeError, "k_cache must"),
]


@pytest.mark.parametrize("lib", LIBS, ids=["fast", "reference"])
@pytest.mark.parametrize("case", KV_BAD, ids=[c[0] for c in KV_BAD])
def test_kvcache_refuses_bad_input_and_writes_nothing(lib, case):
    _, changes, error, match = case
    call = _kv_case(**changes)
    before = {n: memory(call[n]).copy() for n in ("k_cache", "v_cache")}
    with pytest.raises(error, match=match):
        lib.flash_attn_with_kvcache(**call)
    for name, saved in before.items():
        assert memory(call[name]).tobytes() == saved.tobytes(), f"{name} was written"


def _varlen_case(**changes):
    rng = np.random.default_rng(1)
    call = dict(q=fill(rng, (7, 4, 16), F32), k=fill(rng, (9, 2, 16), F32), v=fill(rng, (9, 2, 16), F32),
                cu_seqlens_q=np.array([0, 3, 7], np.int32), cu_seqlens_k=np.array([0, 4, 9], np.int32),
                max_seqlen_q=4, max_seqlen_k=5)
    call.update(changes)
    return call


VARLEN_BAD = [
    ("decreasing", dict(cu_seqlens_q=np.array([0, 5, 3, 7], np.int32)), ValueError,
     "cu_seqlens_q must be non-decreasing"),
    ("short", dict(cu_seqlens_k=np.array([0, 4, 8], np.int32)), ValueError,
     "cu_seqlens_k must end at the packed length 9"),
    ("not from 0", dict(cu_seqlens_q=np.array([1, 3, 7], np.int32)), ValueError, "cu_seqlens_q must start at 0"),
    ("batch", dict(cu_seqlens_k=np.array([0, 9], np.int32)), ValueError, r"cu_seqlens_k must have batch_size \+ 1 = 3"),
    ("float", dict(cu_seqlens_q=np.array([0.0, 3, 7])), TypeError, "cu_seqlens_q must have dtype"),
    ("max_seqlen", dict(max_seqlen_k=4), ValueError, "max_seqlen_k must be at least the longest sequence, 5"),
    ("heads", dict(k=np.zeros((9, 3, 16), F32), v=np.zeros((9, 3, 16), F32)), ValueError, "must divide"),
    ("dropout", dict(dropout_p=0.1), ValueError, "dropout_p must be 0.0"),
    ("block table", dict(k=np.zeros((3, 4, 2, 16), F32), v=np.zeros((3, 4, 2, 16), F32),
                         block_table=np.array([[0, 1], [2, 3]], np.int32)), ValueError, r"block_table entries"),
    ("paged too small", dict(k=np.zeros((4, 2, 2, 16), F32), v=np.zeros((4, 2, 2, 16), F32),
                             block_table=np.array([[0, 1], [2, 3]], np.int32)), ValueError, "too small"),
]


@pytest.mark.parametrize("lib", LIBS, ids=["fast", "reference"])
@pytest.mark.parametrize("case", VARLEN_BAD, ids=[c[0] for c in VARLEN_BAD])
def test_varlen_refuses_bad_input(lib, case):
    _, changes, error, match = case
    with pytest.raises(error, match=match):
        lib.flash_attn_varlen_func(**_varlen_case(**changes))


@pytest.mark.parametrize("lib", LIBS, ids=["fast", "reference"])
def test_func_refuses_dropout_heads_and_batches(lib):
    q, k = np.zeros((2, 3, 4, 16), F32), np.zeros((2, 5, 2, 16), F32)
    with pytest.raises(ValueError, match="dropout_p must be 0.0"):
        lib.flash_attn_func(q, k, k, dropout_p=0.5)
    with pytest.raises(ValueError, match=r"k's heads \(3\) must divide q's heads \(4\)"):
        lib.flash_attn_func(q, k[:, :, :1].repeat(3, 2), k[:, :, :1].repeat(3, 2))
    with pytest.raises(ValueError, match="one batch"):
        lib.flash_attn_func(q, k[:1], k[:1])
    with pytest.raises(TypeError, match="q must have dtype"):
        lib.flash_attn_func(q.astype(np.int32), k, k)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        lib.flash_attn_func(q, k, k, deterministic="yes")


# ---------------------------------------------------------------------------------------------------------------
# Signatures: FlashAttention's, the same on both sides.
FLASH_ATTN_SIGNATURES = {
    "flash_attn_func": "(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                       "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)",
    "flash_attn_varlen_func": "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
                              "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                              "alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None)",
    "flash_attn_with_kvcache": "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
                               "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
                               "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                               "rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
                               "return_softmax_lse=False)",
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_SIGNATURES))
def test_signatures_are_flashattentions_on_both_sides(name):
    for lib in (fa, reference):
        assert str(inspect.signature(getattr(lib, name))) == FLASH_ATTN_SIGNATURES[name]
    assert getattr(fa, name).__doc__


# ---------------------------------------------------------------------------------------------------------------
# num_splits: the decode paths.
@pytest.mark.parametrize("num_splits,path", [(0, "auto"), (1, "one_chunk"), (2, "split_kv")])
def test_num_splits_picks_the_decode_path(num_splits, path):
    rng = np.random.default_rng(2)
    q = fill(rng, (1, 1, 8, 64), F32)
    k_cache, v_cache = fill(rng, (1, 700, 2, 64), F16), fill(rng, (1, 700, 2, 64), F16)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=650, num_splits=num_splits)
    expected = fastattn.flash_attn_ext(q.transpose(0, 2, 1, 3), k_cache[:, :650].transpose(0, 2, 1, 3),
                                       v_cache[:, :650].transpose(0, 2, 1, 3), path=path)
    assert out.tobytes() == expected.tobytes()


def test_kvcache_torch_caches_are_written_in_place():
    torch = pytest.importorskip("torch")
    call = {n: (torch.from_numpy(c) if isinstance(c, np.ndarray) else c) for n, c in _kv_case().items()}
    expected_cache = call["k_cache"].clone()
    expected_cache[0, 3:5] = call["k"][0]
    expected_cache[1, 8:10] = call["k"][1]
    out = fa.flash_attn_with_kvcache(**call, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert torch.equal(call["k_cache"], expected_cache)


# ---------------------------------------------------------------------------------------------------------------
# docs/flash_attn.md: its snippets run as written.
DOC = Path(__file__).resolve().parents[1] / "docs" / "flash_attn.md"
SNIPPETS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.M | re.S)
FAST_IMPORT = "from fastattn.integrations.flash_attn import flash_attn_with_kvcache"


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_doc_snippets_run(index):
    exec(compile(SNIPPETS[index], f"docs/flash_attn.md snippet {index}", "exec"), {"__name__": "doc"})


def test_doc_paged_loop_runs_on_the_fast_side():
    paged_loop = next(s for s in SNIPPETS if "block_table" in s)
    code = paged_loop.replace(next(line for line in paged_loop.splitlines() if "fastattn.reference" in line),
                              FAST_IMPORT)
    exec(compile(code, "docs/flash_attn.md paged loop, fast", "exec"), {"__name__": "doc"})


@pytest.mark.parametrize("layout", ["sliced", "kv packed", "quantized sliced"])
@pytest.mark.parametrize("rotary", [False, True])
def test_kvcache_strided_cache_views(layout, rotary):
    """Caches that are views: the first 12 rows of longer caches (entries and rows do not merge: the append
    writes entry by entry), and FlashAttention's packed KV cache (kv[:, :, 0], kv[:, :, 1]) with heads interleaved;
    the rows around the written ones stay as they were."""
    rng = np.random.default_rng(4)
    if layout == "kv packed":
        storage = fill(rng, (3, 12, 2, 2, 32), F16)
        k_cache, v_cache = storage[:, :, 0], storage[:, :, 1]
    elif layout == "sliced":
        storage = fill(rng, (2, 3, 20, 2, 32), F16)
        k_cache, v_cache = storage[0, :, :12], storage[1, :, :12]
    else:
        data = fastattn.quantize(rng.standard_normal((2, 3, 20, 2, 32)).astype(np.float32), "q8_0").data
        k_cache, v_cache = (fastattn.Quantized(data[i, :, :12], "q8_0") for i in range(2))
        storage = data
    call = dict(q=fill(rng, (3, 2, 4, 32), F32), k_cache=k_cache, v_cache=v_cache,
                k=fill(rng, (3, 2, 2, 32), F16), v=fill(rng, (3, 2, 2, 32), F16),
                cache_seqlens=np.array([0, 4, 10], np.int32), cache_batch_idx=np.array([2, 0, 1], np.int32),
                causal=True)
    if rotary:
        angles = rng.uniform(0, 6, (20, 8))
        call.update(rotary_cos=np.cos(angles).astype(F32), rotary_sin=np.sin(angles).astype(F32))
    a = _parsed(call)
    before = storage.copy()
    out = fa.flash_attn_with_kvcache(**call)  # in place, into the views
    reference_call = {**call, "k_cache": copy_cache(k_cache), "v_cache": copy_cache(v_cache)}
    _, k_ref, v_ref = run_kvcache({**reference_call, "q": call["q"]}, reference)
    if layout != "kv packed":  # rows past the views' 12: untouched
        assert storage[:, :, 12:].tobytes() == before[:, :, 12:].tobytes()
    check_appended(a, "k_cache", k_cache, _snapshot(before, layout, 0), k_ref)
    check_appended(a, "v_cache", v_cache, _snapshot(before, layout, 1), v_ref)
    assert written(a, k_cache).sum() == 6
    expected, naive = expected_from_caches(a, call["q"], k_cache, v_cache)
    check_out(out, expected, naive, layout)


def _snapshot(before, layout, which):
    """The cache ``which`` (0: K, 1: V) as it was, from the saved storage."""
    if layout == "kv packed":
        return before[:, :, which]
    if layout == "sliced":
        return before[which, :, :12]
    return fastattn.Quantized(before[which, :, :12], "q8_0")

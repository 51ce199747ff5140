"""flash_attn_ext's rule for non-finite values and its scalar ranges, on every path and in the reference.

The rule: a key whose mask entry is -inf for a query (a hidden key) is never read for it, so a NaN or inf in its K
or V row (an unwritten cache cell) cannot change that query's output, whatever the ALiBi slope; a NaN in a live
input (q, a K or V row that is not hidden, the mask, a sink) reaches the same outputs on every path and in the
reference. Logits stay moderate here, so no live key's float32 weight underflows to 0 (the one case the rule
leaves open).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from attention_cases import FLOOR, naive_f32
from fastattn.testing import assert_within_rule, parallel_min_bytes
from strategies import seeds, strided, thread_counts

import fastattn
from fastattn import reference
from fastattn._core import threads as _threads
from fastattn.attention.args import FLOAT32_MAX, SOFTCAP_MIN

PATHS = ["one_chunk", "split_kv", "tiled", "auto"]
F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
POISONS = (np.nan, np.inf, -np.inf)


def run(path, threads, q, k, v, mask, **params):
    """The fast path; at 2 threads even these small calls take the parallel drivers."""
    with parallel_min_bytes(0 if threads > 1 else _threads.PARALLEL_MIN_BYTES), fastattn.num_threads(threads):
        return fastattn.flash_attn_ext(q, k, v, mask, path=path, **params)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def hide(rng, kind, shape):
    """A (Bm, Hm, Nq, Nkv) mask of uniform [-1, 1] values with -inf entries laid out by ``kind`` and one query row
    that sees no key; the KV rows hidden for every query of every head (the unwritten cache cells of "cache") are
    returned too."""
    Bm, Hm, Nq, Nkv = shape
    mask = rng.uniform(-1.0, 1.0, shape)
    dead = np.zeros(Nkv, bool)
    if kind == "cache":  # a cache whose last rows are unwritten, and a causal mask over the rest
        n_valid = int(rng.integers(1, Nkv + 1))
        dead[n_valid:] = True
        rows, cols = np.arange(Nq)[:, None], np.arange(Nkv)[None, :]
        mask = np.where(cols > rows + max(n_valid - Nq, 0), -np.inf, mask)
        mask[..., dead] = -np.inf
    elif kind == "entries":  # each (head, query, key) hidden or not: rows hidden for some heads, live for others
        mask[rng.random(shape) < 0.5] = -np.inf
    else:  # "windows": each mask head sees its own window of keys (whole KV tiles hidden for some heads)
        for hm in range(Hm):
            lo = int(rng.integers(0, Nkv))
            hi = int(rng.integers(lo + 1, Nkv + 1))
            mask[:, hm, :, :lo] = -np.inf
            mask[:, hm, :, hi:] = -np.inf
    # a query row that sees no key (zeros; NaN with a NaN sink)
    mask[int(rng.integers(0, Bm)), int(rng.integers(0, Hm)), int(rng.integers(0, Nq))] = -np.inf
    return mask, dead


@st.composite
def problems(draw, path, threads):
    """q, K and V views, a mask and parameters: moderate logits, every register block and tile case."""
    B = draw(st.sampled_from((1, 2)))
    Bk = draw(st.sampled_from(sorted({1, B})))
    Hkv = draw(st.sampled_from((1, 2)))
    G = draw(st.sampled_from((4, 5, 1, 3, 8)))  # register blocks of 4 heads and single heads
    Hq = Hkv * G
    Nq = 1 if path == "split_kv" else draw(st.sampled_from((1, 2, 48, 50)) | st.integers(1, 60))
    Nkv = draw(st.sampled_from((1, 33, 64, 65, 130)) | st.integers(1, 140))
    DK, DV = draw(st.sampled_from(((16, 16), (40, 24), (64, 64))))
    kv_dtype = draw(st.sampled_from((F32, F16)))
    q = draw(strided((B, Hq, Nq, DK), F32))
    k = draw(strided((Bk, Hkv, Nkv, DK), kv_dtype))
    v = draw(strided((Bk, Hkv, Nkv, DV), kv_dtype))
    Hm = draw(st.sampled_from(sorted({1, Hq} | ({2} if Hq % 2 == 0 else set()), reverse=True)))
    Bm = draw(st.sampled_from(sorted({1, B})))
    kind = draw(st.sampled_from(("entries", "cache", "windows")))
    mask, dead = hide(np.random.default_rng(draw(seeds)), kind, (Bm, Hm, Nq, Nkv))
    mask = mask.astype(kv_dtype)  # masks of the K/V dtype: the suite's kernel variants (strategies)
    params = dict(scale=1.0 / np.sqrt(DK),
                  max_bias=draw(st.sampled_from((0.0, 8.0, 1e6))),  # 1e6: every slope 0
                  logit_softcap=draw(st.sampled_from((0.0, 20.0))))
    if draw(st.booleans()):
        params["sinks"] = np.random.default_rng(draw(seeds)).standard_normal(Hq).astype(np.float32)
    return q, k, v, mask, dead, params


def live_keys(mask, B, Hq):
    """live[b, i, h, j]: key j is not hidden from query row i of head h in batch b."""
    Bm, Hm = mask.shape[:2]
    return np.stack([np.stack([mask[b % Bm, h % Hm] != -np.inf for h in range(Hq)], axis=1)
                     for b in range(B)])


def check_poisoned(path, threads, q, k, v, mask, rows, poison, k_column, in_v, params):
    """Poison K rows ``rows`` (column ``k_column``; None: K untouched) and, with ``in_v``, their V rows, in place:
    every output those rows are hidden from keeps the bits it had with them finite and agrees with the
    reference; with a NaN poison the others are NaN exactly where the reference's are."""
    B, Hq = q.shape[:2]
    clean = run(path, threads, q, k, v, mask, **params)
    if k_column is not None:
        k[:, :, rows, k_column] = poison
    if in_v:
        v[:, :, rows, :] = poison
    got = run(path, threads, q, k, v, mask, **params)
    hidden = ~live_keys(mask, B, Hq)[..., rows].any(axis=-1)  # (B, Nq, Hq): outputs no poisoned row reaches
    assert np.array_equal(bits(got[hidden]), bits(clean[hidden])), f"{path}: a hidden row changed an output"
    ref = reference.flash_attn_ext(q, k, v, mask, out=np.empty(got.shape), **params)
    naive = naive_f32(q, k, v, mask, **params)
    assert np.isfinite(ref[hidden]).all() and np.isfinite(got[hidden]).all()
    assert_within_rule(got[hidden], ref[hidden], naive[hidden], floor=FLOOR, what=path)
    if np.isnan(poison):
        assert np.array_equal(np.isnan(got), np.isnan(ref)), f"{path}: NaN positions differ from the reference's"


@pytest.mark.parametrize("path", PATHS)
@given(data=st.data(), threads=thread_counts)
def test_nonfinite_rows_behind_the_mask_are_never_read(path, data, threads):
    """NaN / inf in K and V rows a mask hides: every output they are hidden from keeps the bits it has with those
    rows finite, on each path, and agrees with the reference; outputs a NaN row is live for are NaN exactly where
    the reference's are."""
    q, k, v, mask, dead, params = data.draw(problems(path, threads))
    Nkv = k.array.shape[2]
    # the rows to poison: the unwritten cells, or (per-head masks) a few rows hidden only here and there
    rows = np.flatnonzero(dead) if dead.any() and data.draw(st.booleans()) else np.unique(
        data.draw(st.lists(st.integers(0, Nkv - 1), min_size=1, max_size=3)))
    in_k, in_v = data.draw(st.sampled_from(((True, True), (False, True), (True, False))))
    k_column = data.draw(st.integers(0, k.array.shape[3] - 1)) if in_k else None
    check_poisoned(path, threads, q.array, k.array, v.array, mask, rows, data.draw(st.sampled_from(POISONS)),
                   k_column, in_v, params)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv_dtype", [F32, F16])
@pytest.mark.parametrize("G", [4, 5])
def test_rows_hidden_from_some_heads_only(path, kv_dtype, G):
    """A per-head mask hides a row from some heads of a 4-head register block and not from others (G 5: a block
    and a single head), from some queries of a tile and not others: the heads and queries it is hidden from keep
    their bits with NaN or inf in that K and V row. Decode (float32: ``stream_rows``) and 50 query rows."""
    for Nq in (1,) if path == "split_kv" else (1, 50):
        for row, poison in ((5, np.nan), (6, np.nan), (5, np.inf), (6, -np.inf)):
            rng = np.random.default_rng(row)
            Hq, Nkv = 2 * G, 70
            q = rng.standard_normal((1, Hq, Nq, 32)).astype(np.float32)
            k = rng.standard_normal((1, 2, Nkv, 32)).astype(kv_dtype)
            v = rng.standard_normal((1, 2, Nkv, 32)).astype(kv_dtype)
            mask = rng.uniform(-1, 1, (1, Hq, Nq, Nkv))
            mask[:, 0::2, :, 5] = -np.inf  # row 5: hidden from the even heads
            mask[:, 1::2, Nq // 2:, 6] = -np.inf  # row 6: from the odd heads' later queries
            mask[:, 0::2, :, 40:] = -np.inf  # whole KV tiles and blocks hidden from some heads
            for threads in (1, 2) if np.isnan(poison) else (1,):
                check_poisoned(path, threads, q, k.copy(), v.copy(), mask.astype(kv_dtype), [row], poison, 3, True,
                               dict(scale=0.2, max_bias=8.0))


@pytest.mark.parametrize("path", PATHS)
@given(data=st.data(), threads=thread_counts, where=st.sampled_from(("q", "k", "v", "mask", "sinks")))
def test_live_nan_reaches_the_same_outputs_as_in_the_reference(path, data, threads, where):
    """One or two NaNs in q, K, V, the mask or the sinks: NaN in exactly the reference's output positions, every
    other output finite and within the error rule."""
    q, k, v, mask, _, params = data.draw(problems(path, threads))
    if where == "sinks":
        params["sinks"] = np.random.default_rng(data.draw(seeds)).standard_normal(q.array.shape[1]).astype(
            np.float32)
    target = {"q": q.array, "k": k.array, "v": v.array, "mask": mask, "sinks": params.get("sinks")}[where]
    for _ in range(data.draw(st.integers(1, 2))):
        target[tuple(data.draw(st.integers(0, n - 1)) for n in target.shape)] = np.nan
    got = run(path, threads, q.array, k.array, v.array, mask, **params)
    ref = reference.flash_attn_ext(q.array, k.array, v.array, mask, out=np.empty(got.shape), **params)
    naive = naive_f32(q.array, k.array, v.array, mask, **params)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan), f"NaN positions differ from the reference's ({where})"
    assert np.isfinite(got[~nan]).all()
    assert_within_rule(got[~nan], ref[~nan], naive[~nan], floor=FLOOR, what=f"{path} {where}")


# ---------------------------------------------------------------------------------------------------------------
# Scalars: the kernels compute in float32, so scale, logit_softcap and max_bias must be within its range.
BEYOND = float(np.nextafter(FLOAT32_MAX, np.inf))


def _edge_problem(path):
    rng = np.random.default_rng(9)
    Nq = 1 if path == "split_kv" else 50
    q = rng.standard_normal((1, 4, Nq, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 70, 16)).astype(np.float16)
    v = rng.standard_normal((1, 2, 70, 16)).astype(np.float16)
    mask = rng.uniform(-1, 1, (Nq, 70)).astype(np.float16)
    mask[:, 60:] = -np.inf
    return q, k, v, mask


@pytest.mark.parametrize("path", PATHS)
def test_scalars_just_inside_float32_work_without_warnings(path):
    """scale = +-max float32 (q = 0: logits of exactly 0), logit_softcap at both ends of its range, max_bias =
    max float32 (every slope 0: -inf entries still hide their keys): no warning, the reference's result."""
    q, k, v, mask = _edge_problem(path)
    cases = [(np.zeros_like(q), dict(scale=FLOAT32_MAX)), (np.zeros_like(q), dict(scale=-FLOAT32_MAX)),
             (q, dict(scale=0.25, logit_softcap=FLOAT32_MAX)), (q, dict(scale=0.25, logit_softcap=SOFTCAP_MIN)),
             (q, dict(scale=0.25, max_bias=FLOAT32_MAX))]
    for qq, params in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = fastattn.flash_attn_ext(qq, k, v, mask, path=path, **params)
            ref = reference.flash_attn_ext(qq, k, v, mask, out=np.empty(got.shape), **params)
            naive = naive_f32(qq, k, v, mask, **params)
        assert np.isfinite(got).all(), params
        assert_within_rule(got, ref, naive, floor=FLOOR, what=f"{path} {params}")


@pytest.mark.parametrize("name,value", [("scale", BEYOND), ("scale", -BEYOND), ("scale", 1e39),
                                        ("logit_softcap", BEYOND), ("logit_softcap", 1e-46),
                                        ("max_bias", BEYOND), ("max_bias", float("inf"))])
@pytest.mark.parametrize("path", PATHS)
def test_scalars_just_outside_float32_raise(path, name, value):
    q, k, v, mask = _edge_problem(path)
    params = dict(scale=0.25)
    params[name] = value
    for op in (fastattn.flash_attn_ext, reference.flash_attn_ext):
        out = np.full((1, q.shape[2], 4, 16), 7.0, np.float32)
        with pytest.raises(ValueError, match=name):
            op(q, k, v, mask, path=path, out=out, **params)
        assert (out == 7.0).all()


def test_decode_fast_path_refuses_a_scale_beyond_float32():
    """Decode calls without a mask go to a compiled entry point once their dtypes are recorded: it must send a
    scale beyond float32's range to the general path's error, not compute with an infinite scale."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 9, 16)).astype(np.float16)
    fastattn.flash_attn_ext(q, k, k, scale=0.25)
    fastattn.flash_attn_ext(q, k, k, scale=0.25)  # the compiled entry point from now on
    for scale in (BEYOND, -1e39):
        out = np.full((1, 1, 4, 16), 7.0, np.float32)
        with pytest.raises(ValueError, match="scale"):
            fastattn.flash_attn_ext(q, k, k, scale=scale, out=out)
        assert (out == 7.0).all()

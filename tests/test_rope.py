"""RoPE: fast ``rope_ext`` / ``rope_cache`` + ``apply_rope_cache`` / ``rope_set_rows`` against the float64 reference.

Properties over every mode x dtype x layout (contiguous, strided view, in place) x forward/backward, with drawn
n_dims, sections, YaRN parameters, freq_factors, positions and thread counts; guard bands around views; the
precision claim against ggml's float32 recurrence; bad inputs; concurrent calls.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from fastattn.testing import assert_within_rule, max_abs_error, ulp_distance
from strategies import StridedView, has_bf16, positions, rope_configs, strided

import fastattn
import fastattn.reference as ref
import fastattn.reference.rope as ref_rope
from fastattn.rope import drivers as _rope_drivers
from fastattn.rope import rotate as _rope_rotate
from fastattn._core import threads as _threads
from fastattn.rope import api as _rope_api
from fastattn.rope import args as rope_args
from fastattn.rope.cache import CACHE_BLOCK
from fastattn._core.validate import FLOAT16, FLOAT32
from strategies import BFLOAT16


@contextlib.contextmanager
def run_on(threads: int):
    """Run on ``threads`` threads, with the parallel kernels used even for the small test shapes."""
    with fastattn.testing.parallel_min_bytes(0 if threads > 1 else _threads.PARALLEL_MIN_BYTES):
        with fastattn.num_threads(min(threads, _threads.max_threads())):
            yield


# ---------------------------------------------------------------------------------------------------------------
# Comparison: the contract's rule against a straightforward float32 evaluation.
def naive_f32(x: np.ndarray, pos: np.ndarray, kwargs: dict) -> np.ndarray:
    """The same formula in float32 NumPy: theta, cos/sin and the rotation all in float32."""
    params = rope_args.parse_params(**{**REF_DEFAULTS, **kwargs})
    pos2 = rope_args.parse_pos(pos, params)
    streams, exponents = ref_rope.pair_streams_and_exponents(params)
    low, high = ref_rope.yarn_corr_dims(params.n_dims, params.n_ctx_orig, params.freq_base, params.beta_fast,
                                   params.beta_slow)
    f32 = np.float32
    ff = params.freq_factors if params.freq_factors is not None else np.ones(params.n_pairs)
    theta = np.empty((pos2.shape[1], params.n_pairs), f32)
    for p in range(params.n_pairs):
        extrap = pos2[streams[p]].astype(f32) * f32(params.freq_base ** (-2.0 * exponents[p] / params.n_dims))
        extrap = extrap / f32(ff[p])
        mix = f32(ref_rope._yarn_ramp(p, low, high) * params.ext_factor) if params.ext_factor else f32(0)
        theta[:, p] = f32(params.freq_scale) * extrap * (f32(1) - mix) + extrap * mix
    mscale = f32(params.attn_factor * (1 + 0.1 * np.log(1 / params.freq_scale) if params.ext_factor else 1))
    cos = (np.cos(theta) * mscale)[:, None, :]
    sin = (np.sin(theta) * mscale * f32(-1 if params.backward else 1))[:, None, :]
    xf = x.astype(f32)
    n = params.n_pairs
    first, second = (np.arange(0, 2 * n, 2), np.arange(1, 2 * n, 2)) if params.mode == 0 else (
        np.arange(n), np.arange(n, 2 * n))
    out = xf.copy()
    out[..., first] = xf[..., first] * cos - xf[..., second] * sin
    out[..., second] = xf[..., first] * sin + xf[..., second] * cos
    return out


REF_DEFAULTS = dict(freq_base=10000.0, freq_scale=1.0, n_ctx_orig=0, ext_factor=0.0, attn_factor=1.0,
                    beta_fast=32.0, beta_slow=1.0, freq_factors=None, sections=None, backward=False)


def _mscale(kwargs: dict) -> float:
    scale = abs(kwargs.get("attn_factor", 1.0))
    if kwargs.get("ext_factor", 0.0):
        scale *= 1 + 0.1 * np.log(1 / kwargs.get("freq_scale", 1.0))
    return scale


def assert_rope_close(fast: np.ndarray, reference64: np.ndarray, x: np.ndarray, pos, kwargs, what=""):
    """float32: the contract's rule (2x the naive float32 error + a floor of a few float32 ulps of |x|·mscale).
    float16: within 1 ulp of the correctly rounded value, except where the result cancels to below the float32
    computation's own error (there no float32 computation can promise 1 ulp): then within that floor."""
    floor = 4e-7 * (1 + float(np.max(np.abs(x.astype(np.float64)), initial=0))) * max(1.0, _mscale(kwargs))
    if fast.dtype == FLOAT32:
        assert_within_rule(fast, reference64, naive_f32(x, pos, kwargs), floor=floor, what=what)
    else:  # float16, bfloat16 (a rope_set_rows cache)
        rounded = reference64.astype(fast.dtype)
        ulps = ulp_distance(np.ascontiguousarray(fast), np.ascontiguousarray(rounded))
        near = np.abs(fast.astype(np.float64) - reference64) <= floor
        bad = (ulps > 1) & ~near
        assert not bad.any(), f"{what}: {int(bad.sum())} element(s) > 1 ulp, worst {int(ulps.max())} ulp"


# ---------------------------------------------------------------------------------------------------------------
# Properties.
@given(data=st.data(), config=rope_configs(), dtype=st.sampled_from((FLOAT32, FLOAT16)),
       layout=st.sampled_from(("contiguous", "strided", "in place", "strided out")),
       n=st.integers(1, 7), h=st.integers(1, 4), pos_kind=st.sampled_from(("small", "large", "runs")),
       threads=st.sampled_from((1, 2)))
def test_rope_ext_matches_reference(data, config, dtype, layout, n, h, pos_kind, threads):
    kwargs, d, streams = config
    view: StridedView = data.draw(strided((n, h, d), dtype, contiguous_ok=layout == "contiguous"))
    x = view.array
    pos = positions(streams, n, np.random.default_rng(n * 131 + d), pos_kind)
    expected = ref.rope_ext(x, pos, **kwargs, out=np.empty(x.shape))
    x_before = x.copy()
    out_view = None
    with run_on(threads):
        if layout == "in place":
            got = fastattn.rope_ext(x, pos, **kwargs, out=x)
            assert got is x
        elif layout == "strided out":
            out_view = data.draw(strided((n, h, d), dtype, contiguous_ok=False))
            got = fastattn.rope_ext(x, pos, **kwargs, out=out_view.array)
            assert got is out_view.array
        else:
            got = fastattn.rope_ext(x, pos, **kwargs)
    assert got.dtype == dtype and got.shape == x.shape
    assert_rope_close(got, expected, x_before, pos, kwargs, what=f"{kwargs} {layout}")
    if layout == "in place":
        view.assert_outside_unchanged()
    else:
        view.assert_all_unchanged()
    if out_view is not None:
        out_view.assert_outside_unchanged()


@given(config=rope_configs(), dtype=st.sampled_from((FLOAT32, FLOAT16)), n=st.integers(1, 5),
       batch=st.sampled_from(((), (2,), (2, 3))), seed=st.integers(0, 2**16))
def test_prebuilt_cache_equals_rope_ext_for_leading_axes(config, dtype, n, batch, seed):
    kwargs, d, streams = config
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(batch + (n, 3, d)).astype(dtype)
    if len(batch) == 2:
        x = x.transpose(1, 0, 2, 3, 4)  # leading axes that cannot merge: looped, not copied
    pos = positions(streams, n, rng, "large")
    cache = fastattn.rope_cache(pos, **kwargs)
    got = fastattn.apply_rope_cache(x, cache)
    assert np.array_equal(got, fastattn.rope_ext(x, pos, **kwargs))
    expected = ref.apply_rope_cache(x, ref.rope_cache(pos, **kwargs), out=np.empty(x.shape))
    assert_rope_close(got, expected, x, pos, kwargs, what=str(kwargs))


@given(config=rope_configs(), seed=st.integers(0, 2**16), threads=st.sampled_from((1, 2)))
def test_backward_undoes_forward(config, seed, threads):
    kwargs, d, streams = config
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, d)).astype(np.float32)
    pos = positions(streams, 5, rng, "large")
    fwd = {**kwargs, "backward": False}
    with run_on(threads):
        y = fastattn.rope_ext(x, pos, **fwd)
        back = fastattn.rope_ext(y, pos, **{**fwd, "backward": True})
    # rotations are orthogonal; the magnitude scale is applied both ways to the rotated dims (ggml's rope_back
    # keeps it), and the dims past n_dims are copied unchanged both ways
    scale = _mscale(kwargs) ** 2
    rotated = d if kwargs["mode"] == fastattn.ROPE_VISION else kwargs["n_dims"]
    expected = x.copy()
    expected[..., :rotated] *= scale
    np.testing.assert_allclose(back, expected, atol=2e-6 * max(1.0, scale) * float(np.abs(x).max()))


@given(mode=st.sampled_from((fastattn.ROPE_MROPE, fastattn.ROPE_IMROPE)), config=rope_configs(mode=2),
       seed=st.integers(0, 2**16), sections=st.lists(st.integers(0, 20), min_size=4, max_size=4))
def test_equal_streams_make_mrope_and_imrope_equal_neox_exactly(mode, config, seed, sections):
    kwargs, d, _ = config
    if sum(sections[:3]) == 0:
        sections[0] = 1
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 2, d)).astype(np.float32)
    pos = rng.integers(-100000, 100000, 4).astype(np.int32)
    multi = {**kwargs, "mode": mode, "sections": sections}
    for lib in (fastattn, ref):
        neox = lib.rope_ext(x, pos, **kwargs)
        assert np.array_equal(lib.rope_ext(x, np.stack([pos] * 4), **multi), neox)


@given(dst_dtype=st.sampled_from((FLOAT32, FLOAT16) + ((BFLOAT16,) if has_bf16() else ())),
       x_dtype=st.sampled_from((FLOAT32, FLOAT16)), config=rope_configs(),
       flat=st.booleans(), n=st.integers(0, 9), rows=st.integers(1, 12), data=st.data(),
       threads=st.sampled_from((1, 2)))
def test_rope_set_rows_matches_rope_then_set_rows(dst_dtype, x_dtype, config, flat, n, rows, data, threads):
    kwargs, d, streams = config
    h = 2
    view = data.draw(strided((n, h, d), x_dtype))
    x = view.array
    rng = np.random.default_rng(n * 7 + rows)
    pos = positions(streams, n, rng, "large")
    idx = rng.integers(0, rows, n).astype(data.draw(st.sampled_from((np.int32, np.int64))))  # duplicates likely
    cache = rng.standard_normal((rows, h * d) if flat else (rows, h, d)).astype(dst_dtype)
    expected = ref.rope_set_rows(cache.copy(), x, pos, idx, **kwargs)
    with run_on(threads):
        got = fastattn.rope_set_rows(cache, x, pos, idx, **kwargs)
    assert got is cache
    view.assert_all_unchanged()
    untouched = np.setdiff1d(np.arange(rows), idx)
    assert cache[untouched].tobytes() == expected[untouched].tobytes()
    written = np.unique(idx)
    got_rows = cache[written].reshape(len(written), h, d)
    ref64 = ref.rope_ext(x, pos, **kwargs, out=np.empty(x.shape))
    last = {int(r): i for i, r in enumerate(idx)}  # the last duplicate wins
    ref_rows = np.stack([ref64[last[int(r)]] for r in written]) if len(written) else np.empty((0, h, d))
    tokens = [last[int(r)] for r in written]
    assert_rope_close(got_rows, ref_rows, x[tokens], pos[..., tokens], kwargs, what=str(kwargs))


# ---------------------------------------------------------------------------------------------------------------
# Fused QKV views and guard bands.
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16])
@pytest.mark.parametrize("threads", [1, 2])
def test_in_place_on_fused_qkv_leaves_k_v_and_surroundings_alone(dtype, threads):
    n, h, h_kv, d = 6, 4, 2, 16
    rng = np.random.default_rng(3)
    width = (h + 2 * h_kv) * d
    outer = rng.standard_normal((n + 2, width + 8)).astype(dtype)  # the buffer, with a frame of guard bytes
    snapshot = outer.copy()
    qkv = outer[1:-1, 4:-4]
    q = qkv[:, :h * d].reshape(n, h, d)
    k = qkv[:, h * d:(h + h_kv) * d].reshape(n, h_kv, d)
    assert np.shares_memory(q, qkv) and np.shares_memory(k, qkv)  # views, not copies
    pos = rng.integers(0, 5000, n).astype(np.int32)
    expected_q = ref.rope_ext(q, pos, n_dims=d, mode=fastattn.ROPE_NEOX)
    expected_k = ref.rope_ext(k, pos, n_dims=d, mode=fastattn.ROPE_NEOX)
    cache = fastattn.rope_cache(pos, n_dims=d, mode=fastattn.ROPE_NEOX)
    with run_on(threads):
        fastattn.apply_rope_cache(q, cache, out=q)
    changed = outer != snapshot
    changed[1:-1, 4:4 + h * d] = False
    assert not changed.any(), "K, V or the guard frame changed"
    with run_on(threads):
        fastattn.apply_rope_cache(k, cache, out=k)
    for got, want in ((q, expected_q), (k, expected_k)):
        assert max_abs_error(got, want) <= (2e-6 if dtype == FLOAT32 else 4e-3)
    assert np.array_equal(outer[1:-1, 4 + (h + h_kv) * d:-4], snapshot[1:-1, 4 + (h + h_kv) * d:-4])  # V


@pytest.mark.parametrize("threads", [1, 2])
def test_large_in_place_fused_qkv_matches_a_contiguous_copy_bytes(threads):
    """Prefill-sized in place on Q of a fused QKV buffer: the drivers prefetch two tokens ahead row by row
    (``rope.drivers._rows_ahead``); a hint, so the bytes are the contiguous rotation's and K, V stay as they were."""
    n, h, h_kv, d = 300, 8, 2, 64
    qkv = np.random.default_rng(5).standard_normal((n, (h + 2 * h_kv) * d)).astype(np.float32)
    snapshot = qkv.copy()
    q = qkv[:, :h * d].reshape(n, h, d)
    contiguous = q.copy()
    pos = np.arange(n, dtype=np.int32) + 7
    kwargs = dict(n_dims=d, mode=fastattn.ROPE_NEOX, freq_base=500000.0)
    with run_on(threads):
        fastattn.rope_ext(q, pos, **kwargs, out=q)
        fastattn.rope_ext(contiguous, pos, **kwargs, out=contiguous)
    assert np.array_equal(q.view(np.uint32), contiguous.view(np.uint32))
    assert np.array_equal(qkv[:, h * d:], snapshot[:, h * d:])
    assert_rope_close(q, ref.rope_ext(snapshot[:, :h * d].reshape(n, h, d), pos, **kwargs, out=np.empty(q.shape)),
                      snapshot[:, :h * d].reshape(n, h, d), pos, kwargs, what="qkv")


def test_rows_ahead_prefetches_only_tokens_that_lie_apart():
    rows_ahead = _rope_drivers._rows_ahead
    block, unit = _rope_rotate.TOKEN_BLOCK, _rope_rotate.ROWS_UNIT
    qkv = np.zeros((5, 12 * 16), np.float32)
    q = qkv[:, :8 * 16].reshape(5, 8, 16)
    assert rows_ahead(q, 0, block) == 2 * 12 * 16  # the same row, two tokens on
    assert rows_ahead(q, 2, block) == 2 * 12 * 16
    assert rows_ahead(q, 3, block) == 0  # no token n + 2
    assert rows_ahead(q, 0, unit) == 0
    assert rows_ahead(np.zeros((5, 8, 16), np.float32), 0, block) == 0  # adjacent tokens: the hardware's job


def test_partial_rotation_passes_the_rest_through():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 64)).astype(np.float32)
    pos = np.arange(3, dtype=np.int32)
    for mode in (fastattn.ROPE_NORMAL, fastattn.ROPE_NEOX):
        y = fastattn.rope_ext(x, pos, n_dims=16, mode=mode)
        assert np.array_equal(y[..., 16:], x[..., 16:])
        inplace = x.copy()
        fastattn.rope_ext(inplace, pos, n_dims=16, mode=mode, out=inplace)
        assert np.array_equal(inplace, y)


def test_float64_out_gets_the_unrounded_reference():
    x = np.random.default_rng(0).standard_normal((2, 2, 8)).astype(np.float16)
    pos = np.array([3, 70000], np.int32)
    out = np.empty(x.shape)
    ref.rope_ext(x, pos, n_dims=8, mode=2, out=out)
    assert out.dtype == np.float64 and not np.array_equal(out, out.astype(np.float16))
    with pytest.raises(TypeError, match="out"):
        fastattn.rope_ext(x, pos, n_dims=8, mode=2, out=out)  # the fast path writes x's dtype only


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face mappings the docs state, and ggml's section rules.
def test_neox_is_llama_rotate_half_and_normal_is_interleaved():
    rng = np.random.default_rng(1)
    n, h, d, base = 5, 2, 16, 10000.0
    x = rng.standard_normal((n, h, d))
    pos = np.arange(n) * 37
    inv_freq = 1.0 / base ** (np.arange(0, d, 2) / d)
    freqs = pos[:, None] * inv_freq  # (n, d/2)
    emb = np.concatenate([freqs, freqs], -1)[:, None, :]
    rotate_half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    llama = x * np.cos(emb) + rotate_half * np.sin(emb)
    out = np.empty(x.shape)
    ref.rope_ext(x.astype(np.float32), pos.astype(np.int32), n_dims=d, mode=fastattn.ROPE_NEOX, freq_base=base,
                 out=out)
    np.testing.assert_allclose(out, llama.astype(np.float32), atol=1e-5)
    # interleaved (GPT-J): pairs (2i, 2i+1)
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = np.cos(freqs)[:, None, :], np.sin(freqs)[:, None, :]
    gptj = np.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)
    ref.rope_ext(x.astype(np.float32), pos.astype(np.int32), n_dims=d, mode=fastattn.ROPE_NORMAL,
                 freq_base=base, out=out)
    np.testing.assert_allclose(out, gptj.astype(np.float32), atol=1e-5)


def test_imrope_with_stream_e_equal_t_is_hugging_face_qwen3_vl():
    # Hugging Face's Qwen3-VL rule (sections summing to d/2): t everywhere, h at 1::3 up to 3·s_h, w at 2::3 up
    # to 3·s_w
    d, sections = 64, [12, 10, 10]
    pairs = d // 2
    pos = np.array([[7, 9], [3, 4], [11, 2]], np.int32)  # t, h, w for 2 tokens
    hf_stream = np.zeros(pairs, int)
    hf_stream[1:3 * sections[1]:3] = 1
    hf_stream[2:3 * sections[2]:3] = 2
    params = rope_args.parse_params(**{**REF_DEFAULTS, "n_dims": d, "mode": fastattn.ROPE_IMROPE,
                                       "sections": sections + [0]})
    streams, _ = ref_rope.pair_streams_and_exponents(params)
    streams = np.array(streams)
    streams[streams == 3] = 0  # pass e = t
    assert np.array_equal(streams, hf_stream)
    x = np.random.default_rng(2).standard_normal((2, 1, d)).astype(np.float32)
    four = np.concatenate([pos, pos[:1]])
    got = fastattn.rope_ext(x, four, n_dims=d, mode=fastattn.ROPE_IMROPE, sections=sections + [0])
    want = ref.rope_ext(x, four, n_dims=d, mode=fastattn.ROPE_IMROPE, sections=sections + [0], out=np.empty(x.shape))
    assert max_abs_error(got, want) < 1e-6


def test_vision_restarts_the_exponent_in_each_section():
    d, base = 16, 10000.0
    n_dims = d // 2  # 8 pairs: 4 on stream t, 4 on stream h
    x = np.random.default_rng(4).standard_normal((1, 1, d))
    pos = np.array([[5], [9], [0], [0]], np.int32)
    out = np.empty(x.shape)
    ref.rope_ext(x.astype(np.float32), pos, n_dims=n_dims, mode=fastattn.ROPE_VISION, sections=[4, 4, 0, 0],
                 out=out)
    k = np.arange(4)
    theta = np.concatenate([5 * base ** (-2 * k / n_dims), 9 * base ** (-2 * k / n_dims)])
    a, b = x[..., :n_dims], x[..., n_dims:]
    expected = np.concatenate([a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)], -1)
    np.testing.assert_allclose(out, expected.astype(np.float32), atol=1e-6)


def test_degenerate_yarn_context_gives_no_nan():
    x = np.ones((3, 1, 32), np.float32)
    pos = np.array([-5, 0, 100000], np.int32)
    kwargs = dict(n_dims=32, mode=fastattn.ROPE_NEOX, ext_factor=1.0, freq_scale=0.25, n_ctx_orig=0)
    assert ref_rope.yarn_corr_dims(32, 0, 10000.0, 32.0, 1.0) == (0.0, -np.inf)
    for lib in (fastattn, ref):
        assert np.isfinite(lib.rope_ext(x, pos, **kwargs)).all()
    np.testing.assert_allclose(fastattn.rope_ext(x, pos, **kwargs), ref.rope_ext(x, pos, **kwargs), atol=2e-6)


# ---------------------------------------------------------------------------------------------------------------
# Precision: float64 angles beat ggml's float32 recurrence.
def ggml_style_f32(x: np.ndarray, pos: np.ndarray, n_dims: int, base: float) -> np.ndarray:
    """NEOX the way ggml's CPU backend computes it: theta = (float)pos, then theta *= powf(base, -2/n_dims)."""
    f32 = np.float32
    theta_scale = f32(base) ** f32(-2.0 / n_dims)
    theta = pos.astype(f32)
    cos, sin = [], []
    for _ in range(n_dims // 2):
        cos.append(np.cos(theta))
        sin.append(np.sin(theta))
        theta = (theta * theta_scale).astype(f32)
    c = np.stack(cos, -1)[:, None, :]
    s = np.stack(sin, -1)[:, None, :]
    a, b = x[..., :n_dims // 2], x[..., n_dims // 2:n_dims]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def test_float64_angles_are_more_accurate_than_ggmls_float32_recurrence():
    rng = np.random.default_rng(5)
    d, base = 128, 10000.0
    x = rng.uniform(-1, 1, (256, 4, d)).astype(np.float32)
    for lo, hi in ((0, 5000), (100_000, 1_000_000)):
        pos = rng.integers(lo, hi, 256).astype(np.int32)
        exact = ref.rope_ext(x, pos, n_dims=d, mode=fastattn.ROPE_NEOX, freq_base=base, out=np.empty(x.shape))
        ours = max_abs_error(fastattn.rope_ext(x, pos, n_dims=d, mode=fastattn.ROPE_NEOX, freq_base=base), exact)
        ggml = max_abs_error(ggml_style_f32(x, pos, d, base), exact)
        assert ours < 1e-6, ours  # a few float32 roundings of |x| <= 1, whatever the position
        assert ggml > 20 * ours, (lo, hi, ggml, ours)
        if lo == 0:
            assert ggml > 1e-5  # ggml itself is ~5e-4 off below position 5000


@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_cache_recurrence_matches_direct_angles(streams, threads):
    """A long prompt (positions + 1 per token, across several cache blocks, one stream jumping once) gives the
    cos/sin of computing every token on its own, to 1 float32 ulp, serial and parallel builds bit-identical."""
    n = 3 * CACHE_BLOCK * 3 + 5  # past the parallel build's threshold on 2 threads
    pos = np.tile(np.arange(n, dtype=np.int32) + 123_456, (streams, 1))
    if streams == 4:
        pos[2, 200:] += 7  # the w stream jumps: that token is computed directly, the next ones step again
    mode = fastattn.ROPE_NEOX if streams == 1 else fastattn.ROPE_MROPE
    kwargs = dict(n_dims=128, mode=mode, freq_base=500000.0, sections=[16, 24, 24, 0] if streams == 4 else None)
    with run_on(threads):
        stepped = fastattn.rope_cache(pos[0] if streams == 1 else pos, **kwargs).cs
    direct = np.concatenate([fastattn.rope_cache(pos[:, i:i + 1] if streams == 4 else pos[0, i:i + 1], **kwargs).cs
                             for i in range(n)])
    assert np.all(np.abs(stepped - direct) <= np.spacing(np.abs(direct)))
    assert np.mean(stepped == direct) > 0.99
    with run_on(1):
        serial = fastattn.rope_cache(pos[0] if streams == 1 else pos, **kwargs).cs
    assert np.array_equal(serial, stepped)


def test_huge_angles_use_the_exact_fallback():
    x = np.ones((2, 1, 4), np.float32)
    pos = np.array([2**31 - 1, -(2**31)], np.int32)
    ff = np.array([1e-3, 1.0])  # theta up to ~2e12: past the polynomial's reduction range
    got = fastattn.rope_ext(x, pos, n_dims=4, mode=fastattn.ROPE_NEOX, freq_factors=ff)
    want = ref.rope_ext(x, pos, n_dims=4, mode=fastattn.ROPE_NEOX, freq_factors=ff, out=np.empty(x.shape))
    assert max_abs_error(got, want) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Threads.
def test_concurrent_calls_from_python_threads_give_the_right_results():
    rng = np.random.default_rng(6)
    jobs = []
    for i in range(6):
        x = rng.standard_normal((64 + i, 8, 64)).astype(np.float32 if i % 2 else np.float16)
        pos = rng.integers(-1000, 100000, x.shape[0]).astype(np.int32)
        jobs.append((x, pos, dict(n_dims=64 - 16 * (i % 3), mode=(fastattn.ROPE_NEOX, fastattn.ROPE_NORMAL)[i % 2],
                                  freq_base=10000.0 * (i + 1))))
    expected = [fastattn.rope_ext(x, pos, **kw) for x, pos, kw in jobs]
    results: dict[int, list] = {}

    def work(i):
        x, pos, kw = jobs[i]
        results[i] = [fastattn.rope_ext(x, pos, **kw) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(expected):
        assert all(np.array_equal(got, want) for got in results[i])
        ref64 = ref.rope_ext(jobs[i][0], jobs[i][1], **jobs[i][2], out=np.empty(jobs[i][0].shape))
        assert max_abs_error(want, ref64) < (2e-5 if want.dtype == FLOAT32 else 0.05)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_and_two_threads_agree_on_a_prefill_sized_call(threads):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, 32, 64)).astype(np.float32)  # 2 MiB each way: above the parallel threshold
    pos = np.arange(256, dtype=np.int32) + 1000
    with fastattn.num_threads(threads):
        got = fastattn.rope_ext(x, pos, n_dims=64, mode=fastattn.ROPE_NEOX)
    with fastattn.num_threads(1):
        serial = fastattn.rope_ext(x, pos, n_dims=64, mode=fastattn.ROPE_NEOX)
    assert np.array_equal(got, serial)


@pytest.mark.parametrize("mode", [fastattn.ROPE_NEOX, fastattn.ROPE_NORMAL])
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16])
def test_whole_row_lane_of_the_parallel_drivers_gives_the_serial_bytes(mode, dtype):
    """One batch, out of place, whole rows: the parallel drivers (rope_ext's fused pass, apply_rope_cache's,
    rope_set_rows' at increasing and at duplicate rows) hand each token straight to the vector code
    (``rope.drivers._rotate_whole``); the bytes are the serial path's."""
    if _threads.max_threads() < 2:
        pytest.skip("needs 2 threads")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2 * CACHE_BLOCK + 24, 32, 64)).astype(dtype)
    pos = np.arange(x.shape[0], dtype=np.int32) - 40
    kwargs = dict(n_dims=64, mode=mode, freq_base=50000.0)
    cache = fastattn.rope_cache(pos, **kwargs)
    with fastattn.num_threads(1):
        serial = fastattn.apply_rope_cache(x, cache)
    n = x.shape[0]
    increasing = np.arange(n) * 2 + 1
    duplicates = np.arange(n) // 3
    with fastattn.num_threads(1):
        serial_rows = [fastattn.apply_rope_cache_set_rows(np.zeros((2 * n + 1, 32 * 64), dtype), x, cache, idx)
                       for idx in (increasing, duplicates)]
    with fastattn.num_threads(2):
        assert _threads.threads_for(2 * x.nbytes) == 2
        assert fastattn.rope_ext(x, pos, **kwargs).tobytes() == serial.tobytes()
        assert fastattn.apply_rope_cache(x, cache).tobytes() == serial.tobytes()
        for idx, expected in zip((increasing, duplicates), serial_rows):
            dst = np.zeros_like(expected)
            assert fastattn.rope_set_rows(dst, x, pos, idx, **kwargs).tobytes() == expected.tobytes()


# ---------------------------------------------------------------------------------------------------------------
# Bad input: clear errors naming the argument, nothing written.
def _bad_calls():
    x = np.ones((3, 2, 8), np.float32)
    pos = np.arange(3, dtype=np.int32)
    pos4 = np.zeros((4, 3), np.int32)
    return [
        (dict(x=x, pos=pos, n_dims=5, mode=2), ValueError, "n_dims must be even"),
        (dict(x=x, pos=pos, n_dims=10, mode=2), ValueError, "n_dims must be <="),
        (dict(x=x, pos=pos4, n_dims=8, mode=24, sections=[2, 2, 0, 0]), ValueError, "ROPE_VISION"),
        (dict(x=x, pos=pos4, n_dims=8, mode=8), ValueError, "sections"),
        (dict(x=x, pos=pos4, n_dims=8, mode=40, sections=[1, 2]), ValueError, "sections"),
        (dict(x=x, pos=pos4, n_dims=8, mode=8, sections=[0, 0, 0, 4]), ValueError, "sections"),
        (dict(x=x, pos=pos, n_dims=8, mode=2, sections=[1, 1, 1, 1]), ValueError, "sections only"),
        (dict(x=x, pos=pos, n_dims=8, mode=8, sections=[2, 1, 1, 0]), ValueError, r"pos must have shape \(4, N\)"),
        (dict(x=x, pos=pos[:2], n_dims=8, mode=2), ValueError, "pos must have one position per token"),
        (dict(x=x, pos=pos.astype(np.float32), n_dims=8, mode=2), TypeError, "pos must have an integer dtype"),
        (dict(x=x, pos=[0, 1, 2], n_dims=8, mode=2), TypeError, "pos must be a numpy.ndarray"),
        (dict(x=x, pos=pos.astype(np.int64) + 2**40, n_dims=8, mode=2), ValueError, "int32"),
        (dict(x=x, pos=pos, n_dims=8, mode=3), ValueError, "mode must be one of"),
        (dict(x=x.astype(np.float64), pos=pos, n_dims=8, mode=2), TypeError, "x must have dtype"),
        (dict(x=x[0], pos=pos, n_dims=8, mode=2), ValueError, "x must have at least 3 axes"),
        (dict(x=x, pos=pos, n_dims=8, mode=2, freq_factors=np.ones(3)), ValueError, "freq_factors"),
        (dict(x=x, pos=pos, n_dims=8, mode=2, freq_factors=np.zeros(4)), ValueError, "freq_factors"),
        (dict(x=x, pos=pos, n_dims=8, mode=2, freq_scale=0.0), ValueError, "freq_scale"),
        (dict(x=x, pos=pos, n_dims=8, mode=2, beta_fast=0.0), ValueError, "beta_fast"),
        (dict(x=x, pos=pos, n_dims=8, mode=2, n_ctx_orig=-1), ValueError, "n_ctx_orig"),
        (dict(x=x, pos=pos, n_dims=8, mode=2, out=np.ones((3, 2, 4), np.float32)), ValueError, "out must have shape"),
    ]


@pytest.mark.parametrize("lib", [fastattn, ref], ids=["fast", "reference"])
@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_raises_naming_the_argument_and_writes_nothing(lib, case):
    kwargs, error, message = _bad_calls()[case]
    x = kwargs.pop("x")
    snapshot = x.copy()
    with pytest.raises(error, match=message):
        lib.rope_ext(x, kwargs.pop("pos"), out=kwargs.pop("out", x), **kwargs)
    assert np.array_equal(x, snapshot)


@pytest.mark.parametrize("lib", [fastattn, ref], ids=["fast", "reference"])
def test_rope_set_rows_rejects_bad_indices_before_writing(lib):
    x = np.ones((3, 2, 8), np.float32)
    pos = np.arange(3, dtype=np.int32)
    cache = np.zeros((4, 16), np.float16)
    for idx, message in ((np.array([0, 4, 1]), r"idx values must be in \[0, 4\)"),
                         (np.array([0, -1, 1]), r"idx values must be in \[0, 4\)"),
                         (np.array([0, 1]), "idx must have one row index per token"),
                         (np.array([0.0, 1.0, 2.0]), "idx must have dtype")):
        with pytest.raises((ValueError, TypeError), match=message):
            lib.rope_set_rows(cache, x, pos, idx, n_dims=8, mode=2)
        with pytest.raises((ValueError, TypeError), match=message):
            lib.apply_rope_cache_set_rows(cache, x, lib.rope_cache(pos, n_dims=8, mode=2), idx)
        assert not cache.any()
    with pytest.raises(ValueError, match="dst must have shape"):
        lib.rope_set_rows(np.zeros((4, 15), np.float16), x, pos, np.arange(3), n_dims=8, mode=2)
    with pytest.raises(ValueError, match="pos must have one position"):
        lib.rope_set_rows(cache, x, pos[:2], np.arange(3), n_dims=8, mode=2)
    assert not cache.any()


def test_remembered_parameters_still_tell_types_and_values_apart():
    """parse_params remembers argument sets; an equal value of a rejected type, or a list changed since, is not
    mistaken for one seen before."""
    x = np.ones((2, 1, 8), np.float32)
    pos = np.zeros((4, 2), np.int32)
    kwargs = dict(n_dims=8, mode=fastattn.ROPE_MROPE, sections=[1, 1, 1, 1])
    fastattn.rope_ext(x, pos, **kwargs)
    for bad, error in (({"mode": float(fastattn.ROPE_MROPE)}, TypeError), ({"n_dims": 8.0}, TypeError),
                       ({"sections": [1.0, 1, 1, 1]}, TypeError), ({"sections": [0, 0, 0, 4]}, ValueError)):
        with pytest.raises(error):
            fastattn.rope_ext(x, pos, **{**kwargs, **bad})
    sections = [1, 1, 1, 1]
    first = rope_args.parse_params(**{**REF_DEFAULTS, **kwargs, "sections": sections})
    sections[0] = 2
    assert rope_args.parse_params(**{**REF_DEFAULTS, **kwargs, "sections": sections}).sections == (2, 1, 1, 1)
    assert first.sections == (1, 1, 1, 1)


def test_partial_alias_and_bad_cache_are_rejected():
    buf = np.ones((3, 2, 16), np.float32)
    with pytest.raises(ValueError, match="out overlaps x"):
        fastattn.rope_ext(buf[..., :8], np.arange(3, dtype=np.int32), n_dims=8, mode=2, out=buf[..., 8:])
    with pytest.raises(TypeError, match="cache must be a RopeCache"):
        fastattn.apply_rope_cache(buf, ref.rope_cache(np.arange(3, dtype=np.int32), n_dims=8, mode=2))
    cache = fastattn.rope_cache(np.arange(2, dtype=np.int32), n_dims=8, mode=2)
    with pytest.raises(ValueError, match="one token per cached position"):
        fastattn.apply_rope_cache(buf, cache)
    with pytest.raises(ValueError, match="n_dims must be <="):
        fastattn.apply_rope_cache(buf[:2, :, :4], cache)


@given(config=rope_configs(), dst_dtype=st.sampled_from((FLOAT32, FLOAT16)), n=st.integers(0, 6),
       seed=st.integers(0, 2**16), threads=st.sampled_from((1, 2)))
def test_prebuilt_cache_set_rows_equals_rope_set_rows(config, dst_dtype, n, seed, threads):
    kwargs, d, streams = config
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 2, d)).astype(np.float32)
    pos = positions(streams, n, rng, "large")
    idx = rng.integers(0, 8, n)
    original = rng.standard_normal((8, 2 * d)).astype(dst_dtype)
    a, b = original.copy(), original.copy()
    with run_on(threads):
        fastattn.rope_set_rows(a, x, pos, idx, **kwargs)
        fastattn.apply_rope_cache_set_rows(b, x, fastattn.rope_cache(pos, **kwargs), idx)
    assert a.tobytes() == b.tobytes()
    by_cache = ref.apply_rope_cache_set_rows(original.copy(), x, ref.rope_cache(pos, **kwargs), idx)
    assert np.array_equal(by_cache, ref.rope_set_rows(original.copy(), x, pos, idx, **kwargs))


@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_set_rows_makes_the_prebuilt_caches_values(streams, threads):
    """On threads rope_set_rows makes cos/sin block by block inside its pass: the bytes written are those of the
    prebuilt-cache path, across several blocks of consecutive positions, a jump and duplicate slots."""
    rng = np.random.default_rng(9)
    n = 2 * CACHE_BLOCK + 9
    pos = np.tile(np.arange(n, dtype=np.int32) + 1000, (streams, 1))
    pos[:, 100:] += 17
    x = rng.standard_normal((n, 4, 64)).astype(np.float32)
    idx = rng.permutation(n + 20)[:n]
    idx[50] = idx[7]  # a duplicate: the later token wins
    kwargs = dict(n_dims=64, mode=fastattn.ROPE_NEOX if streams == 1 else fastattn.ROPE_MROPE,
                  sections=None if streams == 1 else [8, 12, 12, 0])
    positions_arg = pos[0] if streams == 1 else pos
    fused, prebuilt = (np.zeros((n + 20, 4, 64), np.float16) for _ in range(2))
    with run_on(threads):
        fastattn.rope_set_rows(fused, x, positions_arg, idx, **kwargs)
        fastattn.apply_rope_cache_set_rows(prebuilt, x, fastattn.rope_cache(positions_arg, **kwargs), idx)
    assert fused.tobytes() == prebuilt.tobytes()
    expected = ref.rope_set_rows(np.zeros((n + 20, 4, 64), np.float16), x, positions_arg, idx, **kwargs)
    assert np.max(ulp_distance(fused, expected)) <= 1


@pytest.mark.parametrize("streams,dtype,in_place", [(1, FLOAT32, False), (4, FLOAT16, True)])
def test_parallel_rope_ext_makes_the_prebuilt_caches_values(streams, dtype, in_place):
    """On threads rope_ext makes cos/sin block by block inside its pass: the bytes are those of
    apply_rope_cache with a prebuilt cache, over several blocks, a jump in the positions and two batch rows."""
    rng = np.random.default_rng(10)
    n = 3 * CACHE_BLOCK + 5
    pos = np.tile(np.arange(n, dtype=np.int32) + 1000, (streams, 1))
    pos[:, 100:] += 17
    x = rng.standard_normal((2, n, 16, 64)).astype(dtype)  # 2 x 1.6 MiB float32: the parallel path at 2 threads
    kwargs = dict(n_dims=64, mode=fastattn.ROPE_NEOX if streams == 1 else fastattn.ROPE_MROPE,
                  sections=None if streams == 1 else [8, 12, 12, 0])
    positions_arg = pos[0] if streams == 1 else pos
    if _threads.max_threads() < 2:
        pytest.skip("needs 2 threads")
    with fastattn.num_threads(2):
        assert _threads.threads_for(2 * x.nbytes) == 2
        if in_place:
            fused = x.copy()
            fastattn.rope_ext(fused, positions_arg, **kwargs, out=fused)
        else:
            fused = fastattn.rope_ext(x, positions_arg, **kwargs)
        prebuilt = fastattn.apply_rope_cache(x, fastattn.rope_cache(positions_arg, **kwargs))
    assert fused.tobytes() == prebuilt.tobytes()


@pytest.mark.parametrize("idx_kind", ["increasing", "duplicates"])
def test_parallel_rope_set_rows_last_duplicate_wins(idx_kind):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((40, 2, 16)).astype(np.float32)
    pos = np.arange(40, dtype=np.int32)
    idx = np.arange(40) + 3 if idx_kind == "increasing" else rng.integers(0, 10, 40)
    cache = np.zeros((50, 32), np.float16)
    with run_on(2):
        fastattn.rope_set_rows(cache, x, pos, idx, n_dims=16, mode=fastattn.ROPE_NEOX)
    expected = ref.rope_set_rows(np.zeros((50, 32), np.float16), x, pos, idx, n_dims=16, mode=fastattn.ROPE_NEOX)
    assert np.max(ulp_distance(cache, expected)) <= 1


# ---------------------------------------------------------------------------------------------------------------
# The three row layouts (_rope_rotate.token_layout) run different loops over the same arithmetic: same bytes.
def _layout_views(rng, shape, dtype):
    """The same values as a contiguous array, unit-stride rows with gaps between heads, and strided rows."""
    n, h, d = shape
    values = rng.standard_normal(shape).astype(dtype)
    gapped = np.zeros((n, h, d + 8), dtype)[:, :, 3:3 + d]
    stepped = np.zeros((n, h, 2 * d), dtype)[:, :, ::2]
    gapped[...] = values
    stepped[...] = values
    return {_rope_rotate.TOKEN_BLOCK: values, _rope_rotate.ROWS_UNIT: gapped, _rope_rotate.ROWS_STRIDED: stepped}


@pytest.mark.parametrize("mode,dtype,threads", [(fastattn.ROPE_NEOX, FLOAT32, 2), (fastattn.ROPE_NORMAL, FLOAT16, 1)])
def test_every_row_layout_gives_the_same_bytes(mode, dtype, threads):
    """(Two cases only: each compiles about twenty kernels.)"""
    shape = (160, 16, 72) if threads == 2 else (9, 3, 72)  # 2 x 1.4 MiB float32: the parallel drivers at 2
    pos = np.arange(shape[0], dtype=np.int32) * 3 - 5
    kwargs = dict(n_dims=48, mode=mode, freq_base=10000.0)  # partial rotation: the tail is copied or left
    views = _layout_views(np.random.default_rng(11), shape, dtype)
    outs = _layout_views(np.random.default_rng(12), shape, dtype)
    in_places = _layout_views(np.random.default_rng(11), shape, dtype)  # the same values as views
    results = {}
    with fastattn.num_threads(threads):
        for layout, x in views.items():
            out = outs[layout]
            assert _rope_rotate.token_layout(x, out) == layout
            fastattn.rope_ext(x, pos, **kwargs, out=out)
            in_place = in_places[layout]
            fastattn.rope_ext(in_place, pos, **kwargs, out=in_place)
            results[layout] = (np.array(out), np.array(in_place))
            cache = np.zeros((shape[0] + 4, shape[1], shape[2]), np.float16)
            fastattn.rope_set_rows(cache, x, pos, np.arange(shape[0]) + 2, **kwargs)
            results[layout] += (cache.copy(),)
    want = results[_rope_rotate.TOKEN_BLOCK]
    x = views[_rope_rotate.TOKEN_BLOCK]
    assert_rope_close(want[0], ref.rope_ext(x, pos, **kwargs, out=np.empty(shape)), x, pos, kwargs, what="block")
    for layout, got in results.items():
        for a, b in zip(want, got):
            assert a.tobytes() == b.tobytes(), layout


@pytest.mark.parametrize("lib", [fastattn, ref])
def test_attn_factor_beyond_float32_raises_and_writes_nothing(lib):
    """cos and sin are stored times the magnitude scale in float32: a scale beyond its range is refused."""
    x = np.ones((3, 2, 8), np.float32)
    out = np.zeros_like(x)
    pos = np.arange(3, dtype=np.int32)
    f32_max = float(np.finfo(np.float32).max)
    for kwargs in ({"attn_factor": 2 * f32_max}, {"attn_factor": -2 * f32_max},
                   {"attn_factor": f32_max, "ext_factor": 1.0, "freq_scale": 0.5}):
        with pytest.raises(ValueError, match="attn_factor"):
            lib.rope_ext(x, pos, n_dims=8, mode=fastattn.ROPE_NEOX, out=out, **kwargs)
        assert not out.any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib.rope_ext(x[:1], pos[:1] * 0, n_dims=8, mode=fastattn.ROPE_NEOX, attn_factor=1e38, out=out[:1])


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("table_dtype", [FLOAT32, FLOAT16])
def test_cache_from_explicit_tables_rotates_as_given(interleaved, table_dtype):
    """``rope_cache_from_tables`` (FlashAttention's rotary_cos / rotary_sin rows): pairs (2p, 2p+1) interleaved, else
    (p, p + n_pairs); dims past 2·n_pairs untouched; the same rows written by ``apply_rope_cache_set_rows``."""
    rng = np.random.default_rng(3)
    angles = rng.uniform(0, 7, (5, 6))
    cos, sin = np.cos(angles).astype(table_dtype), np.sin(angles).astype(table_dtype)
    cache = _rope_api.rope_cache_from_tables(cos, sin, interleaved=interleaved)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)
    got = fastattn.apply_rope_cache(x, cache)
    c, s = cos.astype(np.float64)[:, None], sin.astype(np.float64)[:, None]
    first = np.arange(0, 12, 2) if interleaved else np.arange(6)
    second = first + 1 if interleaved else first + 6
    expected = x.astype(np.float64).copy()
    expected[..., first] = x[..., first] * c - x[..., second] * s
    expected[..., second] = x[..., first] * s + x[..., second] * c
    assert np.abs(got - expected).max() < 1e-6 and np.array_equal(got[..., 12:], x[..., 12:])
    dst = np.zeros((9, 3, 16), np.float32)
    fastattn.apply_rope_cache_set_rows(dst, x, cache, np.array([8, 0, 3, 2, 5]))
    assert np.array_equal(dst[[8, 0, 3, 2, 5]], got)
    with pytest.raises(ValueError, match="cos and sin"):
        _rope_api.rope_cache_from_tables(cos, sin[:, :4], interleaved=True)
    with pytest.raises(TypeError, match="cos"):
        _rope_api.rope_cache_from_tables(cos.astype(np.float64), sin, interleaved=True)

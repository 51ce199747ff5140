"""flash_attn_ext with quantized K/V (Q8_0, Q4_0, mixed with float types) on every path, against the reference.

The reference dequantizes and computes in float64; the rule is the contract's (2x the error of the naive float32
evaluation on the same dequantized values, plus the floor). Caches are token-major byte buffers with guard
bytes around every row and between rows (bytes whose blocks read as NaN), reached through a transposed view, as a
llama.cpp cache is; keys hidden by the mask for every head and query row hold NaN blocks too, so a kernel that
reads what it must not gives NaN.

Every K/V type pair, mask dtype, mask head layout and thread count compiles each path again (seconds each), so
the draws are kept to what exercises distinct code: three type pairs, float16 masks (an all-zero one standing in
for no mask, which ``test_every_path_reads_the_same_values`` covers), a mask with a row per head for the Q4_0
pair and one shared by the heads for the others, and 2 threads for the Q8_0 pair.
"""
from __future__ import annotations

import numpy as np
import pytest
from attention_cases import FLOOR, naive_f32
from hypothesis import given
from hypothesis import strategies as st
from strategies import attention_masks, seeds, strided

import fastattn
from fastattn import reference
from fastattn._core import threads as _threads
from fastattn.quant.blocks import BLOCK_BYTES
from fastattn.attention.api import choose_path
from fastattn.testing import assert_within_rule, parallel_min_bytes

#: (K type, V type, mask with a row per head): both quantized of one type, and a quantized K with a float16 V.
PAIRS = [("q8_0", "q8_0", False), ("q4_0", "q4_0", True), ("q8_0", "float16", False)]
PATHS = ["one_chunk", "tiled", "split_kv", "auto"]
GUARD = 0xFF  # 0xFFFF as a block's float16 scale is NaN: a guard byte read as data shows up


class Cache:
    """A token-major (Bk, Nkv + 2, Hkv, row bytes + 6) buffer of guard bytes holding K or V, and the
    (Bk, Hkv, Nkv, D) view attention reads (a ``Quantized`` or a float array)."""

    def __init__(self, rng, shape, kind: str, hidden: np.ndarray, magnitudes):
        Bk, Hkv, Nkv, D = shape
        values = (rng.standard_normal(shape) * rng.choice(magnitudes, size=(1, Hkv, 1, 1))).astype(np.float32)
        if kind in BLOCK_BYTES:
            stored = fastattn.quantize(values, kind).data
            self.values = reference.dequantize(fastattn.Quantized(stored, kind))
            width = stored.shape[-1]
            self.buffer = np.full((Bk, Nkv + 2, Hkv, width + 6), GUARD, np.uint8)
            rows = self.buffer[:, 1:Nkv + 1, :, 3:3 + width]
            rows[...] = stored.transpose(0, 2, 1, 3)
            rows[:, hidden] = GUARD  # keys no head sees: NaN blocks
            self.view = fastattn.Quantized(rows.transpose(0, 2, 1, 3), kind)
        else:
            self.values = values.astype(kind).astype(np.float32)
            self.buffer = np.full((Bk, Nkv + 2, Hkv, D + 3), np.nan, kind)
            rows = self.buffer[:, 1:Nkv + 1, :, 1:1 + D]
            rows[...] = values.astype(kind).transpose(0, 2, 1, 3)
            rows[:, hidden] = np.nan
            self.view = rows.transpose(0, 2, 1, 3)
        self.before = self.buffer.copy()

    def assert_unchanged(self):
        assert self.buffer.tobytes() == self.before.tobytes(), "attention wrote into its K/V cache"


@st.composite
def problems(draw, path):
    k_kind, v_kind, per_head = draw(st.sampled_from(PAIRS))
    B = draw(st.sampled_from((1, 2)))
    Bk = draw(st.sampled_from(sorted({1, B})))
    Hkv = draw(st.sampled_from((1, 2)))
    Hq = Hkv * draw(st.sampled_from((3, 4, 8) if per_head and Hkv == 1 else (1, 3, 4, 8)))
    Nq = 1 if path == "split_kv" else draw(st.sampled_from((1, 5, 48, 70)))
    Nkv = draw(st.sampled_from((1, 31, 33, 64, 100, 700)))
    DK = draw(st.sampled_from((32, 64, 128)))
    DV = draw(st.sampled_from((DK, 32)))
    rng = np.random.default_rng(draw(seeds))
    mask = draw(attention_masks(B, Hq, Nq, Nkv, np.float16, per_head))
    if draw(st.integers(0, 4)) == 0:  # all zero, standing in for no mask
        mask = np.zeros_like(mask)
    # keys hidden from every head and query row: their cache rows are poisoned
    hidden = (mask[..., :Nq, :] == -np.inf).reshape(-1, Nkv).all(axis=0)
    # logits of moderate size (huge ones make any float32 evaluation's error a coin toss, see test_attention)
    k = Cache(rng, (Bk, Hkv, Nkv, DK), k_kind, hidden, (0.01, 1.0, 2.0))
    v = Cache(rng, (Bk, Hkv, Nkv, DV), v_kind, hidden, (0.01, 1.0, 30.0))
    q = draw(strided((B, Hq, Nq, DK), np.float32))
    params = dict(scale=float(draw(st.sampled_from((DK ** -0.5, 2.0 * DK ** -0.5)))),
                  max_bias=draw(st.sampled_from((0.0, 0.0, 8.0))),
                  logit_softcap=draw(st.sampled_from((0.0, 0.0, 30.0))))
    if draw(st.booleans()):
        params["sinks"] = (rng.standard_normal(Hq) * 3).astype(np.float32)
    threads = draw(st.sampled_from((1, 2))) if k_kind == v_kind == "q8_0" else 1
    return q, k, v, mask, params, threads


def run_and_check(path, q, k, v, mask, params, threads, what=""):
    with parallel_min_bytes(0 if threads > 1 else _threads.PARALLEL_MIN_BYTES):
        with fastattn.num_threads(threads):
            fast = fastattn.flash_attn_ext(q.array, k.view, v.view, mask, path=path, **params)
    expected = reference.flash_attn_ext(q.array, k.view, v.view, mask, out=np.empty(fast.shape), **params)
    naive = naive_f32(q.array, k.values, v.values, mask, **params)
    assert np.isfinite(fast).all(), f"{path} {what}: non-finite output (a hidden or guard byte was read)"
    # the floor is for values of order 1: a V scaled by 30 scales every error by 30
    floor = FLOOR * max(1.0, float(np.abs(v.values).max()))
    assert_within_rule(fast, expected, naive, floor=floor, what=f"{path} {what}")
    q.assert_all_unchanged()
    k.assert_unchanged()
    v.assert_unchanged()
    return fast


@pytest.mark.parametrize("path", PATHS)
@given(data=st.data())
def test_quantized_kv_matches_reference(path, data):
    q, k, v, mask, params, threads = data.draw(problems(path))
    run_and_check(path, q, k, v, mask, params, threads, what=f"K {k.view!r} V {v.view!r}")


def test_every_path_reads_the_same_values():
    """Without a mask: the same Q8_0 cache gives the same attention on every path, and the float32 cache of its
    dequantized values gives the same as the quantized one on each path: the kernels read the dequantized values."""
    kind = "q8_0"
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    k = fastattn.quantize(rng.standard_normal((1, 2, 600, 64)).astype(np.float32), kind)
    v = fastattn.quantize(rng.standard_normal((1, 2, 600, 64)).astype(np.float32), kind)
    kf, vf = fastattn.dequantize(k), fastattn.dequantize(v)
    expected = reference.flash_attn_ext(q, k, v, scale=0.125)
    for path in ("one_chunk", "split_kv", "tiled"):
        got = fastattn.flash_attn_ext(q, k, v, scale=0.125, path=path)
        assert np.abs(got - expected).max() < 1e-5, path
        # float32 K/V decode streams rows in another order (stream_rows): compare within rounding, not bits
        assert np.abs(got - fastattn.flash_attn_ext(q, kf, vf, scale=0.125, path=path)).max() < 1e-5, path


def test_auto_splits_quantized_decode():
    """``auto`` takes split_kv for a long quantized decode with few KV heads (ggml reads quantized caches only on
    one_chunk) and keeps one_chunk for mixed types."""
    assert choose_path(1, 1, 1, 4096, "q8_0", "q8_0", 2) == "split_kv"
    assert choose_path(1, 1, 1, 4096, "q4_0", "q4_0", 2) == "split_kv"
    assert choose_path(1, 1, 1, 4096, "q8_0", np.dtype(np.float16), 2) == "one_chunk"
    assert choose_path(1, 1, 8, 4096, "q8_0", "q8_0", 2) == "one_chunk"
    assert choose_path(1, 512, 1, 4096, "q8_0", "q8_0", 2) == "tiled"


def test_quantized_kv_rejects_bad_input():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    k = fastattn.quantize(rng.standard_normal((1, 1, 8, 64)).astype(np.float32), "q8_0")
    memory = np.zeros(1024, np.uint8)  # V's bytes and, over them, a float32 out
    v = fastattn.Quantized(memory[:8 * 36].reshape(1, 1, 8, 36), "q4_0")
    v.data[...] = fastattn.quantize(rng.standard_normal((1, 1, 8, 64)).astype(np.float32), "q4_0").data
    out = np.full((1, 1, 2, 64), 7.0, np.float32)
    with pytest.raises(ValueError, match="4 axes"):
        fastattn.flash_attn_ext(q, fastattn.Quantized(k.data[0], "q8_0"), v, scale=1.0, out=out)
    with pytest.raises(ValueError, match="head size DK"):
        fastattn.flash_attn_ext(q[..., :32].copy(), k, v, scale=1.0)
    with pytest.raises(ValueError, match="v must match k"):
        fastattn.flash_attn_ext(q, k, fastattn.Quantized(v.data[:, :, :4], "q4_0"), scale=1.0, out=out)
    with pytest.raises(TypeError, match="k must be a numpy.ndarray .* or a fastattn.Quantized"):
        fastattn.flash_attn_ext(q, k.data.tolist(), v, scale=1.0, out=out)
    with pytest.raises(ValueError, match="out must not overlap v"):
        fastattn.flash_attn_ext(q, k, v, scale=1.0, out=memory[:512].view(np.float32).reshape(1, 1, 2, 64))
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="multiple of 32"):  # D not a multiple of 32: no Quantized at all
        fastattn.quantize(rng.standard_normal((1, 1, 8, 40)).astype(np.float32), "q8_0")

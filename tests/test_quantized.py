"""Q8_0 / Q4_0: ``quantize`` and ``dequantize`` (fast and reference) against ggml's reference quantizer as the
``gguf`` package implements it, byte for byte, and ``set_rows`` into a ``Quantized`` cache."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import seeds  # also loads the project's hypothesis profile (ci / fuzz)

import fastattn
from fastattn import reference
from fastattn.testing import parallel_min_bytes

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

QTYPES = ["q8_0", "q4_0"]
GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
WIDTH = {"q8_0": 34, "q4_0": 18}


def _special_blocks(rng, n_blocks: int) -> np.ndarray:
    """Blocks that probe the rounding: zeros, exact .5 ties after scaling, negative extremes, a value alone,
    tiny and huge magnitudes, repeated maxima of both signs."""
    blocks = rng.standard_normal((n_blocks, 32)).astype(np.float32)
    kinds = [
        np.zeros(32, np.float32),
        (np.arange(32) - 15.5).astype(np.float32) * np.float32(127 / 15.5) / 127 * 15.5,  # .5 ties
        np.float32(0.5) * np.arange(32, dtype=np.float32),
        np.where(np.arange(32) == 7, -127.0, 1.0).astype(np.float32),
        np.where(np.arange(32) == 3, 8.0, -8.0).astype(np.float32),  # |max| tie, first one positive
        np.where(np.arange(32) == 0, 1e-30, 0.0).astype(np.float32),
        np.full(32, 3e37, np.float32) * np.sign(np.arange(32) - 16.0).astype(np.float32),
        np.float32(1e-8) * np.arange(32, dtype=np.float32),
    ]
    for i, block in enumerate(kinds[:n_blocks]):
        blocks[i] = block
    return blocks


def ggml_bytes(x: np.ndarray, qtype: str) -> np.ndarray:
    """ggml's reference bytes: the gguf package's, but for a Q4_0 block of zeros, whose scale ggml computes from
    m = +0 (d = -0.0, bytes 00 80) where gguf takes the sign of the block's first zero."""
    with np.errstate(over="ignore", invalid="ignore"):  # gguf's NumPy warns on inf/NaN blocks, as ggml computes
        expected = gguf_quants.quantize(x.astype(np.float32), GGML[qtype])
    if qtype == "q4_0":
        zero = (x.astype(np.float32).reshape(-1, 32) == 0).all(axis=1)
        blocks = expected.reshape(-1, WIDTH[qtype])
        blocks[zero, 0] = 0x00
        blocks[zero, 1] = 0x80
    return expected


def gguf_dequantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """The gguf package's values of ggml bytes (an inf scale times a code of 0 is NaN: gguf's NumPy warns)."""
    with np.errstate(invalid="ignore"):
        return gguf_quants.dequantize(data, GGML[qtype])


@st.composite
def values(draw):
    rows = draw(st.integers(1, 6))
    n_blocks = draw(st.integers(1, 5))
    seed = draw(seeds)
    rng = np.random.default_rng(seed)
    scale = np.float32(10.0 ** draw(st.integers(-12, 12)))
    x = (rng.standard_normal((rows, n_blocks * 32)) * scale).astype(np.float32)
    if draw(st.booleans()):
        x.reshape(-1, 32)[:] = _special_blocks(rng, rows * n_blocks)[: rows * n_blocks]
    if draw(st.booleans()):
        with np.errstate(over="ignore"):  # values past float16's range become inf: more special blocks
            x = x.astype(np.float16)
    return x


@pytest.mark.parametrize("qtype", QTYPES)
@given(x=values())
def test_bytes_match_ggml_reference_quantizer(qtype, x):
    expected = ggml_bytes(x, qtype)
    fast = fastattn.quantize(x, qtype)
    ref = reference.quantize(x, qtype)
    assert fast.data.dtype == np.uint8 and fast.shape == x.shape
    assert np.array_equal(ref.data, expected)
    assert np.array_equal(fast.data, expected)
    decoded = gguf_dequantize(expected, qtype)
    # a scale past float16's range is stored as inf, and inf · 0 is NaN in ggml too
    assert np.array_equal(reference.dequantize(ref), decoded, equal_nan=True)
    assert np.array_equal(fastattn.dequantize(fast), decoded, equal_nan=True)


def test_q8_0_rounds_every_half_and_its_neighbours_away_from_zero():
    """Blocks whose largest magnitude is 127 (so d = 1 and 1/d = 1: a value's byte is roundf of the value itself):
    every k + 0.5 in [-127.5, 126.5] and the floats either side of it, and of +-0.5, as ggml rounds them."""
    halves = np.arange(-127, 127, dtype=np.float32) + np.float32(0.5)
    values = np.concatenate([halves, np.nextafter(halves, np.float32(-np.inf)),
                             np.nextafter(halves, np.float32(np.inf)), np.float32([0.0, -0.0])])
    values = values[np.abs(values) <= 127]
    blocks = np.zeros((8 * -(-values.size // (8 * 31)), 32), np.float32)
    blocks[:, 0] = 127.0
    rest = np.zeros(blocks.shape[0] * 31, np.float32)
    rest[:values.size] = values
    blocks[:, 1:] = rest.reshape(-1, 31)
    assert np.isin(values, blocks).all() and np.array_equal(
        reference.quantize(np.float32([[127.0, 0.5, -0.5, 1.5, 2.5] + [0.0] * 27]), "q8_0").data[0, 3:7],
        np.int8([1, -1, 2, 3]).view(np.uint8))  # the premise: the halves are there, and roundf takes them away
    for x in (blocks.reshape(-1, 8 * 32), blocks):  # rows of 8 blocks (four at a time), and of one
        assert np.array_equal(fastattn.quantize(x, "q8_0").data, ggml_bytes(x, "q8_0"))


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_special_block_and_threads(qtype):
    rng = np.random.default_rng(0)
    x = _special_blocks(rng, 64).reshape(8, 256)
    x[0, 32:64] = np.where(np.arange(32) % 3, 0.0, -0.0)  # zeros of both signs, the first one negative
    expected = ggml_bytes(x, qtype)
    for threads in (1, 2):
        with fastattn.num_threads(threads), parallel_min_bytes(0):
            assert np.array_equal(fastattn.quantize(x, qtype).data, expected)
            assert np.array_equal(fastattn.dequantize(fastattn.Quantized(expected, qtype)),
                                  gguf_dequantize(expected, qtype), equal_nan=True)


@pytest.mark.parametrize("qtype", QTYPES)
def test_views_in_and_strided_quantized_caches(qtype):
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((64, 4, 96)).astype(np.float32)  # token-major (R, H, D)
    head_major = cache.transpose(1, 0, 2)  # (H, R, D) view
    q = fastattn.quantize(head_major, qtype)
    assert np.array_equal(q.data, ggml_bytes(np.ascontiguousarray(head_major), qtype))
    bytes_cache = fastattn.quantize(cache, qtype).data
    view = fastattn.Quantized(bytes_cache.transpose(1, 0, 2)[:, 5:40], qtype)  # strided leading axes
    assert view.shape == (4, 35, 96)
    assert np.array_equal(fastattn.dequantize(view), reference.dequantize(view))
    assert np.array_equal(fastattn.dequantize(view), fastattn.dequantize(fastattn.Quantized(
        np.ascontiguousarray(view.data), qtype)))


@pytest.mark.parametrize("ops", [fastattn, reference], ids=["fast", "reference"])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 32), (3, 0), (0,)])
def test_empty_arrays_quantize_to_empty_caches(ops, qtype, shape):
    """NumPy gives some empty arrays stride 0 on every axis: an empty cache has no bytes out of place."""
    q = ops.quantize(np.ones(shape, np.float32), qtype)
    assert q.shape == shape and q.data.size == 0
    values = ops.dequantize(q)
    assert values.shape == shape and values.dtype == np.float32
    assert fastattn.Quantized(np.empty((0, 2 * (34 if qtype == "q8_0" else 18)), np.uint8), qtype).shape == (0, 64)


@pytest.mark.parametrize("ops", [fastattn, reference], ids=["fast", "reference"])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("src_dtype", [np.float32, np.float16])
def test_set_rows_quantizes_into_the_rows_and_nothing_else(ops, qtype, src_dtype):
    rng = np.random.default_rng(2)
    parent = rng.integers(0, 256, (3, 40, 4 * WIDTH[qtype] + 7), dtype=np.uint8)  # guard bytes around the cache
    cache = ops.Quantized(parent[1, 4:36, 3:3 + 4 * WIDTH[qtype]], qtype)  # (32 rows, 128 values)
    before = parent.copy()
    src = rng.standard_normal((6, 128)).astype(src_dtype)
    idx = np.array([3, 30, 7, 3, 0, 31])  # 3 twice: the last wins
    for threads in (1, 2):
        with fastattn.num_threads(threads), parallel_min_bytes(0):
            parent[:] = before
            assert ops.set_rows(cache, src, idx) is cache
        expected = before.copy()
        rows = expected[1, 4:36, 3:3 + 4 * WIDTH[qtype]]
        for i, r in enumerate(idx):
            rows[r] = ggml_bytes(src[i:i + 1], qtype)[0]
        assert np.array_equal(parent, expected)


@pytest.mark.parametrize("qtype", QTYPES)
def test_set_rows_with_leading_axes_matches_the_reference(qtype):
    rng = np.random.default_rng(3)
    fast = fastattn.quantize(rng.standard_normal((2, 4, 16, 64)).astype(np.float32), qtype)
    ref = reference.Quantized(fast.data.copy(), qtype)
    src = rng.standard_normal((2, 4, 5, 64)).astype(np.float16)
    idx = rng.integers(0, 16, (4, 5))
    with parallel_min_bytes(0), fastattn.num_threads(2):
        fastattn.set_rows(fast, src, idx)
    reference.set_rows(ref, src, idx)
    assert np.array_equal(fast.data, ref.data)


@pytest.mark.parametrize("ops", [fastattn, reference], ids=["fast", "reference"])
def test_bad_input_raises_and_writes_nothing(ops):
    data = np.zeros((8, 68), np.uint8)
    cache = ops.Quantized(data, "q8_0")
    src = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="idx must be in"):
        ops.set_rows(cache, src, np.array([1, 8]))
    with pytest.raises(ValueError, match="src must have shape"):
        ops.set_rows(cache, np.ones((2, 32), np.float32), np.array([1, 2]))
    shared = np.zeros((8, 128), np.float32)  # a cache whose bytes are the rows of src
    with pytest.raises(ValueError, match="overlaps"):
        ops.set_rows(ops.Quantized(shared.view(np.uint8)[:, :136], "q8_0"), shared[:2], np.array([1, 2]))
    assert not data.any() and not shared.any()
    with pytest.raises(ValueError, match="qtype must be one of"):
        ops.Quantized(data, "q5_k")
    with pytest.raises(ValueError, match="whole number of q4_0 blocks"):
        ops.Quantized(data, "q4_0")
    with pytest.raises(TypeError, match="dtype uint8"):
        ops.Quantized(data.view(np.int8), "q8_0")
    with pytest.raises(ValueError, match="contiguous"):
        ops.Quantized(np.zeros((8, 136), np.uint8)[:, ::2], "q8_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.quantize(np.ones((2, 48), np.float32), "q8_0")
    with pytest.raises(TypeError, match="float32 or float16"):
        ops.quantize(np.ones((2, 64), np.float64), "q8_0")
    with pytest.raises(ValueError, match="qtype must be one of"):
        ops.quantize(np.ones((2, 64), np.float32), "q8_1")
    with pytest.raises(TypeError, match="fastattn.Quantized"):
        ops.dequantize(data)


# ---------------------------------------------------------------------------------------------------------------
# rope_set_rows into a quantized cache: the bytes of rope_ext followed by set_rows.
@given(qtype=st.sampled_from(QTYPES), x_dtype=st.sampled_from((np.float32, np.float16)),
       mode=st.sampled_from((fastattn.ROPE_NORMAL, fastattn.ROPE_NEOX)), d=st.sampled_from((32, 64, 128)),
       partial=st.booleans(), flat=st.booleans(), prebuilt=st.booleans(), n=st.integers(0, 150),
       rows=st.integers(1, 50), threads=st.sampled_from((1, 2)), seed=seeds)
def test_rope_set_rows_into_quantized_is_rope_then_set_rows(qtype, x_dtype, mode, d, partial, flat, prebuilt, n,
                                                            rows, threads, seed):
    rng = np.random.default_rng(seed)
    h = 2
    x = (rng.standard_normal((n, h, d + 8)) * 3).astype(x_dtype)[:, :, 4:4 + d]  # a strided view
    pos = rng.integers(0, 100_000, n).astype(np.int32)
    idx = rng.integers(0, rows, n).astype(np.int64)  # duplicates likely: the last one wins
    kwargs = dict(n_dims=d // 2 if partial else d, mode=mode, freq_base=500000.0)
    shape = (rows, h * d) if flat else (rows, h, d)
    start = fastattn.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    fused = fastattn.Quantized(start.data.copy(), qtype)
    with parallel_min_bytes(0 if threads == 2 else 1 << 40), fastattn.num_threads(threads):
        if prebuilt:
            assert fastattn.apply_rope_cache_set_rows(fused, x, fastattn.rope_cache(pos, **kwargs), idx) is fused
        else:
            assert fastattn.rope_set_rows(fused, x, pos, idx, **kwargs) is fused
    unfused = fastattn.Quantized(start.data.reshape(rows, -1).copy(), qtype)
    if n:
        # float32 rotated values (float16 x widens exactly; rope_ext would round its output to float16)
        fastattn.set_rows(unfused, fastattn.rope_ext(x.astype(np.float32), pos, **kwargs).reshape(n, h * d), idx)
    assert fused.data.tobytes() == unfused.data.tobytes()
    # the reference quantizes its float64 rotation rounded to float32: at most a last-bit difference in the
    # rotated values, so a block may round one of its values (or its scale) to the neighbouring step
    expected = reference.rope_set_rows(fastattn.Quantized(start.data.copy(), qtype), x, pos, idx, **kwargs)
    got_values = fastattn.dequantize(fused).reshape(rows, h, d // 32, 32)
    ref_values = reference.dequantize(expected).reshape(rows, h, d // 32, 32)
    step = np.maximum(np.abs(got_values).max(axis=-1, keepdims=True), 1e-30) / (127 if qtype == "q8_0" else 7)
    assert (np.abs(got_values - ref_values) <= 1.01 * step).all()


@pytest.mark.parametrize("ops", [fastattn, reference], ids=["fast", "reference"])
def test_rope_set_rows_into_quantized_rejects_bad_input(ops):
    rng = np.random.default_rng(0)
    cache = fastattn.quantize(np.zeros((8, 2, 64), np.float32), "q8_0")
    before = cache.data.copy()
    x = rng.standard_normal((3, 2, 64)).astype(np.float32)
    pos = np.arange(3, dtype=np.int32)
    kwargs = dict(n_dims=64, mode=fastattn.ROPE_NEOX)
    with pytest.raises(ValueError, match=r"idx values must be in \[0, 8\)"):
        ops.rope_set_rows(cache, x, pos, np.array([0, 8, 1]), **kwargs)
    with pytest.raises(ValueError, match="dst must have shape"):
        ops.rope_set_rows(cache, x[:, :1], pos, np.arange(3), **kwargs)
    flat = fastattn.quantize(np.zeros((8, 64), np.float32), "q4_0")  # (R, H·D) with D = 16: blocks span heads
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.rope_set_rows(flat, rng.standard_normal((3, 4, 16)).astype(np.float32), pos, np.arange(3),
                          n_dims=16, mode=fastattn.ROPE_NEOX)
    readonly = fastattn.Quantized(cache.data.copy(), "q8_0")
    readonly.data.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        ops.rope_set_rows(readonly, x, pos, np.arange(3), **kwargs)
    assert cache.data.tobytes() == before.tobytes()

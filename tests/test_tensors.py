"""CPU torch tensors in the core API, fast and reference: read and written in place through NumPy, results as
ndarrays identical to the ndarray call; tensors that cannot be read that way are refused by name. Also the
messages that teach flash_attn_ext's layout."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastattn  # noqa: E402
from fastattn import reference  # noqa: E402

OPS = [fastattn, reference]


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
def test_attention_takes_tensors_views_and_half_caches(ops):
    qkv = _rand(1, 3, 3 * 64)  # a fused projection of 3 tokens: q's columns as a (B, H, N, D) view
    q = qkv[..., :64].unflatten(-1, (4, 16)).transpose(1, 2)
    k = _rand(1, 2, 9, 16, seed=1).half()
    v = _rand(1, 2, 9, 16, seed=2).half()
    mask = torch.zeros(3, 9)
    mask[:, -1] = -torch.inf
    sinks = _rand(4, seed=3)
    got = ops.flash_attn_ext(q, k, v, mask, scale=0.125, sinks=sinks)
    expected = ops.flash_attn_ext(q.numpy(), k.numpy(), v.numpy(), mask.numpy(), scale=0.125,
                                  sinks=sinks.numpy())
    assert isinstance(got, np.ndarray)
    assert np.array_equal(got, expected)
    out = torch.full((1, 3, 4, 16), 5.0)
    result = ops.flash_attn_ext(q, k, v, mask, scale=0.125, sinks=sinks, out=out)
    assert np.shares_memory(result, out.numpy()) and np.array_equal(out.numpy(), expected)


def test_bfloat16_tensors_are_read_as_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q = _rand(1, 2, 1, 32)
    k = _rand(1, 1, 5, 32, seed=1).bfloat16()
    got = fastattn.flash_attn_ext(q, k, k, scale=0.2)
    kb = k.view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # the tensor's bytes as a NumPy bfloat16 array
    assert np.array_equal(got, fastattn.flash_attn_ext(q.numpy(), kb, kb, scale=0.2))
    # the values bfloat16 widens to exactly (float32 rows take other vector widths: equal within rounding)
    widened = fastattn.flash_attn_ext(q.numpy(), k.float().numpy(), k.float().numpy(), scale=0.2)
    np.testing.assert_allclose(got, widened, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
def test_rope_norm_and_rows_write_tensors_in_place(ops):
    x = _rand(4, 2, 16)
    pos = torch.arange(4, dtype=torch.int32)
    expected = ops.rope_ext(x.numpy().copy(), pos.numpy(), n_dims=16, mode=fastattn.ROPE_NEOX)
    ops.rope_ext(x, pos, n_dims=16, mode=fastattn.ROPE_NEOX, out=x)
    assert np.array_equal(x.numpy(), expected)

    h = _rand(3, 32, seed=1)
    w = _rand(32, seed=2)
    normed = torch.empty(3, 32)
    ops.rms_norm_mul(h, w, 1e-5, out=normed)
    assert np.array_equal(normed.numpy(), ops.rms_norm_mul(h.numpy(), w.numpy(), 1e-5))

    cache = torch.zeros(8, 32, dtype=torch.float16)  # (R, H·D)
    idx = torch.tensor([5, 1])
    ops.set_rows(cache, x[:2].reshape(2, 32), idx)
    assert torch.equal(cache[[5, 1]], x[:2].reshape(2, 32).half()) and not cache[[0, 2, 3, 4, 6, 7]].any()

    k_cache = torch.zeros(8, 2, 16, dtype=torch.float16)
    ops.rope_set_rows(k_cache, x[:2], pos[:2], idx, n_dims=16, mode=fastattn.ROPE_NEOX)
    expected_rows = ops.rope_ext(x[:2].numpy(), pos[:2].numpy(), n_dims=16, mode=fastattn.ROPE_NEOX)
    assert np.array_equal(k_cache[[5, 1]].numpy(), expected_rows.astype(np.float16))


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
@pytest.mark.parametrize("case", ["grad", "device", "sparse"])
def test_refused_tensors_name_the_argument_and_write_nothing(ops, case):
    q = _rand(1, 2, 1, 16)
    k = _rand(1, 1, 4, 16, seed=1)
    bad = {"grad": lambda: k.clone().requires_grad_(),
           "device": lambda: k.to("meta"),
           "sparse": lambda: k.to_sparse()}[case]()
    out = torch.full((1, 1, 2, 16), 7.0)
    error = TypeError if case == "sparse" else ValueError
    with pytest.raises(error, match={"grad": "^k is a torch tensor that requires grad",
                                     "device": "^k is a torch tensor on meta", "sparse": "^k is a"}[case]):
        ops.flash_attn_ext(q, bad, k, scale=1.0, out=out)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
def test_boolean_masks_are_refused_with_the_conversion(ops):
    q = np.zeros((1, 2, 3, 16), np.float32)
    k = np.zeros((1, 1, 4, 16), np.float32)
    with pytest.raises(TypeError, match=r"np.where\(mask, 0, -np.inf\)"):
        ops.flash_attn_ext(q, k, k, np.ones((3, 4), bool), scale=1.0)


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
def test_token_major_inputs_get_the_transpose_in_the_message(ops):
    q = np.zeros((1, 5, 8, 16), np.float32)  # (B, N, H, D): 5 tokens of 8 heads
    k = np.zeros((1, 9, 2, 16), np.float32)  # 9 tokens of 2 heads
    with pytest.raises(ValueError, match=r"look token-major.*q.transpose\(0, 2, 1, 3\)"):
        ops.flash_attn_ext(q, k, k, scale=1.0)
    assert ops.flash_attn_ext(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                              scale=1.0).shape == (1, 5, 8, 16)
    q6 = np.zeros((1, 6, 8, 16), np.float32)  # 6 tokens, 3 keys: the heads divide either way, the mask does not
    k3 = np.zeros((1, 3, 2, 16), np.float32)
    with pytest.raises(ValueError, match="columns.*look token-major"):
        ops.flash_attn_ext(q6, k3, k3, np.zeros((6, 3), np.float32), scale=1.0)


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
def test_torch_output_layout_gets_the_transpose_in_the_message(ops):
    q = np.zeros((1, 4, 3, 16), np.float32)
    k = np.zeros((1, 2, 5, 16), np.float32)
    torch_layout = np.zeros((1, 4, 3, 16), np.float32)
    with pytest.raises(ValueError, match=r"torch's \(B, H, N, D\) output layout; pass out.transpose"):
        ops.flash_attn_ext(q, k, k, scale=1.0, out=torch_layout)
    ops.flash_attn_ext(q, k, k, scale=1.0, out=torch_layout.transpose(0, 2, 1, 3))


def test_tensors_in_tensors_out_answers_a_torch_first_argument_with_tensors():
    """FlashAttention's functions: a torch q gets torch results sharing the ndarray's memory (bfloat16 too); an
    ndarray q gets ndarrays; other arguments are read as ``accept_tensors`` reads them."""
    pytest.importorskip("ml_dtypes")
    from fastattn._core.tensors import as_array, tensors_in_tensors_out

    seen = {}

    def op(q, scale=1.0, extra=None):
        seen["types"] = (type(q), type(extra))
        seen["result"] = result = (q.astype(np.float32) * scale).astype(q.dtype)
        return result, np.float32(2.0), None

    wrapped = tensors_in_tensors_out(op)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q = _rand(3, 4).to(dtype)
        out, scalar, nothing = wrapped(q, 2.0, extra=torch.zeros(2))
        assert seen["types"] == (np.ndarray, np.ndarray)
        assert isinstance(out, torch.Tensor) and out.dtype == dtype and torch.equal(out, (q.float() * 2).to(dtype))
        assert isinstance(scalar, np.float32) and nothing is None
        assert np.shares_memory(as_array("out", out), seen["result"])  # no copy
        out2, _, _ = wrapped(q=q)  # q by keyword
        assert isinstance(out2, torch.Tensor)
    plain, _, _ = wrapped(np.ones(3, np.float32), extra=torch.zeros(2))
    assert isinstance(plain, np.ndarray)

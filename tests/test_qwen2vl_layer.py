"""examples/llama_layer.py as a Qwen2-VL text layer (M-RoPE, q/k/v biases) against Hugging Face's Qwen2VLTextModel.

A tiny random config (no download), one layer, and 3-stream position ids laid out as Qwen2-VL's get_rope_index
does for "text, a 2x2x2 video grid, text": the t, h and w streams differ inside the grid. Hugging Face's
``mrope_section`` [2, 3, 3] is ggml's ROPE_MROPE with ``sections=(2, 3, 3, 0)`` and positions (4, N) = t, h, w, e
(stream e unused). The whole sequence is prefilled in one call, or prefilled in part and then decoded one token at
a time through the float32 KV cache; every position's layer output must match Hugging Face's within float32
tolerance.
"""
import numpy as np
import pytest
from example_layer import load_example, to_numpy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastattn  # noqa: E402

MROPE_SECTION = [2, 3, 3]  # pairs per stream t, h, w: sums to head_dim / 2


def _positions():
    """(3, N) t, h, w for 3 text tokens, a video grid of t=2, h=2, w=2, then 3 text tokens (get_rope_index)."""
    text = np.arange(3)
    gt, gh, gw = np.meshgrid(np.arange(2), np.arange(2), np.arange(2), indexing="ij")
    grid = np.stack([gt.ravel(), gh.ravel(), gw.ravel()]) + 3  # every stream starts after the text
    after = np.arange(3) + grid.max() + 1
    pos = np.concatenate([np.stack([text] * 3), grid, np.stack([after] * 3)], axis=1)
    assert len({tuple(row) for row in pos}) == 3  # the three streams really differ
    return pos.astype(np.int32)


@pytest.mark.parametrize("n_prefill", [14, 9], ids=["prefill_all", "prefill_then_decode"])
def test_qwen2vl_layer_matches_hugging_face(n_prefill):
    ex = load_example()
    hidden, heads, kv_heads, head_dim, ffn, theta, eps = 64, 4, 2, 16, 96, 10000.0, 1e-6
    cfg = transformers.Qwen2VLTextConfig(
        vocab_size=50, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=kv_heads, rms_norm_eps=eps, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "mrope_section": MROPE_SECTION})
    torch.manual_seed(0)
    model = transformers.Qwen2VLTextModel(cfg).eval()
    layer = model.layers[0]
    attn = layer.self_attn
    assert attn.head_dim == head_dim and model.rotary_emb.mrope_section == MROPE_SECTION
    with torch.no_grad():  # random norm weights and biases, so the fused multiply and the bias add are exercised
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.bias.uniform_(-0.5, 0.5)
    captured = {}
    layer.register_forward_hook(lambda mod, inp, out: captured.update(y=out[0] if isinstance(out, tuple) else out))
    pos3 = _positions()
    n = pos3.shape[1]
    ids = torch.randint(0, cfg.vocab_size, (1, n))
    with torch.no_grad():
        model(ids, position_ids=torch.from_numpy(pos3).long()[:, None, :])  # (3, batch, N)
        embeddings = to_numpy(model.embed_tokens(ids)[0])
    expected = to_numpy(captured["y"][0])

    weights = ex.LayerWeights(
        attn_norm=to_numpy(layer.input_layernorm.weight),
        wqkv=np.concatenate([to_numpy(attn.q_proj.weight).T, to_numpy(attn.k_proj.weight).T, to_numpy(attn.v_proj.weight).T], 1),
        wo=to_numpy(attn.o_proj.weight).T, ffn_norm=to_numpy(layer.post_attention_layernorm.weight),
        w_gate=to_numpy(layer.mlp.gate_proj.weight).T, w_up=to_numpy(layer.mlp.up_proj.weight).T,
        w_down=to_numpy(layer.mlp.down_proj.weight).T,
        bqkv=np.concatenate([to_numpy(attn.q_proj.bias), to_numpy(attn.k_proj.bias), to_numpy(attn.v_proj.bias)]))
    config = ex.LlamaConfig(hidden=hidden, n_head=heads, n_head_kv=kv_heads, head_dim=head_dim, ffn=ffn, eps=eps,
                            rope_base=theta, max_ctx=16, rope_mode=fastattn.ROPE_MROPE,
                            rope_sections=(*MROPE_SECTION, 0))
    pos4 = np.concatenate([pos3, np.zeros((1, n), np.int32)])  # ggml's streams t, h, w, e; e is unused
    rows = np.arange(n, dtype=np.int32)  # KV-cache rows in token order (positions are not row indices here)
    ours = ex.LlamaLayer(weights, config, kv_dtype=np.float32)
    got = [ours.forward(embeddings[:n_prefill], np.ascontiguousarray(pos4[:, :n_prefill]), rows[:n_prefill])]
    for i in range(n_prefill, n):
        got.append(ours.forward(embeddings[i:i + 1], np.ascontiguousarray(pos4[:, i:i + 1]), rows[i:i + 1]))
    got = np.concatenate(got)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * scale)


def test_qwen2vl_layer_needs_its_three_streams():
    """The comparison is sensitive to the M-RoPE split: plain NEOX on the t stream does not match."""
    pos3 = _positions()
    d = 16
    x = np.random.default_rng(0).standard_normal((pos3.shape[1], 1, d)).astype(np.float32)
    pos4 = np.concatenate([pos3, np.zeros((1, pos3.shape[1]), np.int32)])
    mrope = fastattn.rope_ext(x, pos4, n_dims=d, mode=fastattn.ROPE_MROPE, sections=(*MROPE_SECTION, 0))
    neox = fastattn.rope_ext(x, pos3[0].copy(), n_dims=d, mode=fastattn.ROPE_NEOX)
    assert np.abs(mrope - neox).max() > 1e-2

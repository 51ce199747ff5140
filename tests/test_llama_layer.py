"""examples/llama_layer.py against Hugging Face's LlamaModel (tiny random config, no download), and on a quantized
KV cache against itself on a float32 one.

Prefill 8 tokens, then decode 4 one at a time through the KV cache; every position's layer output must match
the Hugging Face layer run on the whole sequence within float32 tolerance.
"""
import numpy as np
import pytest
from example_layer import load_example, to_numpy



def test_llama_layer_matches_hugging_face_prefill_and_decode():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ex = load_example()
    hidden, heads, kv_heads, head_dim, ffn, theta = 64, 4, 2, 16, 96, 10000.0
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=1,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                   rms_norm_eps=1e-5, rope_theta=theta, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg).eval()
    layer = model.layers[0]
    with torch.no_grad():  # random norm weights, so the fused multiply is exercised
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    captured = {}
    layer.register_forward_hook(lambda mod, inp, out: captured.update(y=out[0] if isinstance(out, tuple) else out))
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        model(ids)
        embeddings = to_numpy(model.embed_tokens(ids)[0])
    expected = to_numpy(captured["y"][0])

    attn = layer.self_attn
    weights = ex.LayerWeights(
        attn_norm=to_numpy(layer.input_layernorm.weight),
        wqkv=np.concatenate([to_numpy(attn.q_proj.weight).T, to_numpy(attn.k_proj.weight).T, to_numpy(attn.v_proj.weight).T], 1),
        wo=to_numpy(attn.o_proj.weight).T, ffn_norm=to_numpy(layer.post_attention_layernorm.weight),
        w_gate=to_numpy(layer.mlp.gate_proj.weight).T, w_up=to_numpy(layer.mlp.up_proj.weight).T,
        w_down=to_numpy(layer.mlp.down_proj.weight).T)
    config = ex.LlamaConfig(hidden=hidden, n_head=heads, n_head_kv=kv_heads, head_dim=head_dim, ffn=ffn,
                            eps=1e-5, rope_base=theta, max_ctx=16)
    ours = ex.LlamaLayer(weights, config, kv_dtype=np.float32)
    got = [ours.forward(embeddings[:8], np.arange(8, dtype=np.int32))]
    for p in range(8, 12):
        got.append(ours.forward(embeddings[p:p + 1], np.array([p], np.int32)))
    got = np.concatenate(got)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * scale)


def test_llama_layer_with_a_quantized_cache_stays_near_the_float32_one():
    """--kv q8_0: the same layer on a Q8_0 KV cache (rope_set_rows and set_rows quantize, attention reads the
    blocks) stays within the cache's rounding of the float32-cache layer (Q8_0 rounds each value to 1/254 of its
    block's largest magnitude), and differs from it."""
    kv, bound = "q8_0", 0.02
    ex = load_example()
    config = ex.LlamaConfig(hidden=128, n_head=4, n_head_kv=2, head_dim=32, ffn=192, max_ctx=16)
    weights = ex.LayerWeights.random(config, seed=3)
    x = np.random.default_rng(4).standard_normal((12, config.hidden)).astype(np.float32)
    outputs = {}
    for kind in ("float32", kv):
        layer = ex.LlamaLayer(weights, config, kv_dtype=np.float32 if kind == "float32" else kind)
        got = [layer.forward(x[:8], np.arange(8, dtype=np.int32))]
        for p in range(8, 12):
            got.append(layer.forward(x[p:p + 1], np.array([p], np.int32)))
        outputs[kind] = np.concatenate(got)
    assert isinstance(layer.k_cache, ex.fastattn.Quantized) and layer.k_cache.qtype == kv
    difference = np.abs(outputs[kv] - outputs["float32"]).max()
    assert 0 < difference <= bound * np.abs(outputs["float32"]).max()


def test_the_examples_reference_check_passes_and_catches_a_wrong_output(capsys):
    """The example's own check (the same layer on fastattn.reference's ops, same inputs): it passes on the fast
    layer's outputs and fails when one output value is off by twice its bound."""
    ex = load_example()
    config = ex.LlamaConfig(hidden=128, n_head=4, n_head_kv=2, head_dim=32, ffn=192, max_ctx=16)
    weights = ex.LayerWeights.random(config, seed=5)
    x = np.random.default_rng(6).standard_normal((9, config.hidden)).astype(np.float32)
    inputs = [(x[:8], np.arange(8, dtype=np.int32)), (x[8:], np.array([8], np.int32))]
    layer = ex.LlamaLayer(weights, config, kv_dtype=np.float16)
    outputs = [layer.forward(*call) for call in inputs]
    assert ex.check_against_reference(weights, config, "f16", inputs, outputs)
    assert capsys.readouterr().out.rstrip().endswith("f16 cache): passed")
    wrong = [outputs[0], outputs[1].copy()]
    wrong[1][0, 3] += 2 * ex.TOLERANCE["f16"] * max(np.abs(o).max() for o in outputs)
    assert not ex.check_against_reference(weights, config, "f16", inputs, wrong)
    assert capsys.readouterr().out.rstrip().endswith("f16 cache): FAILED")

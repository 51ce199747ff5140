"""The transformers backend: tiny random models from configs (nothing downloaded), the same weights run with
"eager" and with "fastattn".

Logits are compared on the positions that are not padding (a padding query row sees no key: eager spreads it
uniformly, flash_attn_ext gives zeros, and no real position reads it), within 2e-5 of the largest logit; greedy
generation with the cache must give the same tokens and scores within the same bound.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastattn  # noqa: E402
from fastattn.integrations import transformers as fa_hf  # noqa: E402
from hf_models import left_padded_batch, random_model  # noqa: E402

RELATIVE = 2e-5
VOCAB = 96
PROMPT = 20  # longer than every window below
WINDOW = 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)


def _configs() -> dict:
    from transformers import (
        Gemma2Config,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )
    return {
        "llama": lambda: LlamaConfig(**_COMMON),
        "qwen2": lambda: Qwen2Config(**_COMMON),
        "mistral": lambda: MistralConfig(**_COMMON, sliding_window=WINDOW),
        "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
        "gemma2": lambda: Gemma2Config(**_COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                       attn_logit_softcapping=0.2, final_logit_softcapping=30.0,
                                       layer_types=["sliding_attention", "full_attention"]),
        "gpt_oss": lambda: GptOssConfig(**_COMMON, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                                        num_experts_per_tok=2,
                                        layer_types=["sliding_attention", "full_attention"]),
    }


MODELS = ["llama", "qwen2", "mistral", "qwen3", "gemma2", "gpt_oss"]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    fa_hf.register()


def _model(name: str):
    return random_model(_configs()[name]())


def _batch():
    return left_padded_batch(VOCAB, PROMPT)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_eager_with_left_padding_and_windows(name):
    model = _model(name)
    ids, mask = _batch()
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("fastattn")
        fast = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert _relative(fast[real], eager[real]) <= RELATIVE


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_eager(name):
    model = _model(name)
    ids, mask = _batch()
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                    return_dict_in_generate=True, pad_token_id=0)
    eager = model.generate(ids, **settings)
    model.set_attn_implementation("fastattn")
    fast = model.generate(ids, **settings)
    assert torch.equal(fast.sequences, eager.sequences)
    for step_fast, step_eager in zip(fast.scores, eager.scores, strict=True):
        assert _relative(step_fast, step_eager) <= RELATIVE


def test_unpadded_prefill_and_decode_take_no_mask_and_match_eager():
    model = _model("llama")
    ids = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    eager = model.generate(ids, **settings)
    model.set_attn_implementation("fastattn")
    seen = []
    original = fa_hf.attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask is None)
        return original(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("fastattn", spy)
    try:
        fast = model.generate(ids, **settings)
    finally:
        fa_hf.register()
    assert seen and all(seen)  # causal prefill without padding, then decode: transformers sends no mask
    assert torch.equal(fast.sequences, eager.sequences)
    for step_fast, step_eager in zip(fast.scores, eager.scores, strict=True):
        assert _relative(step_fast, step_eager) <= RELATIVE


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_static_cache_decode_reads_the_live_rows_without_a_mask(name):
    """A static cache's decode mask hides the unfilled rows (and, for Mistral, the rows before the window): the
    backend hands flash_attn_ext the live rows alone, with no mask, and generation matches eager."""
    model = _model(name)
    ids = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    settings = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
                    cache_implementation="static")
    eager = model.generate(ids, **settings)
    model.set_attn_implementation("fastattn")
    calls = []
    original = fa_hf.flash_attn_ext

    def spy(q, k, v, mask=None, **kwargs):
        calls.append((q.shape[2], k.shape[2], mask is None))
        return original(q, k, v, mask, **kwargs)

    fa_hf.flash_attn_ext = spy
    try:
        fast = model.generate(ids, **settings)
    finally:
        fa_hf.flash_attn_ext = original
    decode = [(n_kv, no_mask) for n_q, n_kv, no_mask in calls if n_q == 1]
    # the prompt and each generated token so far, or Mistral's window (shorter than the prompt)
    live = [WINDOW if name == "mistral" else PROMPT + step + 1
            for step in range(settings["max_new_tokens"] - 1) for _ in range(_COMMON["num_hidden_layers"])]
    assert decode == [(n, True) for n in live]
    assert torch.equal(fast.sequences, eager.sequences)
    for step_fast, step_eager in zip(fast.scores, eager.scores, strict=True):
        assert _relative(step_fast, step_eager) <= RELATIVE


@pytest.mark.parametrize("row, keys", [
    ("0011100", (2, 5)), ("1110000", (0, 3)), ("0000111", (4, 7)), ("1111111", (0, 7)), ("0000000", None),
    ("0110110", None), ("1000001", None), ("0001000", (3, 4))])
def test_live_keys_of_a_mask_row(row, keys):
    assert fa_hf._live_keys(np.array([c == "1" for c in row])) == keys


def test_mask_builder_leaves_a_one_run_decode_row_boolean_and_turns_the_rest_additive():
    from transformers.masking_utils import and_masks, causal_mask_function

    # a static cache of 12 rows, 8 filled (the skip would leave a mask out where no key is hidden beyond causality)
    decode = fa_hf.attention_mask_for(1, 1, 12, q_offset=7, allow_is_causal_skip=False)
    assert decode.dtype == torch.bool and fa_hf._decode_mask == (decode, (0, 8))

    def with_hole(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx != 3

    holed = fa_hf.attention_mask_for(1, 1, 12, q_offset=7, mask_function=and_masks(causal_mask_function, with_hole),
                                     allow_is_causal_skip=False)
    assert holed.dtype == torch.float32 and fa_hf._decode_mask == (holed, None)
    expected = torch.where(torch.arange(12) <= 7, 0.0, -torch.inf)
    expected[3] = -torch.inf
    assert torch.equal(holed[0, 0, 0], expected)



@pytest.mark.parametrize("kv_length", [1, 5, 12])
@pytest.mark.parametrize("kv_offset", [0, 3])
def test_causal_decode_masks_match_sdpa_builder(kv_length, kv_offset):
    """A causal decode row without padding (built without sdpa_mask's machinery) is sdpa_mask's own row, and its
    live run is the keys up to the query's position, for every offset: before the first key, inside, past the
    last."""
    from transformers.masking_utils import sdpa_mask

    for q_offset in range(-2, kv_length + kv_offset + 3):
        for position in (q_offset, torch.tensor(q_offset)):
            built = fa_hf.attention_mask_for(1, 1, kv_length, q_offset=position, kv_offset=kv_offset,
                                             allow_is_causal_skip=False, device=torch.device("cpu"),
                                             dtype=torch.float32)
            row = sdpa_mask(batch_size=1, q_length=1, kv_length=kv_length, q_offset=position, kv_offset=kv_offset,
                            allow_is_causal_skip=False)
            keys = fa_hf._live_keys(row.numpy()[0, 0, 0])
            assert built.shape == row.shape
            if keys is None:  # no key live: the additive mask, all -inf
                assert built.dtype == torch.float32 and bool(torch.all(built == -torch.inf))
            else:
                assert built.dtype == torch.bool and torch.equal(built, row)
                assert fa_hf._decode_mask == (built, keys)


class _Module(torch.nn.Module):
    is_causal = True


def _qkv(n_q=5, n_kv=5, requires_grad=False):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, n_q, 16, generator=generator, requires_grad=requires_grad)
    k = torch.randn(2, 2, n_kv, 16, generator=generator)
    v = torch.randn(2, 2, n_kv, 16, generator=generator)
    return q, k, v


def test_attention_function_reads_bool_and_additive_masks_alike():
    q, k, v = _qkv(3, 7)
    keep = torch.rand(2, 1, 3, 7, generator=torch.Generator().manual_seed(4)) > 0.3
    keep[..., 0] = True
    additive = torch.where(keep, 0.0, -torch.inf)
    with torch.no_grad():
        out_bool, weights = fa_hf.attention_forward(_Module(), q, k, v, keep, scaling=0.3)
        out_add, _ = fa_hf.attention_forward(_Module(), q, k, v, additive, scaling=0.3)
        wide = torch.cat([additive, torch.zeros(2, 1, 3, 4)], dim=-1)  # extra columns are cut to Nkv
        out_wide, _ = fa_hf.attention_forward(_Module(), q, k, v, wide, scaling=0.3)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3,
                                                                    enable_gqa=True)
    assert weights is None
    assert torch.equal(out_bool, out_add) and torch.equal(out_wide, out_add)
    assert out_bool.shape == (2, 3, 4, 16)  # (B, Nq, Hq, D), what transformers reshapes
    torch.testing.assert_close(out_bool, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_attention_function_without_mask_is_torch_causal():
    q, k, v = _qkv(5, 5)
    with torch.no_grad():
        out, _ = fa_hf.attention_forward(_Module(), q, k, v, None, scaling=0.25)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25,
                                                                    enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_attention_function_keeps_the_model_dtype():
    q, k, v = _qkv(1, 9)
    with torch.no_grad():
        out16, _ = fa_hf.attention_forward(_Module(), q.half(), k.half(), v.half(), None)
        out32, _ = fa_hf.attention_forward(_Module(), q.half().float(), k.half(), v.half(), None)
    assert out16.dtype == torch.float16
    assert torch.equal(out16, out32.half())


@pytest.mark.parametrize("case", ["dropout", "grad", "output_attentions", "position_bias", "device"])
def test_attention_function_refuses_what_it_cannot_honour(case):
    q, k, v = _qkv(requires_grad=case == "grad")
    kwargs = {"dropout": {"dropout": 0.1}, "output_attentions": {"output_attentions": True},
              "position_bias": {"position_bias": torch.zeros(1, 4, 5, 5)}}.get(case, {})
    if case == "device":
        k = k.to("meta")
    with pytest.raises(ValueError, match={"dropout": "dropout", "grad": "requires grad",
                                          "output_attentions": "attention weights", "position_bias": "position_bias",
                                          "device": "on meta"}[case]):
        fa_hf.attention_forward(_Module(), q, k, v, None, **kwargs)


def test_training_mode_with_dropout_is_refused_through_the_model():
    config = _configs()["llama"]()
    config.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="fastattn")
    model.train()
    ids, mask = _batch()
    with torch.no_grad(), pytest.raises(ValueError, match="dropout"):
        model(input_ids=ids, attention_mask=mask)


def test_registering_under_another_name():
    assert fa_hf.register("fastattn_other") == "fastattn_other"
    model = _model("llama")
    ids, mask = _batch()
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("fastattn_other")
        fast = model(input_ids=ids, attention_mask=mask).logits
    assert _relative(fast[mask.bool()], eager[mask.bool()]) <= RELATIVE
    with pytest.raises(TypeError, match="name"):
        fa_hf.register("")


def test_core_api_reads_the_cache_tensors_in_place():
    q, k, v = _qkv(1, 9)
    out = fastattn.flash_attn_ext(q, k, v, scale=0.25)
    assert isinstance(out, np.ndarray)
    assert np.array_equal(out, fastattn.flash_attn_ext(q.numpy(), k.numpy(), v.numpy(), scale=0.25))

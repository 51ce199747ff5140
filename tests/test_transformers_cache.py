"""``QuantizedKVCache``: tiny random models from configs (nothing downloaded), Q8_0 and Q4_0.

The comparison: the same weights run with "eager" and ``FakeQuantizedCache``, a ``DynamicCache`` that rounds the
new K/V rows through the reference quantizer (quantize, then dequantize: blocks of 32 along the head dimension)
before storing them. Its attention reads exactly the values the quantized cache holds, so logits of real
(not padding) positions agree within 2e-5 × max(1, max |logits|) and greedy tokens are the same.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fastattn import reference  # noqa: E402
from fastattn.integrations import transformers as fa_hf  # noqa: E402
from hf_models import left_padded_batch, random_model  # noqa: E402
from fastattn.integrations import transformers_cache as fa_cache  # noqa: E402
from fastattn.quant.blocks import Quantized  # noqa: E402

RELATIVE = 2e-5
VOCAB = 96
PROMPT = 20  # longer than the windows
WINDOW = 8
QTYPES = ["q8_0", "q4_0"]
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, pad_token_id=0)


def _configs() -> dict:
    from transformers import Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig, Qwen3Config
    return {
        "llama": lambda: LlamaConfig(**_COMMON),
        "qwen3": lambda: Qwen3Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "gemma2": lambda: Gemma2Config(**_COMMON, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                       attn_logit_softcapping=0.2, final_logit_softcapping=30.0,
                                       layer_types=["sliding_attention", "full_attention"]),
        "mistral": lambda: MistralConfig(**_COMMON, sliding_window=WINDOW),
        "gpt_oss": lambda: GptOssConfig(**_COMMON, sliding_window=WINDOW, num_local_experts=4,
                                        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"]),
    }


def fake_quantized(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """``x`` rounded through the reference quantizer, float32."""
    values = reference.dequantize(reference.quantize(x.detach().to(torch.float32).contiguous().numpy(), qtype))
    return torch.from_numpy(values)


class FakeQuantizedCache(transformers.DynamicCache):
    """A ``DynamicCache`` storing the new K/V rows rounded through the reference quantizer."""

    def __init__(self, config, qtype: str):
        super().__init__(config=config)
        self.qtype = qtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(fake_quantized(key_states, self.qtype), fake_quantized(value_states, self.qtype),
                              layer_idx, *args, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    fa_hf.register()


def _model(name: str, implementation: str = "eager"):
    return random_model(_configs()[name](), implementation)


def _batch():
    return left_padded_batch(VOCAB, PROMPT)


def _assert_close(fast: torch.Tensor, eager: torch.Tensor) -> None:
    bound = RELATIVE * max(1.0, float(eager.abs().max()))
    assert float((fast - eager).abs().max()) <= bound


def _step(model, implementation: str, cache, ids, mask):
    """One forward over ``ids`` (the new tokens) with the cache; ``mask`` covers every token so far."""
    model.set_attn_implementation(implementation)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True).logits


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
def test_prefill_and_every_decode_step_match_eager_over_fake_quantized_rows(name, qtype):
    """A manual loop: a left-padded prefill of two prompts, then greedy steps, each token fed back."""
    model = _model(name)
    ids, mask = _batch()
    fake = FakeQuantizedCache(model.config, qtype)
    cache = fa_hf.QuantizedKVCache(model.config, qtype)
    eager = _step(model, "eager", fake, ids, mask)
    fast = _step(model, "fastattn", cache, ids, mask)
    real = mask.bool()
    _assert_close(fast[real], eager[real])
    for _ in range(5):
        token = eager[:, -1].argmax(-1, keepdim=True)
        assert torch.equal(fast[:, -1].argmax(-1, keepdim=True), token)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        eager = _step(model, "eager", fake, token, mask)
        fast = _step(model, "fastattn", cache, token, mask)
        _assert_close(fast, eager)
    assert cache.get_seq_length() == fake.get_seq_length() == PROMPT + 5


@pytest.mark.parametrize("name, qtype", [("llama", "q8_0"), ("llama", "q4_0"), ("qwen3", "q4_0"),
                                         ("gemma2", "q8_0"), ("mistral", "q8_0"), ("gpt_oss", "q4_0")])
def test_generate_with_the_cache_matches_eager(name, qtype):
    model = _model(name)
    ids, mask = _batch()
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=0)
    eager = model.generate(ids, cache=FakeQuantizedCache(model.config, qtype), **settings)
    model.set_attn_implementation("fastattn")
    cache = fa_hf.QuantizedKVCache(model.config, qtype)
    fast = model.generate(ids, cache=cache, **settings)
    assert torch.equal(fast.sequences, eager.sequences)
    for step_fast, step_eager in zip(fast.logits, eager.logits, strict=True):
        _assert_close(step_fast, step_eager)
    assert cache.get_seq_length() == PROMPT + 5  # the last token is generated, never fed back


def test_beam_search_reorders_the_cache():
    model = _model("llama")
    ids, mask = _batch()
    settings = dict(attention_mask=mask, max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False,
                    pad_token_id=0, early_stopping=True)
    eager = model.generate(ids, cache=FakeQuantizedCache(model.config, "q8_0"), **settings)
    model.set_attn_implementation("fastattn")
    fast = model.generate(ids, cache=fa_hf.QuantizedKVCache(model.config, "q8_0"), **settings)
    assert torch.equal(fast, eager)


def test_the_backend_reads_the_cache_blocks_in_place(monkeypatch):
    model = _model("gemma2", "fastattn")
    ids, mask = _batch()
    cache = fa_hf.QuantizedKVCache(model.config, "q8_0")
    calls = []
    original = fa_hf.flash_attn_ext

    def spy(q, k, v, mask=None, **kwargs):
        calls.append((k, v))
        return original(q, k, v, mask, **kwargs)

    monkeypatch.setattr(fa_hf, "flash_attn_ext", spy)
    model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(calls) == 3 * len(cache.layers)
    for i, (k, v) in enumerate(calls):
        layer = cache.layers[i % len(cache.layers)]
        assert isinstance(k, Quantized) and isinstance(v, Quantized)
        assert np.shares_memory(k.data, layer.key_blocks.data) and np.shares_memory(v.data, layer.value_blocks.data)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_other_attention_implementations_read_the_dequantized_values(implementation):
    model = _model("llama", implementation)
    ids, mask = _batch()
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=0)
    expected = model.generate(ids, cache=FakeQuantizedCache(model.config, "q4_0"), **settings)
    got = model.generate(ids, cache=fa_hf.QuantizedKVCache(model.config, "q4_0"), **settings)
    assert torch.equal(got.sequences, expected.sequences)
    for step_got, step_expected in zip(got.logits, expected.logits, strict=True):
        _assert_close(step_got, step_expected)


def test_handles_are_tensors_of_the_dequantized_rows():
    cache = fa_hf.QuantizedKVCache(_configs()["llama"](), "q8_0")
    k = torch.randn(2, 2, 5, 32, generator=torch.Generator().manual_seed(3))
    keys, values = cache.update(k, 2 * k, 0)
    assert isinstance(keys, fa_hf.QuantizedKV) and keys.shape == (2, 2, 5, 32) and keys.dtype == torch.float32
    assert keys.blocks.qtype == "q8_0"
    assert torch.equal(keys + 0, fake_quantized(k, "q8_0"))  # any torch operation sees the values
    assert torch.equal(torch.cat([values], dim=2), fake_quantized(2 * k, "q8_0"))
    assert "q8_0" in repr(keys) and "nbytes" in repr(cache)


def _drive(cache, fake, steps, generator):
    """The same random K/V updates into both caches (2 layers); their returned rows, lengths and mask sizes
    must agree after every update."""
    for n_new in steps:
        for layer in range(2):
            k, v = (torch.randn(2, 2, n_new, 32, generator=generator) for _ in range(2))
            assert cache.get_mask_sizes(n_new, layer) == fake.get_mask_sizes(n_new, layer)
            got = cache.update(k, v, layer)
            expected = fake.update(k, v, layer)
            for handle, rows in zip(got, expected):
                assert torch.equal(handle.dequantized(), rows)
            assert cache.get_seq_length(layer) == fake.get_seq_length(layer)
            live, kept = cache.layers[layer], fake.layers[layer]
            if not getattr(kept, "record_past", False):  # recording, DynamicSlidingWindowLayer keeps every row
                assert torch.equal(live.keys.dequantized(), kept.keys)
                assert torch.equal(live.values.dequantized(), kept.values)


@pytest.mark.parametrize("qtype", QTYPES)
def test_cache_operations_follow_dynamic_cache(qtype):
    """A full and a sliding-window layer (Gemma 2's types) fed the same rows as ``FakeQuantizedCache``: the same
    rows, lengths and mask sizes through growth, the window's moves, crop, beam reordering, batch selection and
    reset; the window layer's storage stays near twice the window."""
    config = _configs()["gemma2"]()
    cache, fake = fa_hf.QuantizedKVCache(config, qtype), FakeQuantizedCache(config, qtype)
    generator = torch.Generator().manual_seed(4)
    assert cache.is_sliding == fake.is_sliding == [True, False]
    _drive(cache, fake, [PROMPT] + [1, 3, 1, 2] * 60, generator)  # 440 tokens: storages grow and move
    sliding, full = cache.layers
    assert full.key_blocks.shape[2] >= 440 and sliding.key_blocks.shape[2] <= 2 * (WINDOW + 3) + fa_cache.MIN_GROWTH
    cache.activate_past_recording()
    fake.activate_past_recording()
    _drive(cache, fake, [1, 2, 1], generator)
    cache.crop(-3)
    fake.crop(-3)
    _drive(cache, fake, [1, 1], generator)
    beams = torch.tensor([1, 1])
    cache.reorder_cache(beams)
    fake.reorder_cache(beams)
    _drive(cache, fake, [1, 2], generator)
    cache.batch_repeat_interleave(2)
    fake.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([3, 0]))
    fake.batch_select_indices(torch.tensor([3, 0]))
    _drive(cache, fake, [2, 1], generator)
    cache.reset()
    fake.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes == 0
    _drive(cache, fake, [5, 1], generator)


def test_a_window_layer_cannot_crop_into_rows_it_dropped():
    config = _configs()["mistral"]()
    cache = fa_hf.QuantizedKVCache(config, "q8_0")
    generator = torch.Generator().manual_seed(6)
    for _ in range(200):
        cache.update(*(torch.randn(1, 2, 1, 32, generator=generator) for _ in range(2)), 0)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-150)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


@pytest.mark.parametrize("qtype, bound", [("q8_0", 0.28), ("q4_0", 0.15)])
def test_nbytes_counts_the_storage(qtype, bound):
    """One update of N tokens: capacity N + max(N // 32, 64) rows of D / 32 blocks per K and V, batch and head."""
    config = transformers.LlamaConfig(**{**_COMMON, "head_dim": 64})
    cache = fa_hf.QuantizedKVCache(config, qtype)
    n = 16384
    rows = torch.zeros(1, 2, n, 64)
    for layer in range(2):
        cache.update(rows, rows, layer)
    block_bytes = {"q8_0": 34, "q4_0": 18}[qtype]
    capacity = n + max(n // 32, 64)
    assert cache.nbytes == 2 * 2 * 2 * capacity * 2 * block_bytes
    float32_bytes = 2 * 2 * 2 * n * 64 * 4
    assert cache.nbytes <= bound * float32_bytes


def test_bad_arguments_are_refused():
    config = _configs()["llama"]()
    with pytest.raises(ValueError, match="qtype"):
        fa_hf.QuantizedKVCache(config, "q5_0")
    with pytest.raises(TypeError, match="config"):
        fa_hf.QuantizedKVCache({"num_hidden_layers": 2})
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention.*DynamicCache"):
        fa_hf.QuantizedKVCache(config)
    cache = fa_hf.QuantizedKVCache(_configs()["llama"]())
    with pytest.raises(ValueError, match="head_dim 16"):
        cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
    cache.update(torch.zeros(1, 2, 3, 32), torch.zeros(1, 2, 3, 32), 0)
    with pytest.raises(ValueError, match="key_states must have shape"):
        cache.update(torch.zeros(2, 2, 1, 32), torch.zeros(2, 2, 1, 32), 0)


def test_a_one_sequence_window_decode_reads_the_live_blocks_without_a_mask(monkeypatch):
    """Batch 1, Mistral's window shorter than the prompt: the builder's one-row decode mask lets one run of keys
    through, and the backend hands flash_attn_ext that run of the blocks (a view) and no mask."""
    model = _model("mistral")
    ids = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    settings = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    eager = model.generate(ids, cache=FakeQuantizedCache(model.config, "q8_0"), **settings)
    model.set_attn_implementation("fastattn")
    cache = fa_hf.QuantizedKVCache(model.config, "q8_0")
    calls = []
    original = fa_hf.flash_attn_ext

    def spy(q, k, v, mask=None, **kwargs):
        calls.append((q.shape[2], k, mask is None))
        return original(q, k, v, mask, **kwargs)

    monkeypatch.setattr(fa_hf, "flash_attn_ext", spy)
    fast = model.generate(ids, cache=cache, **settings)
    decode = [(k, no_mask) for n_q, k, no_mask in calls if n_q == 1]
    assert len(decode) == 3 * len(cache.layers)
    for k, no_mask in decode:
        assert no_mask and isinstance(k, Quantized) and k.shape[2] == WINDOW
    assert torch.equal(fast.sequences, eager.sequences)
    for step_fast, step_eager in zip(fast.logits, eager.logits, strict=True):
        _assert_close(step_fast, step_eager)

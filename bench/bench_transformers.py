"""transformers decode with attn_implementation "fastattn", "sdpa" and "eager": time per generated token.

A small Llama from a config (hidden 512, 8 query heads, 2 KV heads, head dim 64, 4 layers, float32, random
weights), a ``StaticCache`` holding a context of 4096 or 16384 random K/V rows, then one token per call at the next
position: the cost of a decode step at that context, with the cache written in place (a ``DynamicCache`` would add
a copy of the whole cache per layer and token, the same for every implementation).

``test_decode_per_token`` times each implementation alone; ``test_decode_per_token_paired`` runs one token with
each implementation in every round, in an order that rotates, and records each one's median and the ratio
sdpa / fastattn (``extra_info``): the separate benchmarks run a minute apart on a shared machine.
``test_quantized_cache_decode_paired`` does the same at 16384 tokens for "fastattn" over ``QuantizedKVCache``
(Q8_0, Q4_0) and "sdpa" over ``DynamicCache`` and over ``QuantizedCache(backend="fp8")``, and records the caches'
bytes.

Run: ``python -m pytest bench/bench_transformers.py --benchmark-columns=min,median,rounds
--benchmark-group-by=group`` (needs torch and transformers: ``pip install torch==<a CPU build> transformers``).
"""
from __future__ import annotations

import inspect

import pytest
from conftest import measure, paired

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fastattn.integrations import transformers as fa_hf  # noqa: E402

CONTEXTS = [4096, 16384]
IMPLEMENTATIONS = ["fastattn", "sdpa", "eager"]
THREADS = 2
ROUNDS = 15
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4, 8, 2, 64


#: The forward argument that takes the cache: ``cache`` in recent transformers, ``past_key_values`` before (a
#: deprecated alias since).
_CACHE_ARGUMENT = ("cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
                   else "past_key_values")


def _model():
    fa_hf.register()
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=HEADS * HEAD_DIM, intermediate_size=1536,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                      max_position_embeddings=32768)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


class Decoder:
    """A model and a cache filled to ``context`` rows (a StaticCache unless ``cache`` is given); ``step()``
    generates one token at the next position."""

    def __init__(self, model, context: int, rounds: int, cache=None):
        self.model = model
        self.cache = (transformers.StaticCache(config=model.config, max_cache_len=context + rounds + 8)
                      if cache is None else cache)
        generator = torch.Generator().manual_seed(context)
        for layer in range(LAYERS):
            k, v = (torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=generator) for _ in range(2))
            self.cache.update(k, v, layer)
        self.position = context
        self.token = torch.tensor([[5]])

    def step(self, implementation: str) -> None:
        self.model.set_attn_implementation(implementation)
        with torch.inference_mode():
            self.model(input_ids=self.token, **{_CACHE_ARGUMENT: self.cache}, use_cache=True,
                       cache_position=torch.tensor([self.position]))
        self.position += 1


@pytest.fixture(scope="module")
def model():
    return _model()


def _kv_bytes(context: int) -> int:
    return LAYERS * 2 * KV_HEADS * context * HEAD_DIM * 4


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("context", CONTEXTS)
def test_decode_per_token(benchmark, model, context, implementation):
    decoder = Decoder(model, context, ROUNDS + 3)
    measure(benchmark, lambda: decoder.step(implementation), group=f"transformers decode ctx {context}",
            threads=THREADS, nbytes=_kv_bytes(context), rounds=ROUNDS)


@pytest.mark.parametrize("context", CONTEXTS)
def test_decode_per_token_paired(benchmark, model, context):
    decoders = {name: Decoder(model, context, ROUNDS + 3) for name in IMPLEMENTATIONS}
    calls = {name: (lambda name=name: decoders[name].step(name)) for name in IMPLEMENTATIONS}
    medians = paired(benchmark, calls, group=f"transformers decode ctx {context} paired", threads=THREADS,
                     rounds=ROUNDS)
    if medians is None:
        return
    for name, median in medians.items():
        benchmark.extra_info[f"{name}_ms"] = round(median * 1e3, 3)
    benchmark.extra_info["sdpa/fastattn"] = round(medians["sdpa"] / medians["fastattn"], 3)
    benchmark.extra_info["eager/fastattn"] = round(medians["eager"] / medians["fastattn"], 3)


#: The quantized-cache comparison: "fastattn" over ``QuantizedKVCache`` (Q8_0, Q4_0) against "sdpa" over the
#: caches transformers users have: ``DynamicCache`` (float32, ``torch.cat`` of the whole cache per layer and token)
#: and ``QuantizedCache(backend="fp8")`` (the one backend of transformers' own that needs no extra package: it
#: appends FP8 rows, then dequantizes the whole cache to float32 at every step).
QUANTIZED_CONTEXT = 16384
QUANTIZED_ROUNDS = 16
QUANTIZED_CACHES = {"q8_0": "fastattn", "q4_0": "fastattn", "sdpa": "sdpa", "sdpa_fp8": "sdpa"}


def _quantized_decoders(model) -> dict:
    caches = {"q8_0": fa_hf.QuantizedKVCache(model.config, "q8_0"),
              "q4_0": fa_hf.QuantizedKVCache(model.config, "q4_0"),
              "sdpa": transformers.DynamicCache(config=model.config),
              "sdpa_fp8": transformers.QuantizedCache(backend="fp8", config=model.config)}
    return {name: Decoder(model, QUANTIZED_CONTEXT, QUANTIZED_ROUNDS + 3, cache) for name, cache in caches.items()}


def _float32_kv_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _fp8_bytes(cache) -> int:
    return sum(layer._quantized_keys[0].nbytes + layer._quantized_values[0].nbytes for layer in cache.layers)


def test_quantized_cache_decode_paired(benchmark, model):
    """One decode step of each cache per round, in an order that rotates; each one's median over
    ``QUANTIZED_ROUNDS`` steps, the speed-ups, and each cache's bytes after the last step."""
    decoders = _quantized_decoders(model)
    calls = {name: (lambda name=name: decoders[name].step(QUANTIZED_CACHES[name])) for name in decoders}
    # skip 2: measure's warm-up call and pytest-benchmark's warm-up round, so the medians are of QUANTIZED_ROUNDS
    medians = paired(benchmark, calls, group=f"transformers decode ctx {QUANTIZED_CONTEXT} quantized cache paired",
                     threads=THREADS, rounds=QUANTIZED_ROUNDS, skip=2)
    if medians is None:
        return
    for name, median in medians.items():
        benchmark.extra_info[f"{name}_ms"] = round(median * 1e3, 3)
    for fast in ("q8_0", "q4_0"):
        for base in ("sdpa", "sdpa_fp8"):
            benchmark.extra_info[f"{base}/{fast}"] = round(medians[base] / medians[fast], 3)
    float32_bytes = _float32_kv_bytes(decoders["sdpa"].cache)
    sizes = {"q8_0": decoders["q8_0"].cache.nbytes, "q4_0": decoders["q4_0"].cache.nbytes,
             "sdpa_fp8": _fp8_bytes(decoders["sdpa_fp8"].cache), "float32": float32_bytes}
    for name, size in sizes.items():
        benchmark.extra_info[f"{name}_MB"] = round(size / 1e6, 2)
        if name != "float32":
            benchmark.extra_info[f"{name}_bytes/float32"] = round(size / float32_bytes, 4)

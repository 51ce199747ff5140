"""transformers with attn_implementation "fastattn" against "sdpa" (and "eager"): the same tokens, and the speed
of decode steps at a long context.

The model is built from a config with random weights (nothing is downloaded): a small Llama (hidden 512, 8 query
heads, 2 KV heads, head dim 64, 4 layers, float32) by default, or another decoder with ``--model``. Two parts:

1. Generation: the same weights generate greedily from the same random prompt with "eager", "sdpa" and
   "fastattn"; fastattn's tokens must equal eager's (the script exits with status 1 otherwise).
2. Speed: decode steps at a context of ``--context`` tokens (default 16384) in a ``StaticCache`` of random K/V,
   one token of fastattn and one of sdpa per round, in alternating order, so that both see the same machine;
   it prints each one's median time per token and the speed-up, sdpa's median / fastattn's (and the ratio of
   the fastest tokens, the better guide on a busy machine). fastattn's gain is in the attention over a long
   cache: at a few hundred cached tokens the two are about even, because the rest of the token (projections,
   MLP, transformers' Python) is the same work for both (docs/transformers.md gives the measured figures).

With ``--cache q8_0`` (or ``q4_0``) both parts run over fastattn's quantized KV cache, ``QuantizedKVCache``:
fastattn's tokens must equal eager's over a ``DynamicCache`` holding the same quantized values (each new K/V row
rounded through ``fastattn.reference``'s quantizer), and the decode steps of "fastattn" over the quantized cache
are timed against "sdpa" over transformers' ``DynamicCache`` (float32) and ``QuantizedCache(backend="fp8")``;
it prints the caches' sizes too.

    python examples/hf_generate.py [--context 16384] [--rounds 15] [--model llama] [--threads 2] [--eager]
    python examples/hf_generate.py --cache q8_0 [--context 16384] ...
    python examples/hf_generate.py --short      # seconds: a short prompt and a 512-token context

Needs torch and transformers (``docs/transformers.md`` says how to get torch's CPU build).
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

import torch
import transformers

import fastattn
import fastattn.reference
from fastattn.integrations import transformers as fa_hf

IMPLEMENTATIONS = ("eager", "sdpa", "fastattn")

#: The forward argument that takes the cache: ``cache`` in recent transformers, ``past_key_values`` before.
_CACHE_ARGUMENT = ("cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
                   else "past_key_values")


def make_config(name: str):
    common = dict(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768)
    if name == "llama":
        return transformers.LlamaConfig(**common)
    if name == "mistral":
        return transformers.MistralConfig(**common, sliding_window=256)
    if name == "gemma2":
        return transformers.Gemma2Config(**common, sliding_window=256, query_pre_attn_scalar=64,
                                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if name == "gpt_oss":
        return transformers.GptOssConfig(**common, sliding_window=256, num_local_experts=4, num_experts_per_tok=2,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise SystemExit(f"unknown --model {name!r}: llama, mistral, gemma2 or gpt_oss")


class FakeQuantizedCache(transformers.DynamicCache):
    """A ``DynamicCache`` storing each new K/V row rounded through the reference quantizer (quantize, then
    dequantize): the values a ``QuantizedKVCache`` holds, for eager to attend over."""

    def __init__(self, config, qtype: str):
        super().__init__(config=config)
        self.qtype = qtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def rounded(x):
            blocks = fastattn.reference.quantize(x.to(torch.float32).contiguous().numpy(), self.qtype)
            return torch.from_numpy(fastattn.reference.dequantize(blocks)).to(x.dtype)

        return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)


def generate(model, prompt: torch.Tensor, new_tokens: int, implementation: str, cache=None) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, **({} if cache is None else {_CACHE_ARGUMENT: cache}))


class Decoder:
    """A cache (a ``StaticCache`` unless ``cache`` is given) filled with ``context`` rows of random K/V;
    ``step()`` runs the model on one token at the next position with one attention implementation, writing its
    K/V into the cache."""

    def __init__(self, model, context: int, steps: int, cache=None):
        config = model.config
        self.model = model
        self.cache = (transformers.StaticCache(config=config, max_cache_len=context + steps + 8)
                      if cache is None else cache)
        generator = torch.Generator().manual_seed(context)
        shape = (1, config.num_key_value_heads, context, config.head_dim)
        for layer in range(config.num_hidden_layers):
            self.cache.update(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator),
                              layer)
        self.position = context
        self.token = torch.tensor([[5]])

    def step(self, implementation: str) -> float:
        """One decode step; its seconds."""
        self.model.set_attn_implementation(implementation)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model(input_ids=self.token, **{_CACHE_ARGUMENT: self.cache}, use_cache=True,
                       cache_position=torch.tensor([self.position]))
        self.position += 1
        return time.perf_counter() - start


def check_tokens(model, vocab: int, prompt_len: int, new: int) -> bool:
    """Part 1: greedy generation with each implementation; True when fastattn's tokens equal eager's."""
    prompt = torch.randint(1, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    outputs = {}
    for name in IMPLEMENTATIONS:
        start = time.perf_counter()
        try:
            outputs[name] = generate(model, prompt, new, name)
        except ValueError as error:  # transformers refuses sdpa for some architectures (gpt-oss)
            print(f"  {name:9s} not available for this model: {str(error).splitlines()[0][:90]}")
            continue
        print(f"  {name:9s} {time.perf_counter() - start:6.2f} s for a {prompt_len}-token prompt and {new} new "
              f"tokens" + ("  (first calls compile or load fastattn's kernels)" if name == "fastattn" else ""))
    same = torch.equal(outputs["fastattn"], outputs["eager"])
    if "sdpa" in outputs and not torch.equal(outputs["sdpa"], outputs["eager"]):
        print("  (sdpa's tokens differ from eager's: float32 rounding picked another token at a near tie)")
    print(f"checked: fastattn's {new} generated tokens {'equal' if same else 'DIFFER from'} eager's "
          f"({'passed' if same else 'FAILED'})")
    return same


def check_cached_tokens(model, vocab: int, prompt_len: int, new: int, qtype: str) -> bool:
    """Part 1 over a quantized cache: fastattn over ``QuantizedKVCache`` against eager over the same values."""
    prompt = torch.randint(1, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    eager = generate(model, prompt, new, "eager", FakeQuantizedCache(model.config, qtype))
    start = time.perf_counter()
    cache = fa_hf.QuantizedKVCache(model.config, qtype)
    fast = generate(model, prompt, new, "fastattn", cache)
    print(f"  fastattn  {time.perf_counter() - start:6.2f} s for a {prompt_len}-token prompt and {new} new tokens "
          f"over a {qtype.upper()} QuantizedKVCache ({cache.nbytes / 1e3:.1f} kB)")
    same = torch.equal(fast, eager)
    print(f"checked: fastattn's {new} generated tokens over a {qtype.upper()} cache "
          f"{'equal' if same else 'DIFFER from'} eager's over the same values ({'passed' if same else 'FAILED'})")
    return same


def _caches(model, qtype: str | None, eager: bool) -> dict:
    """label -> (attention implementation, the cache a Decoder fills; None: a StaticCache)."""
    if qtype is None:
        names = ["fastattn", "sdpa"] + (["eager"] if eager else [])
        return {name: (name, None) for name in names}
    caches = {"fastattn": ("fastattn", fa_hf.QuantizedKVCache(model.config, qtype)),
              "sdpa": ("sdpa", transformers.DynamicCache(config=model.config))}
    try:  # transformers' own quantized cache; full-attention models only
        caches["sdpa fp8"] = ("sdpa", transformers.QuantizedCache(backend="fp8", config=model.config))
    except ValueError as error:
        print(f"  sdpa with QuantizedCache(backend='fp8') not available: {str(error).splitlines()[0][:90]}")
    if eager:
        caches["eager"] = ("eager", transformers.DynamicCache(config=model.config))
    return caches


def _float32_kv_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def measure_speed(model, context: int, rounds: int, eager: bool, qtype: str | None = None) -> None:
    """Part 2: paired decode steps at ``context``; prints the medians and sdpa / fastattn (with ``qtype``: over
    a ``QuantizedKVCache`` against sdpa over a ``DynamicCache`` and an fp8 ``QuantizedCache``, and the sizes)."""
    caches = _caches(model, qtype, eager)
    names = list(caches)
    decoders = {name: Decoder(model, context, rounds + 1, cache) for name, (_, cache) in caches.items()}
    for name in list(names):  # one untimed step each: fastattn's decode kernels, torch's first-call work
        try:
            decoders[name].step(caches[name][0])
        except ValueError as error:
            print(f"  {name} not available for this model: {str(error).splitlines()[0][:90]}")
            names.remove(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:  # the order rotates round by round
            times[name].append(decoders[name].step(caches[name][0]))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name in names:
        print(f"  {name:9s} {medians[name] * 1e3:8.2f} ms/token (median of {rounds}, fastest "
              f"{min(times[name]) * 1e3:.2f})")
    what = ("speed-up over sdpa" if qtype is None else
            f"speed-up of fastattn over a {qtype.upper()} QuantizedKVCache against sdpa")
    for base, label in (("sdpa", "" if qtype is None else " with a DynamicCache"),
                        ("sdpa fp8", " with an fp8 QuantizedCache")):
        if base in medians and "fastattn" in medians:
            fastest = min(times[base]) / min(times["fastattn"])
            print(f"{what}{label} at a context of {context} tokens: "
                  f"{medians[base] / medians['fastattn']:.2f}x ({base}'s median time per token / fastattn's; by "
                  f"the fastest tokens {fastest:.2f}x)")
    if qtype is not None:
        float32_bytes = _float32_kv_bytes(decoders["sdpa"].cache)
        nbytes = decoders["fastattn"].cache.nbytes
        print(f"memory: the {qtype.upper()} QuantizedKVCache holds {nbytes / 1e6:.1f} MB (nbytes), "
              f"{nbytes / float32_bytes:.3f}x the float32 DynamicCache's {float32_bytes / 1e6:.1f} MB of K/V")
    load, cores = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0, os.cpu_count() or 1
    if load > cores:  # other processes held the cores: the medians include waits for a CPU
        print(f"  (the machine is busy: load average {load:.1f} on {cores} cores; the fastest tokens are the "
              f"better guide, and a rerun on a quiet machine the best)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=None,
                        help="tokens in the cache for the speed part (default 16384; --short: 512)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="decode steps per implementation (default 15; --short: 3)")
    parser.add_argument("--prompt", type=int, default=None,
                        help="prompt length of the generation part (default 64; --short: 16)")
    parser.add_argument("--new", type=int, default=None,
                        help="tokens to generate in the generation part (default 16; --short: 4)")
    parser.add_argument("--model", default="llama", help="llama, mistral, gemma2 or gpt_oss (default llama)")
    parser.add_argument("--threads", type=int, default=None, help="threads for torch and fastattn")
    parser.add_argument("--eager", action="store_true", help="time eager's decode steps too (slow at long contexts)")
    parser.add_argument("--cache", choices=("q8_0", "q4_0"), default=None,
                        help="generate and decode over fastattn's QuantizedKVCache of this type")
    parser.add_argument("--short", action="store_true",
                        help="a quick run: a 16-token prompt, 4 new tokens, a 512-token context, 3 rounds (each "
                             "unless given)")
    args = parser.parse_args(argv)
    for name, default, short in (("context", 16384, 512), ("rounds", 15, 3), ("prompt", 64, 16), ("new", 16, 4)):
        if getattr(args, name) is None:
            setattr(args, name, short if args.short else default)
    if args.threads:
        torch.set_num_threads(args.threads)
        fastattn.set_num_threads(args.threads)
    fa_hf.register()
    config = make_config(args.model)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    print(f"{args.model}: {config.num_hidden_layers} layers, {torch.get_num_threads()} torch threads, "
          f"{fastattn.get_num_threads()} fastattn threads")
    print(f"generation: a {args.prompt}-token prompt, {args.new} new tokens, greedy")
    if args.cache is None:
        same = check_tokens(model, config.vocab_size, args.prompt, args.new)
        print(f"decode at a context of {args.context} tokens (a StaticCache of random K/V), {args.rounds} paired "
              f"rounds")
    else:
        same = check_cached_tokens(model, config.vocab_size, args.prompt, args.new, args.cache)
        print(f"decode at a context of {args.context} tokens (caches of random K/V), {args.rounds} paired rounds")
    measure_speed(model, args.context, args.rounds, args.eager, args.cache)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

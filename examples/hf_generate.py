"""Generate with a tiny transformers model on "sdpa", "eager" and "fastattn" attention, and time each token.

The model is built from a config with random weights (nothing is downloaded): a small Llama (hidden 512, 8 query
heads, 2 KV heads, head dim 64, 4 layers) by default, or any other decoder with ``--model``. The same weights
generate greedily from the same random prompt with each attention implementation; the script prints the time per
token of each and whether the generated tokens agree with eager's.

    python examples/hf_generate.py [--prompt 512] [--new 32] [--model llama|mistral|gemma2|gpt_oss] [--threads 2]

Needs torch and transformers (``docs/transformers.md`` says how to get torch's CPU build).
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers

import fastattn
from fastattn.integrations import transformers as fa_hf

IMPLEMENTATIONS = ("sdpa", "eager", "fastattn")


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


class TokenClock(transformers.StoppingCriteria):
    """Records the time at which each new token is produced (a stopping criterion that never stops)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def generate(model, prompt: torch.Tensor, new_tokens: int, implementation: str):
    model.set_attn_implementation(implementation)
    clock = TokenClock()
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         stopping_criteria=[clock], pad_token_id=0)
    first = clock.times[0] - start  # the prefill
    per_token = (clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1)
    return out, first, per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt length in tokens (default 512)")
    parser.add_argument("--new", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--model", default="llama", help="llama, mistral, gemma2 or gpt_oss (default llama)")
    parser.add_argument("--threads", type=int, default=None, help="threads for torch and fastattn")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        fastattn.set_num_threads(args.threads)
    fa_hf.register()
    config = make_config(args.model)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompt = torch.randint(1, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    print(f"{args.model}: prompt {args.prompt} tokens, {args.new} new, {torch.get_num_threads()} torch threads, "
          f"{fastattn.get_num_threads()} fastattn threads")
    start = time.perf_counter()  # fastattn's first calls compile (or load from the disk cache) its kernels
    generate(model, prompt, 2, "fastattn")
    print(f"  fastattn warm-up (first prefill and decode calls): {time.perf_counter() - start:.1f} s")
    outputs = {}
    for name in IMPLEMENTATIONS:
        try:
            outputs[name], first, per_token = generate(model, prompt, args.new, name)
        except ValueError as error:  # transformers refuses sdpa for some architectures (gpt-oss)
            print(f"  {name:9s} not available for this model: {str(error).splitlines()[0][:90]}")
            continue
        agree = "" if name == "eager" or "eager" not in outputs else (
            "  tokens agree with eager" if torch.equal(outputs[name], outputs["eager"]) else
            "  tokens DIFFER from eager")
        print(f"  {name:9s} prefill {first * 1e3:8.1f} ms   {per_token * 1e3:7.2f} ms/token{agree}")
    if "sdpa" in outputs and not torch.equal(outputs["sdpa"], outputs["eager"]):
        print("  (sdpa's tokens differ from eager's)")


if __name__ == "__main__":
    main()

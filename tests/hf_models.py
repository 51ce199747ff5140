"""Tiny random transformers models for the backend's and the cache's tests (nothing downloaded)."""
from __future__ import annotations

import torch
import transformers


def random_model(config, implementation: str = "eager"):
    """A float32 model of ``config`` with seeded random weights; gpt-oss's sinks (zero at start) made random so
    that they matter."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                          dtype=torch.float32).eval()
    if config.model_type == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def left_padded_batch(vocab: int, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of ``prompt`` tokens, the first left-padded by 5: (ids, attention mask)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (2, prompt), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids[0, :5] = 0
    return ids, mask

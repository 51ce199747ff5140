"""Main-job cases for ``quantize`` and ``dequantize``: a prefill's K rows (n_prefill x n_head_kv·head_dim) into
the Q8_0 and Q4_0 blocks of llama.cpp's quantized KV caches, and back.

Both are exactly defined (ggml's reference rounding in float32, ``fastattn/reference/quant.py``): the fast bytes
and values must equal the reference's bit for bit. The inputs of ``dequantize`` are quantized by the NumPy
reference, so building the cases compiles nothing.
"""
from __future__ import annotations

import numpy as np

from . import Case, Config, register
from .checks import bit_exact


@register("quant")
def cases(config: Config, rng: np.random.Generator) -> list[Case]:
    import fastattn
    import fastattn.reference as ref

    rows, width = config.n_prefill, config.n_head_kv * config.head_dim
    x = rng.standard_normal((rows, width)).astype(np.float32)
    out = []
    for qtype in ("q8_0", "q4_0"):
        blocks = ref.quantize(x, qtype)
        out.append(Case("quantize", f"({rows}, {width}) f32 -> {qtype}", "prefill K rows",
                        fast=lambda qtype=qtype: fastattn.quantize(x, qtype).data,
                        reference=lambda qtype=qtype: ref.quantize(x, qtype).data, check=bit_exact(),
                        nbytes=x.nbytes + blocks.data.nbytes, dtype=qtype))
        out.append(Case("dequantize", f"{qtype} -> ({rows}, {width}) f32", "prefill K rows",
                        fast=lambda blocks=blocks: fastattn.dequantize(blocks),
                        reference=lambda blocks=blocks: ref.dequantize(blocks), check=bit_exact(),
                        nbytes=blocks.data.nbytes + x.nbytes, dtype=qtype))
    return out

"""Hugging Face transformers attention backend: every attention layer of a model on ``flash_attn_ext``.

    import fastattn.integrations.transformers as fa_hf
    fa_hf.register()                                   # once per process; name="fastattn" by default
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fastattn")
    # or: model.set_attn_implementation("fastattn")

transformers calls ``attention_forward`` with query (B, Hq, Nq, D) and key/value (B, Hkv, Nkv, D) tensors,
which is ``flash_attn_ext``'s own layout, and expects (B, Nq, Hq, D) back, which is ggml's permuted output: the
tensors are read in place (no transpose, no copy of the KV cache) and the result is handed back without a copy.

What transformers passes, and what becomes of it:
- ``attention_mask``: the mask that ``attention_mask_for`` (registered under the same name) builds: additive
  float32, 0 where a key takes part and ``-inf`` where it is hidden, (B, 1, Nq, Nkv), or None where no key is
  hidden beyond causality (transformers' own test for SDPA: no padding, and Nq == 1 or Nq == Nkv, and no window
  shorter than Nkv). Boolean masks (True takes part, as SDPA's) and additive masks from another builder (eager's
  finite minimum) are taken too; a mask with more columns than Nkv is cut to Nkv. A one-row mask (batch 1) that
  lets through one run of keys (a decode step over a static cache's filled rows, or a sliding window) is not
  read at all: the call gets K/V rows of that run alone and no mask, ``flash_attn_ext``'s unmasked decode (the
  builder hands such a mask on as SDPA's boolean one, unconverted: once per generated token it is not worth
  the conversion).
- None with ``Nq > 1`` on a causal module: causal with torch's ``is_causal`` alignment (key j is hidden from
  query i when j > i). transformers only leaves the mask out when Nq == Nkv, where every alignment agrees.
- ``scaling`` (default D**-0.5), ``softcap`` (Gemma 2's ``attn_logit_softcapping``), ``s_aux`` (GPT-OSS's sinks,
  one logit per query head joining the softmax denominator): ``scale``, ``logit_softcap``, ``sinks``.
- ``sliding_window``: already in the mask (transformers builds windowed masks for windowed layers).
- GQA: key/value keep their Hkv heads; query head h reads KV head h // (Hq // Hkv), as transformers' repeat_kv.
- float16/bfloat16 models: K and V are read as they are, the query is widened to float32 (flash_attn_ext's
  query type) and the float32 output is rounded to the model's dtype.

``QuantizedKVCache(config, qtype="q8_0")`` (``fastattn.integrations.transformers_cache``): a ``Cache`` holding K
and V as Q8_0 / Q4_0 blocks; its ``update`` returns ``QuantizedKV`` handles, whose blocks ``attention_forward``
reads in place (other attention implementations see their dequantized values).

Refused with a ValueError, instead of computing something else: dropout > 0 (a model in training mode), tensors
that require grad (fastattn has no backward), tensors on another device, ``output_attentions``, and
``position_bias`` (T5-style learned biases).
"""
from __future__ import annotations

import functools
import math
import sys

import numpy as np

from .._core.tensors import as_array
from ..attention.api import flash_attn_ext
from ..quant.blocks import Quantized

#: The name ``register`` uses by default.
DEFAULT_NAME = "fastattn"
_NEG_INF = np.float32(-np.inf)
#: The names ``fastattn.integrations.transformers_cache`` defines for this module (it imports torch and
#: transformers, so it is loaded on first access, as ``register`` loads transformers).
_CACHE_NAMES = ("QuantizedKVCache", "QuantizedKV")


def __getattr__(name: str):
    if name in _CACHE_NAMES:
        from . import transformers_cache

        return getattr(transformers_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(name: str = DEFAULT_NAME) -> str:
    """Register ``attention_forward`` with transformers' ``AttentionInterface`` and ``attention_mask_for`` with its
    ``AttentionMaskInterface`` under ``name``, so that ``attn_implementation=name`` runs on fastattn; returns
    ``name``. Registering again replaces the earlier entries."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask_for)
    return name


def attention_mask_for(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                       mask_function=None, attention_mask=None, allow_is_causal_skip: bool = True, **kwargs):
    """transformers' mask builder for fastattn: SDPA's boolean mask turned additive (0 / -inf float32,
    (B, 1, Nq, Nkv)), or None where SDPA's builder would leave the mask out. A one-row mask whose live keys are one
    run stays SDPA's boolean mask: ``attention_forward`` reads that run of K/V rows, not the mask."""
    import torch
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    global _decode_mask
    if (batch_size == 1 and q_length == 1 and attention_mask is None and not allow_is_causal_skip
            and (mask_function is None or mask_function is causal_mask_function)
            and getattr(q_offset, "ndim", 0) == 0 and kwargs.get("local_size") is None
            and str(kwargs.get("device", "cpu")) == "cpu"):
        # a causal decode step without padding (a static cache's next row): keys j with kv_offset + j <= q_offset
        # are live, the same boolean row sdpa_mask builds, without its general machinery
        n_live = min(int(q_offset) - int(kv_offset) + 1, kv_length)
        if n_live > 0:
            mask = (torch.arange(kv_length) < n_live).view(1, 1, 1, kv_length)
            _decode_mask = (mask, (0, n_live))
            return mask
    kwargs.pop("dtype", None)  # the additive mask is float32 whatever the model's dtype: -inf is exact in it
    mask = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    if mask is None:
        return None
    if mask.shape[:3] == (1, 1, 1) and mask.device.type == "cpu":
        keys = _live_keys(mask.numpy()[0, 0, 0])
        if keys is not None:  # a decode step over one run of keys: the layers read the run, never the mask
            _decode_mask = (mask, keys)
            return mask
    additive = torch.where(mask, torch.zeros((), dtype=torch.float32, device=mask.device),
                           torch.tensor(-math.inf, dtype=torch.float32, device=mask.device))
    _decode_mask = (additive, None)
    return additive


#: The last mask ``attention_mask_for`` built and, for a one-row mask, its live keys (``_live_keys``; else None):
#: transformers builds one mask per forward and hands it to every layer, where a decode step then reads K/V rows
#: [j0, j1) without a mask.
_decode_mask: tuple = (None, None)


@functools.lru_cache(maxsize=4)
def _causal_mask(n_q: int, n_kv: int) -> np.ndarray:
    """torch's ``is_causal`` mask (key j hidden from query i when j > i), additive float32, read-only."""
    mask = np.triu(np.full((n_q, n_kv), _NEG_INF, np.float32), 1)
    mask.flags.writeable = False
    return mask


def _mask_array(attention_mask, n_kv: int) -> np.ndarray:
    torch = sys.modules["torch"]
    if attention_mask.shape[-1] > n_kv:
        attention_mask = attention_mask[..., :n_kv]
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.where(attention_mask, torch.zeros((), dtype=torch.float32),
                                     torch.tensor(-math.inf, dtype=torch.float32))
    elif attention_mask.dtype not in (torch.float32, torch.float16):
        attention_mask = attention_mask.to(torch.float32)
    return as_array("attention_mask", attention_mask)


def _live_keys(live: np.ndarray) -> tuple[int, int] | None:
    """(j0, j1) when the boolean row ``live`` is True exactly on j0 .. j1 - 1 (one run of keys), else None."""
    j0 = int(live.argmax())
    if not live[j0]:
        return None
    j1 = live.shape[0] - int(live[::-1].argmax())
    return (j0, j1) if np.count_nonzero(live) == j1 - j0 else None


def _kv_array(name: str, t, torch):
    """K or V as ``flash_attn_ext`` reads it: a ``QuantizedKVCache`` handle's blocks in place, or the tensor's
    ndarray."""
    if t.__class__ is not torch.Tensor:
        from .transformers_cache import QuantizedKV  # loaded already wherever such a handle exists

        if isinstance(t, QuantizedKV):
            return t.blocks
    return as_array(name, t)


def _kv_rows(a, j0: int, j1: int):
    """Rows [j0, j1) of K or V (B, Hkv, Nkv, D): a view, of the blocks when quantized."""
    if a.__class__ is Quantized:
        return Quantized(a.data[:, :, j0:j1], a.qtype)
    return a[:, :, j0:j1]


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, s_aux=None, is_causal: bool | None = None, **kwargs):
    """transformers' attention function: ``(attn_output (B, Nq, Hq, DV), None)`` from query (B, Hq, Nq, D),
    key (B, Hkv, Nkv, D), value (B, Hkv, Nkv, DV) and the mask (see the module docstring)."""
    torch = sys.modules["torch"]  # loaded: transformers called with its tensors
    if dropout:
        raise ValueError(f"fastattn attention has no dropout (got dropout={dropout}); put the model in eval mode "
                         f"(model.eval()) or use another attn_implementation for training")
    if kwargs.get("output_attentions"):
        raise ValueError("fastattn attention does not return attention weights (output_attentions=True); use "
                         "attn_implementation='eager' for them")
    if kwargs.get("position_bias") is not None:
        raise ValueError("fastattn attention does not take a learned position_bias; use another "
                         "attn_implementation for this model")
    q = as_array("query", query if query.dtype == torch.float32 else query.to(torch.float32))
    k = _kv_array("key", key, torch)
    v = _kv_array("value", value, torch)
    n_q, n_kv = q.shape[2], k.shape[2]
    built, keys = _decode_mask
    if attention_mask is not None and attention_mask is built and keys is not None and keys[1] <= n_kv:
        # the live keys alone, without a mask (a mask hiding the others gives the same attention)
        k, v, mask = _kv_rows(k, *keys), _kv_rows(v, *keys), None
    elif attention_mask is not None:
        mask = _mask_array(attention_mask, n_kv)
    elif n_q > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        mask = _causal_mask(n_q, n_kv)
    else:
        mask = None
    sinks = None
    if s_aux is not None:
        sinks = as_array("s_aux", s_aux.detach().to(torch.float32))
    scale = scaling if scaling is not None else q.shape[3] ** -0.5
    out = flash_attn_ext(q, k, v, mask, scale=float(scale), logit_softcap=float(softcap or 0.0), sinks=sinks)
    result = torch.from_numpy(out)
    return (result if query.dtype == torch.float32 else result.to(query.dtype)), None

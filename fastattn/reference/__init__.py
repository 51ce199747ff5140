"""fastattn.reference: the definition of every op in plain NumPy, computed in float64.

Same names and signatures as ``fastattn``; results are rounded once at the end to the dtype the fast path
returns (pass a float64 ``out=`` to get the unrounded values). Never imports Numba.
"""
from ..rope.modes import ROPE_IMROPE, ROPE_MROPE, ROPE_NEOX, ROPE_NORMAL, ROPE_VISION, RopeMode
from ..quant.blocks import Quantized
from .._core.tensors import accept_tensors as _accept_tensors

from . import attention as _attention
from . import flash_attn as _flash_attn
from . import norm as _norm
from . import quant as _quant
from . import rope as _rope
from . import rows as _rows

# CPU torch tensors are accepted wherever an ndarray is, as in ``fastattn`` (read without a copy)
flash_attn_ext = _accept_tensors(_attention.flash_attn_ext)
rms_norm = _accept_tensors(_norm.rms_norm)
rms_norm_mul = _accept_tensors(_norm.rms_norm_mul)
add_rms_norm_mul = _accept_tensors(_norm.add_rms_norm_mul)
rope_cache = _accept_tensors(_rope.rope_cache)
apply_rope_cache = _accept_tensors(_rope.apply_rope_cache)
rope_ext = _accept_tensors(_rope.rope_ext)
rope_set_rows = _accept_tensors(_rope.rope_set_rows)
apply_rope_cache_set_rows = _accept_tensors(_rope.apply_rope_cache_set_rows)
set_rows = _accept_tensors(_rows.set_rows)
quantize = _accept_tensors(_quant.quantize)
dequantize = _quant.dequantize
# FlashAttention's API (fastattn.integrations.flash_attn's definition); a torch q gets torch results
flash_attn_func = _flash_attn.flash_attn_func
flash_attn_varlen_func = _flash_attn.flash_attn_varlen_func
flash_attn_with_kvcache = _flash_attn.flash_attn_with_kvcache

__all__ = [
    "ROPE_IMROPE", "ROPE_MROPE", "ROPE_NEOX", "ROPE_NORMAL", "ROPE_VISION", "Quantized", "RopeMode",
    "add_rms_norm_mul", "dequantize", "quantize", "apply_rope_cache", "apply_rope_cache_set_rows", "flash_attn_ext",
    "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
    "rms_norm", "rms_norm_mul", "rope_cache", "rope_ext", "rope_set_rows", "set_rows",
]


def __dir__() -> list[str]:
    # the public names only: the submodules holding the definitions are reached by their full name
    return sorted(__all__)

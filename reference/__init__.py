"""fastattn.reference: the definition of every op in plain NumPy, computed in float64.

Same names and signatures as ``fastattn``; results are rounded once at the end to the dtype the fast path
returns (pass a float64 ``out=`` to get the unrounded values). Never imports Numba.
"""
from fastattn._modes import ROPE_IMROPE, ROPE_MROPE, ROPE_NEOX, ROPE_NORMAL, ROPE_VISION, RopeMode

from .attention import flash_attn_ext
from .norm import add_rms_norm_mul, rms_norm, rms_norm_mul
from .rope import apply_rope_cache, apply_rope_cache_set_rows, rope_cache, rope_ext, rope_set_rows
from .rows import set_rows

__all__ = [
    "ROPE_IMROPE", "ROPE_MROPE", "ROPE_NEOX", "ROPE_NORMAL", "ROPE_VISION", "RopeMode",
    "add_rms_norm_mul", "apply_rope_cache", "apply_rope_cache_set_rows", "flash_attn_ext", "rms_norm",
    "rms_norm_mul", "rope_cache", "rope_ext", "rope_set_rows", "set_rows",
]

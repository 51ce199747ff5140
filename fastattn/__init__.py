"""fastattn: CPU kernels for the non-GEMM operators of LLM inference, with ggml's semantics.

Each op exists twice with the same name and signature: here (Numba ``prange`` kernels) and in
``fastattn.reference`` (plain NumPy, float64, the definition). Importing this package is cheap: Numba is loaded
on first use of a fast op, and ``import fastattn.reference`` never loads it.
"""
import importlib as _importlib

from ._core import tensors as _tensors
from ._core import threads as _threads
from .rope.modes import ROPE_IMROPE, ROPE_MROPE, ROPE_NEOX, ROPE_NORMAL, ROPE_VISION, RopeMode
from .quant.blocks import Quantized
from ._core.threads import get_num_threads, get_thread_rule, num_threads, set_num_threads, set_thread_rule

# name -> the op package's ``api`` module, where the public function starts (imported on first access).
_FAST_OPS = {
    "rms_norm": ".norm.api", "rms_norm_mul": ".norm.api", "add_rms_norm_mul": ".norm.api",
    "set_rows": ".rows.api",
    "flash_attn_ext": ".attention.api",
    "rope_ext": ".rope.api", "rope_cache": ".rope.api", "apply_rope_cache": ".rope.api",
    "rope_set_rows": ".rope.api", "apply_rope_cache_set_rows": ".rope.api",
    "quantize": ".quant.api", "dequantize": ".quant.api",
}

__all__ = [
    "ROPE_IMROPE", "ROPE_MROPE", "ROPE_NEOX", "ROPE_NORMAL", "ROPE_VISION", "Quantized", "RopeMode",
    "get_num_threads", "num_threads", "set_num_threads", "get_thread_rule", "set_thread_rule", *_FAST_OPS,
]


def __getattr__(name: str):
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    module = _FAST_OPS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastattn' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    if callable(value) and name != "rope_cache":  # rope_cache launches nothing that could run concurrently
        value = _threads.guard(value)
    value = _tensors.accept_tensors(value)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # the public names only: submodules (fastattn.reference included) and helpers are reached by their full name
    return sorted(__all__) + ["__version__"]


def _version() -> str:
    """The installed distribution's version (read on first access: importlib.metadata costs milliseconds)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("fastattn")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"

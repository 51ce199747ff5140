"""RoPE mode constants with ggml's values (NumPy-free, Numba-free: shared by reference and fast paths)."""
from enum import IntEnum


class RopeMode(IntEnum):
    """ggml's ``GGML_ROPE_TYPE_*`` values."""

    NORMAL = 0  #: adjacent pairs (2i, 2i+1): GPT-J style, "interleaved" in Hugging Face terms
    NEOX = 2  #: pairs (i, i + n_dims/2): Llama's ``rotate_half``
    MROPE = 8  #: multimodal: NEOX pairs, sections of pairs assigned to position streams t, h, w, e
    VISION = 24  #: Qwen2-VL vision: every dim rotated, pairs (i, i + n_dims), exponent restarting per section
    IMROPE = 40  #: interleaved multimodal (Qwen3-VL): t, h, w by pair % 3


ROPE_NORMAL = RopeMode.NORMAL
ROPE_NEOX = RopeMode.NEOX
ROPE_MROPE = RopeMode.MROPE
ROPE_VISION = RopeMode.VISION
ROPE_IMROPE = RopeMode.IMROPE

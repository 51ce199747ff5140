"""ggml's Q8_0 / Q4_0 blocks: the ``Quantized`` container in ``blocks`` (NumPy only, shared with the
reference) and ``quantize`` / ``dequantize`` and the row quantizers in ``api``.
"""

"""SET_ROWS (``set_rows``) into float and quantized caches: ``api`` and ``args``.
"""

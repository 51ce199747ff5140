"""RoPE: ``rope_ext``, ``rope_cache``, ``apply_rope_cache``, ``rope_set_rows`` and
``apply_rope_cache_set_rows`` in ``api``, their argument rules in ``args``, the modes in ``modes``, the
cos/sin cache, the rotation and the drivers.
"""

"""``flash_attn_ext``: the public function in ``api``, its argument rules in ``args`` (shared with the
reference), the one_chunk, tiled and split-KV paths and the row arithmetic they share.
"""

"""The machinery every op shares: the kernel decorator and conversions (``kernel``), SIMD helpers
(``simd``), threads (``threads``), argument checks (``validate``), torch tensors (``tensors``), compile
notices (``notices``), leading-axis layouts (``layout``) and the source-keyed kernel cache
(``source_cache``). Nothing here imports an op package.
"""

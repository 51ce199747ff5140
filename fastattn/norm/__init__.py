"""RMSNorm and its fusions (``rms_norm``, ``rms_norm_mul``, ``add_rms_norm_mul``): ``api`` and ``args``.
"""

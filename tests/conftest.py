import strategies  # noqa: F401  (registers and loads the hypothesis profile)

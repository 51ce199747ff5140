"""Test-session set-up: the hypothesis profile (``tests/strategies.py``).

The suite runs what users run: the default thread rule ("measured"); a test that needs a particular choice pins
it with ``fastattn.testing.parallel_min_bytes``. A cold run is mostly Numba compiling kernels, one core per
process: the README's command spreads the test files over every core with pytest-xdist (``-n auto``; files stay
whole on one worker, ``--dist loadfile``, so a file's kernels compile once; not in pyproject's addopts, where
pytest-benchmark would read it as a parallel run and turn the benchmarks off).
"""
from __future__ import annotations

import strategies  # noqa: F401  (registers and loads the hypothesis profile)

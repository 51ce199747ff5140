"""Outputs sharing memory with another argument raise before any write: ``aliasing_cases.py``, run in a
subprocess so that a regression that writes out of bounds fails this test instead of killing the test run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_overlapping_arguments_raise_in_a_subprocess():
    here = Path(__file__).parent
    env = dict(os.environ, FASTATTN_NO_PREWARM="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "aliasing_cases.py"],
                         cwd=here, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"exit status {run.returncode}:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"

"""Test-session set-up: the hypothesis profile, and a compile warm-up for cold runs of the whole suite.

Nearly all of a cold run's time is Numba compiling kernels (on 2 cores: ~35 s with a warm cache, ~14 min cold),
and one pytest process compiles on one core. When the whole suite starts on a cold cache with at least 2 cores,
a second pytest process runs the files that come last in the order (RoPE, norm, rows, the layer tests) at the
same time as this one runs the attention files: their kernels are compiled on the other core and written to
Numba's on-disk cache, where this process finds them when it gets there. The second process only warms the
cache (its output is discarded; this process still runs and reports every test) and is stopped at the end of
the session. ``FASTATTN_NO_PREWARM=1`` turns it off.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import strategies  # noqa: F401  (registers and loads the hypothesis profile)

from fastattn import _threads

# The suite checks the kernels each thread count asks for; the measured rule (tested in test_threads.py) could
# run a 2-thread call on one thread.
_threads.set_thread_rule("fixed")

#: The files the warm-up process runs, the ones this process reaches last first.
PREWARM_FILES = ("test_rope.py", "test_rows.py", "test_norm.py", "test_qwen2vl_layer.py", "test_llama_layer.py")
_CHILD = "FASTATTN_PREWARM_CHILD"
_prewarm: subprocess.Popen | None = None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cache_is_cold() -> bool:
    import fastattn

    return not any((Path(fastattn.__file__).parent / "__pycache__").glob("rope.*.nbi"))


def pytest_collection_finish(session):
    global _prewarm
    if os.environ.get("FASTATTN_NO_PREWARM") or os.environ.get(_CHILD):
        return
    collected = {Path(str(item.path)).name for item in session.items}
    # A file skipped at import (the layer tests without transformers) has no items: warm whichever were collected.
    files = [f for f in PREWARM_FILES if f in collected]
    if "test_attention.py" not in collected or "test_rope.py" not in files or _cores() < 2 or not _cache_is_cold():
        return
    here = Path(__file__).parent
    _prewarm = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(here / f) for f in files)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, **{_CHILD: "1"}), cwd=str(here.parent))


def pytest_sessionfinish(session, exitstatus):
    if _prewarm is not None and _prewarm.poll() is None:
        _prewarm.kill()
        _prewarm.wait()

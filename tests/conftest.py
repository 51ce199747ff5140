"""Test-session set-up: the hypothesis profile, and a compile warm-up for cold runs of the whole suite.

Nearly all of a cold run's time is Numba compiling kernels, and one pytest process compiles on one core. When the
whole suite starts on a cold cache with at least 2 cores, a second pytest process runs the test files in the
opposite order at the same time as this one runs them in order: each compiles the kernels of its half on its own
core and writes them to Numba's on-disk cache, where the other finds them when it gets there, so the two meet in
the middle whatever each file costs. The second process only warms the cache (its output is discarded; this
process still runs and reports every test); it writes the name of each file it starts to a progress file, and is
stopped when this process reaches a file it has started (from there on its kernels are compiled, and its load
would only slow this process's timing-sensitive tests) or at the end of the session. ``FASTATTN_NO_PREWARM=1``
turns it off.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import strategies  # noqa: F401  (registers and loads the hypothesis profile)

from fastattn import _threads

# The suite checks the kernels each thread count asks for; the measured rule (tested in test_threads.py) could
# run a 2-thread call on one thread.
_threads.set_thread_rule("fixed")

#: Files the warm-up process leaves out: their tests run subprocesses that compile on their own.
NOT_PREWARMED = ("test_aliasing.py",)
_CHILD = "FASTATTN_PREWARM_CHILD"  # set in the warm-up process: the path of its progress file
_prewarm: subprocess.Popen | None = None
_progress: Path | None = None
_last_file: str | None = None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cache_is_cold() -> bool:
    import numba

    import fastattn

    where = Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else Path(fastattn.__file__).parent / "__pycache__"
    return not any(where.rglob("rope.*.nbi"))


def pytest_collection_finish(session):
    global _prewarm, _progress
    if os.environ.get("FASTATTN_NO_PREWARM") or os.environ.get(_CHILD):
        return
    files = list(dict.fromkeys(Path(str(item.path)).name for item in session.items))  # in run order
    if len(files) < 4 or _cores() < 2 or not _cache_is_cold():
        return
    files = [f for f in reversed(files[1:]) if f not in NOT_PREWARMED]
    here = Path(__file__).parent
    handle, name = tempfile.mkstemp(prefix="fastattn-prewarm-", suffix=".txt")
    os.close(handle)
    _progress = Path(name)
    _prewarm = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(here / f) for f in files)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, **{_CHILD: name}), cwd=str(here.parent), start_new_session=True)


def pytest_runtest_logstart(nodeid, location):
    """At each new test file: the warm-up process records it; this process stops the warm-up process once it
    reaches a file that process has started."""
    global _last_file
    file = Path(nodeid.split("::")[0]).name
    if file == _last_file:
        return
    _last_file = file
    progress = os.environ.get(_CHILD)
    if progress:
        with open(progress, "a") as out:
            out.write(file + "\n")
    elif _prewarm is not None and _prewarm.poll() is None and file in _progress.read_text().split():
        _stop_prewarm()


def _stop_prewarm():
    """Stop the warm-up process and what its tests started (its own process group)."""
    if _prewarm is not None and _prewarm.poll() is None:
        if hasattr(os, "killpg"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(_prewarm.pid, signal.SIGKILL)
        else:  # pragma: no cover - Windows
            _prewarm.kill()
        _prewarm.wait()
    if _progress is not None:
        _progress.unlink(missing_ok=True)


def pytest_sessionfinish(session, exitstatus):
    _stop_prewarm()

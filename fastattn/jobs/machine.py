"""What the main job records about the machine: CPU, cores, load, versions; and when to call it busy."""
from __future__ import annotations

import os
import platform
import sys

from .._core.threads import cores  # noqa: F401  (the main job's record names it)


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def last_level_cache_bytes() -> int | None:
    """The size of one CPU's largest-level data or unified cache (Linux sysfs), None where unknown. A VM may
    report its host's."""
    import glob

    best = None
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{index}/type") as kind, open(f"{index}/level") as level, open(f"{index}/size") as size:
                if kind.read().strip() == "Instruction":
                    continue
                text = size.read().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                entry = (int(level.read()), int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
        best = max(best, entry) if best else entry
    return best[1] if best else None


def busy_warning(load: float | None, n_cores: int) -> str | None:
    """A warning when the load average exceeds the cores: more threads wanted to run than there were CPUs, so
    timings include waits for a CPU."""
    if load is None or load <= n_cores:
        return None
    return (f"the machine is busy: load average {load:.1f} on {n_cores} core(s); other processes compete for "
            f"the CPUs and the times are unreliable (read the min column, and rerun on a quiet machine)")


def describe(thread_counts: list[int]) -> dict:
    """Versions, CPU and thread counts, for the JSON report."""
    import numba
    import numpy as np

    from .. import __version__
    from .._core import threads as _threads

    return {
        "fastattn": __version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "cpu": cpu_model(),
        "cores": cores(),
        "numba_threads": _threads.max_threads(),
        "threading_layer": _threads.threading_layer(),
        "threads": list(thread_counts),
    }

"""Keep NumPy's OpenBLAS on one thread while the main job runs.

After a multi-threaded BLAS call (the references' matmuls), OpenBLAS's idle workers keep spinning for a while.
On a machine with few cores they then hold the cores that a ``prange`` launch needs, and each parallel kernel
waits a scheduler tick: on a 2-core machine a 0.5 ms RMSNorm took 8 ms at 2 threads right after a reference ran.
The main job therefore asks OpenBLAS for one thread (like ``OPENBLAS_NUM_THREADS=1``, but at run time, since
NumPy is already loaded). Users mixing NumPy matmuls and fastattn's parallel kernels on a small machine may want
the same (``threadpoolctl`` does it too).
"""
from __future__ import annotations

import ctypes
import os

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def _loaded_openblas() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:  # not Linux: nothing to do
        return []
    return sorted(p for p in paths if os.path.exists(p))


def set_blas_threads(n: int) -> bool:
    """Set every loaded OpenBLAS's thread count to ``n``; False when none was found."""
    done = False
    for path in _loaded_openblas():
        lib = ctypes.CDLL(path)
        for name in _SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                done = True
                break
    return done

"""Kernels compiled in a helper process while the calling process compiles the rest of a first call.

A cold first call compiles several independent kernels: its work unit (the op's inner loop, called by address:
``_core.kernel.unit_address``) and the driver or entry kernel that calls it, and for attention a second unit
(``group_rows``). Numba compiles on the calling thread, one function after the other, so the call keeps one core
busy for seconds while another may sit idle. The kernels need each other only to run, not to compile (a driver
holds its unit's address, not its code). So where a call is about to compile a unit that Numba's on-disk cache
does not hold, ``defer`` starts a helper process for one of the other kernels (``python -c``: import its module,
``compile`` it for the argument types, which writes it to the cache) and returns at once; the caller compiles
the unit meanwhile; ``settle``, called before anything runs, waits for the helper, after which the caller's own
``compile`` of that kernel loads it from the cache. Which kernel goes to the helper:

- ``_core.kernel.compile_beside`` (the drivers ``call_any_layout`` compiles with a unit) and the routes with units
  (``_core.dispatch.Route``): the driver or entry kernel, while this process compiles the unit(s);
- ``group_rows`` (``unit_address(..., helper=True)``): the unit itself, while this process compiles the one_chunk
  or split_kv unit and driver that call it.

Nothing depends on the helper succeeding: if it fails, or its code is not in the cache afterwards (a cache that
cannot be written, a helper that imported another copy of fastattn), the caller compiles the kernel itself, as
without a helper; either way the machine code is Numba's for the same function and types. A helper costs about
a second of start-up (Python, NumPy and Numba) and compiles its kernel's callees again, so it is started only
where this process has a unit of seconds to compile meanwhile.

At most one helper runs per usable core but one (two cores: one helper); beyond that a kernel compiles here.
Helpers are off on a one-core machine, in a frozen application, inside a helper, and with
``FASTATTN_COMPILE_HELPERS=0`` (the warm-up's and the main job's worker processes set it: they keep every core
compiling already).
"""
from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import Callable

from . import threads as _threads

#: The environment variable that turns helpers off ("0").
ENV = "FASTATTN_COMPILE_HELPERS"
#: Seconds ``settle`` waits for a helper before compiling its kernel here (a stuck helper must not hang a call;
#: the slowest kernel compiles in well under a minute on a slow machine).
WAIT_S = 120.0

_HELPER_CODE = """
import base64, importlib, os, pickle, sys
module, name, arg_types, expected = pickle.loads(base64.b64decode(sys.argv[1]))
mod = importlib.import_module(module)
if os.path.realpath(mod.__file__) != expected:
    sys.exit(3)  # another copy of fastattn: its cache entries would not be the caller's
getattr(mod, name).compile(arg_types)
"""

_lock = threading.RLock()
_pending: dict = {}  # (dispatcher, arg_types) -> (process, then, started): deferred, not yet settled


def usable_cores() -> int:
    """The cores this process may run on (a name of its own: tests replace it)."""
    return _threads.cores()


def enabled() -> bool:
    """Whether ``defer`` may start helpers in this process: on, more than one usable core, and a Python
    interpreter to start (not a frozen application)."""
    return (os.environ.get(ENV, "1") != "0" and usable_cores() > 1 and bool(sys.executable)
            and not getattr(sys, "frozen", False))


def in_cache(dispatcher, arg_types: tuple) -> bool | None:
    """Whether Numba's on-disk cache holds ``dispatcher`` for ``arg_types``; None when that cannot be told (a
    kernel without a cache, or a Numba whose cache is laid out otherwise)."""
    try:
        cache = dispatcher._cache
        if not cache._enabled:
            return None
        key = cache._index_key(arg_types, dispatcher.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - any other Numba: no helper, compile here
        return None


def _module_of(dispatcher) -> tuple[str, str, str] | None:
    """(module, name, the module's file) when the helper can find ``dispatcher`` by importing its module."""
    func = dispatcher.py_func
    module = sys.modules.get(func.__module__)
    if module is None or getattr(module, func.__name__, None) is not dispatcher or not getattr(module, "__file__", ""):
        return None
    return func.__module__, func.__name__, os.path.realpath(module.__file__)


def _start(dispatcher, arg_types: tuple) -> subprocess.Popen | None:
    where = _module_of(dispatcher)
    if where is None:
        return None
    package_root = os.path.dirname(os.path.dirname(os.path.realpath(sys.modules["fastattn"].__file__)))
    env = dict(os.environ, **{ENV: "0"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    request = base64.b64encode(pickle.dumps((*where[:2], arg_types, where[2]))).decode()
    try:
        return subprocess.Popen([sys.executable, "-c", _HELPER_CODE, request], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except Exception:  # noqa: BLE001 - no process to be had: compile here
        return None


def defer(dispatcher, arg_types: tuple, then: Callable[[], None] | None = None) -> bool:
    """Start a helper compiling ``dispatcher`` for ``arg_types`` into Numba's cache, when it is not there, helpers
    are on and one may start. ``settle`` waits for it and then calls ``then`` (if any). False: nothing started
    (the caller compiles it itself)."""
    if not enabled():
        return False
    with _lock:
        key = (dispatcher, arg_types)
        # a kernel another thread deferred is compiled by the caller too: Numba's lock serialises the two
        if key in _pending or len(_pending) >= usable_cores() - 1 or in_cache(dispatcher, arg_types) is not False:
            return False
        process = _start(dispatcher, arg_types)
        if process is None:
            return False
        from . import notices as _notices  # imported here: this module stays importable without loading Numba
        name = _notices.describe(dispatcher, arg_types)
        _notices.emit(f"fastattn: compiling {name} in a helper process (first use; cached on disk afterwards) ...",
                      compile="start", kernel=name, helper=True)
        _pending[key] = (process, then, time.perf_counter())
        return True


def settle() -> None:
    """Wait for every helper, calling each one's ``then``: afterwards ``dispatcher.compile(arg_types)`` loads what
    a helper compiled from the cache (or compiles it, if the helper failed). Call before running anything that
    needs a deferred kernel."""
    from . import notices as _notices
    with _lock:
        while _pending:
            key, (process, then, started) = next(iter(_pending.items()))
            try:
                process.wait(timeout=max(0.0, WAIT_S - (time.perf_counter() - started)))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            del _pending[key]  # first: an error in ``then`` reaches this caller once, not every later settle
            if then is not None:
                then()
            name = _notices.describe(*key)
            seconds = time.perf_counter() - started
            _notices.emit(f"fastattn: compiled {name} in {seconds:.1f} s (helper process)", compile="end",
                          kernel=name, seconds=seconds, helper=True)


def pending() -> bool:
    """Whether any helper is still to be settled."""
    return bool(_pending)

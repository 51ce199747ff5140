"""Compile notices: one line on stderr when a call has to compile a fastattn kernel.

A first call of an op can spend seconds to tens of seconds in Numba's compiler; without a word it looks like a
hang. So each top-level compile of one of fastattn's own kernels logs one line through the ``"fastattn"``
logger when it starts, and one with the seconds it took when it ends::

    fastattn: compiling rope.drivers.drive_fused for float16 (first use; cached on disk afterwards) ...
    fastattn: compiled rope.drivers.drive_fused for float16 in 6.3 s

Nested compiles (helpers compiled while typing the kernel that calls them) stay silent, and so does loading a
kernel from Numba's on-disk cache (Numba broadcasts its ``"numba:compile"`` event only when it compiles).

The lines are logged at INFO level. When the application has configured no logging handler, they go to stderr
(as Python's ``logging.lastResort`` does for warnings); otherwise to the application's handlers. To silence
them::

    import logging
    logging.getLogger("fastattn").setLevel(logging.WARNING)

Records carry ``fastattn_compile`` ("start" or "end"), ``fastattn_kernel`` (e.g.
"rope.drivers.drive_fused for float16") and, on "end", ``fastattn_seconds``, for programs that show progress their own way (the
main job does).
"""
from __future__ import annotations

import logging
import sys
import threading
import time

from numba import types
from numba.core import event

LOGGER = logging.getLogger("fastattn")

#: How the kernels see half-precision arrays (``_core.kernel.kernel_view``): the integer type names the format;
#: Q8_0 / Q4_0 blocks travel as their bytes.
_STORAGE_NAMES = {"float32": "float32", "float64": "float64", "uint16": "float16", "int16": "bfloat16",
                  "uint8": "quantized blocks"}


class _StderrHandler(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (so redirections and notebooks see it), message only."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own policy for a failing handler
            self.handleError(record)


_fallback = _StderrHandler(logging.INFO)


def emit(message: str, **fields) -> None:
    if not LOGGER.isEnabledFor(logging.INFO):
        return
    record = LOGGER.makeRecord(LOGGER.name, logging.INFO, __file__, 0, message, (), None,
                               extra={f"fastattn_{key}": value for key, value in fields.items()})
    if LOGGER.hasHandlers():
        LOGGER.handle(record)
    else:
        _fallback.handle(record)


def describe(dispatcher, args: tuple = ()) -> str:
    """``"<module>.<name>"`` for a dispatcher of a fastattn module, the module's path inside the package with
    leading underscores dropped (``fastattn._core.kernel.apply_threads`` -> ``core.kernel.apply_threads``), followed by
    ``for <storage dtypes>`` of its array arguments' Numba types, tuples of arrays included, when any."""
    func = dispatcher.py_func
    group = ".".join(part.lstrip("_") for part in func.__module__.removeprefix("fastattn.").split("."))
    dtypes = []
    todo = list(args)
    while todo:
        arg = todo.pop(0)
        if isinstance(arg, types.BaseTuple):  # a tuple of arguments (a UniTuple has a dtype too): its items
            todo[:0] = arg.types
            continue
        name = _STORAGE_NAMES.get(str(getattr(arg, "dtype", "")))
        if name is not None and name not in dtypes:
            dtypes.append(name)
    return f"{group}.{func.__name__}" + (f" for {', '.join(dtypes)}" if dtypes else "")


def _ours(dispatcher) -> bool:
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
    return module == "fastattn" or module.startswith("fastattn.")


def _cached(dispatcher) -> bool:
    """Whether Numba writes this dispatcher's compiled code to its on-disk cache (``cache=True``)."""
    return type(getattr(dispatcher, "_cache", None)).__name__ != "NullCache"


class CompileNotices(event.Listener):
    """Listens to ``"numba:compile"``: logs the start and end of each top-level compile of a fastattn kernel."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def on_start(self, ev: event.Event) -> None:
        stack = self._stack()
        dispatcher = ev.data["dispatcher"]
        # Only the outermost compile of a thread is announced: helpers compiled inside it are part of it.
        announce = not stack and _ours(dispatcher)
        name = describe(dispatcher, tuple(ev.data.get("args") or ())) if announce else ""
        stack.append((announce, name, time.perf_counter()))
        if announce:
            where = "cached on disk afterwards" if _cached(dispatcher) else "not cached"
            emit(f"fastattn: compiling {name} (first use; {where}) ...", compile="start", kernel=name)

    def on_end(self, ev: event.Event) -> None:
        stack = self._stack()
        if not stack:
            return
        announce, name, start = stack.pop()
        # Event.is_failed is inverted in Numba (True when no exception); read the exception details directly.
        if announce and getattr(ev, "_exc_details", None) is None:
            seconds = time.perf_counter() - start
            emit(f"fastattn: compiled {name} in {seconds:.1f} s", compile="end", kernel=name, seconds=seconds)


_listener: CompileNotices | None = None
_install_lock = threading.Lock()


def install() -> None:
    """Start the notices (idempotent). Called when ``fastattn._core.kernel`` is imported, before any kernel exists.

    Sets the ``"fastattn"`` logger's level to INFO unless the application set one, so the notices show by
    default and ``setLevel(logging.WARNING)`` silences them.
    """
    global _listener
    with _install_lock:
        if _listener is not None:
            return
        if LOGGER.level == logging.NOTSET:
            LOGGER.setLevel(logging.INFO)
        _listener = CompileNotices()
        event.register("numba:compile", _listener)


install()

"""Progress of the main job on stderr: ``[k/N]``, the elapsed time, and a marker while a first call compiles.

The compile marker comes from the compile notices (``fastattn._core.notices``): while the job runs, a handler on the
``"fastattn"`` logger takes them, counts them for the case being run (its first call "compiled" or not) and shows
them as part of the progress instead of as loose lines. On a terminal the progress is one line, rewritten; in
a log or a pipe, one line per case and per compiling kernel.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from .._core import notices as _notices


def elapsed(seconds: float) -> str:
    """``12.3 s`` below a minute, ``2:05`` (minutes:seconds) above."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}:{rest:02d}"


class CompileWatch(logging.Handler):
    """Counts compile notices (and their seconds) and passes each to ``progress``, if any."""

    def __init__(self, progress: "Progress | None" = None) -> None:
        super().__init__(logging.INFO)
        self.progress = progress
        self.started = 0
        self.seconds = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        kind = getattr(record, "fastattn_compile", None)
        if kind == "start":
            self.started += 1
        elif kind == "end":
            self.seconds += getattr(record, "fastattn_seconds", 0.0)
        if kind is not None and self.progress is not None:
            self.progress.compiling(kind, getattr(record, "fastattn_kernel", ""), getattr(record, "fastattn_seconds",
                                                                                           None))

    def __enter__(self) -> "CompileWatch":
        _notices.LOGGER.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        _notices.LOGGER.removeHandler(self)


class Progress:
    """``[k/N] elapsed  label`` per case; ``compiling <kernel> ...`` while a kernel compiles."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.total = 0
        self.k = 0
        self.label = ""

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _head(self) -> str:
        width = len(str(self.total))
        return f"[{self.k:>{width}}/{self.total}] {elapsed(time.perf_counter() - self.start):>7}  "

    def preparing(self, what: str) -> None:
        """Before the cases exist: building inputs (which may compile too)."""
        self.label = what
        self._write(f"{elapsed(time.perf_counter() - self.start):>7}  {what}")

    def case(self, k: int, total: int, label: str) -> None:
        self.k, self.total, self.label = k, total, label
        self._write(self._head() + label)

    def compiling(self, kind: str, kernel: str, seconds: float | None) -> None:
        if self.tty:
            prefix = self._head() if self.total else ""
            if kind == "start":
                self._write(f"{prefix}{self.label}  [compiling {kernel} ...]")
            else:
                self._write(f"{prefix}{self.label}  [compiled {kernel} in {seconds:.1f} s]")
        elif kind == "start":
            self._write(f"{'':9}compiling {kernel} ...")
        else:
            self._write(f"{'':9}compiled {kernel} in {seconds:.1f} s")

    def finish(self) -> None:
        """Clear the terminal's status line (nothing to do in a log)."""
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()

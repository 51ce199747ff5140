"""Compile notices: one stderr line per top-level compile of a fastattn kernel, none on a cache hit, silenceable."""
import logging
import os
import re
import subprocess
import sys
import types as pytypes

import pytest
from numba import types
from numba.core import event

from fastattn._core import notices as _notices

FIRST_CALL = """
import logging, sys
import numpy as np
if len(sys.argv) > 1 and sys.argv[1] == "quiet":
    logging.getLogger("fastattn").setLevel(logging.WARNING)
import fastattn
fastattn.rms_norm(np.ones((2, 16), np.float32), 1e-5)
print("done")
"""


def _first_call(cache_dir, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-c", FIRST_CALL, *args], capture_output=True, text=True, env=env,
                          timeout=600, check=True)


def test_first_call_notices_then_a_cache_hit_is_silent(tmp_path):
    first = _first_call(tmp_path)
    assert first.stdout.strip() == "done"  # nothing on stdout
    lines = first.stderr.splitlines()
    starts = [line for line in lines if line.startswith("fastattn: compiling ")]
    assert starts, first.stderr
    assert all("(first use; cached on disk afterwards) ..." in line for line in starts)
    # one line per top-level compile of a norm kernel: the helpers compiled inside it (norm's row functions,
    # _dispatch's checks, _kernel's conversions) are not announced
    assert all(line.startswith("fastattn: compiling norm.api.") and " for float32 " in line for line in starts)
    assert not any("_norm_row" in line or "_norm_vec" in line for line in lines), first.stderr
    ends = [line for line in lines if line.startswith("fastattn: compiled norm.api.")]
    assert len(ends) == len(starts) and all(re.search(r" in \d+\.\d s$", line) for line in ends)

    second = _first_call(tmp_path)
    assert "fastattn:" not in second.stderr, second.stderr


def test_warning_level_silences_the_notices(tmp_path):
    quiet = _first_call(tmp_path, "quiet")
    assert quiet.stdout.strip() == "done"
    assert "fastattn:" not in quiet.stderr, quiet.stderr
    assert list(tmp_path.rglob("*.nbi"))  # it did compile (and cache): the silence is the logger's


# ---------------------------------------------------------------------------------------------------------------
# The listener on synthetic events (no compilation).
def _dispatcher(module: str, name: str):
    def py_func():
        pass
    py_func.__module__, py_func.__name__ = module, name
    return pytypes.SimpleNamespace(py_func=py_func, _cache=object())


def _compile(listener, dispatcher, args=(), nested=()):
    data = {"dispatcher": dispatcher, "args": args, "return_type": None}
    listener.notify(event.Event("numba:compile", event.EventStatus.START, data))
    for inner in nested:
        _compile(listener, inner)
    listener.notify(event.Event("numba:compile", event.EventStatus.END, data))


@pytest.fixture
def records():
    """The notices' records, through a handler of the application's (so the stderr fallback stays out)."""
    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record)

    handler = Keep()
    _notices.LOGGER.addHandler(handler)
    try:
        yield got
    finally:
        _notices.LOGGER.removeHandler(handler)


def test_nested_and_foreign_compiles_are_not_announced(records):
    listener = _notices.CompileNotices()
    kernel = _dispatcher("fastattn.rope.drivers", "drive_fused")
    helper = _dispatcher("fastattn.rope.rotate", "rotate_rows_adjacent")
    args = (types.Array(types.uint16, 3, "A"), types.Array(types.int32, 1, "C"), types.float64)
    _compile(listener, kernel, args, nested=[helper])
    _compile(listener, _dispatcher("mymodel.kernels", "fused"), nested=[helper])
    assert [r.getMessage() for r in records][0] == (
        "fastattn: compiling rope.drivers.drive_fused for float16 (first use; cached on disk afterwards) ...")
    assert [r.fastattn_compile for r in records] == ["start", "end"]
    assert records[1].getMessage().startswith("fastattn: compiled rope.drivers.drive_fused for float16 in ")
    assert records[1].fastattn_seconds >= 0


def test_bfloat16_views_and_uncached_kernels_are_named(records):
    listener = _notices.CompileNotices()
    uncached = _dispatcher("fastattn.attention.tiled", "run")
    uncached._cache = type("NullCache", (), {})()
    _compile(listener, uncached, (types.Array(types.float32, 4, "A"), types.Array(types.int16, 4, "A")))
    assert records[0].getMessage() == (
        "fastattn: compiling attention.tiled.run for float32, bfloat16 (first use; not cached) ...")


def test_without_handlers_the_notice_goes_to_stderr(capsys, monkeypatch):
    monkeypatch.setattr(_notices.LOGGER, "propagate", False)  # no handler on the logger or above it
    assert not _notices.LOGGER.hasHandlers()
    _compile(_notices.CompileNotices(), _dispatcher("fastattn.norm.api", "_norm_serial"))
    err = capsys.readouterr().err
    assert err.startswith("fastattn: compiling norm.api._norm_serial (first use; cached on disk afterwards)")


def test_warning_level_silences_the_fallback_too(capsys, monkeypatch):
    monkeypatch.setattr(_notices.LOGGER, "propagate", False)
    level = _notices.LOGGER.level
    _notices.LOGGER.setLevel(logging.WARNING)
    try:
        _compile(_notices.CompileNotices(), _dispatcher("fastattn.norm.api", "_norm_serial"))
    finally:
        _notices.LOGGER.setLevel(level)
    assert capsys.readouterr().err == ""


def test_tuples_of_arrays_name_their_dtypes_and_names_do_not_repeat_kernel(records):
    """A float16 call whose K and V travel in a tuple is named float16; the module path names the kernel once."""
    listener = _notices.CompileNotices()
    kv = types.UniTuple(types.Array(types.uint16, 4, "A"), 2)
    _compile(listener, _dispatcher("fastattn.attention.group", "group_rows"), (types.Array(types.float32, 4, "A"), kv))
    _compile(listener, _dispatcher("fastattn._core.kernel", "apply_threads"), (types.int64,))
    quantized = types.UniTuple(types.Array(types.uint8, 4, "A"), 2)
    _compile(listener, _dispatcher("fastattn.attention.group", "group_rows"), (types.Array(types.float32, 4, "A"),
                                                                              quantized))
    messages = [r.getMessage() for r in records if r.fastattn_compile == "start"]
    assert messages[0].startswith("fastattn: compiling attention.group.group_rows for float32, float16 ")
    assert messages[1].startswith("fastattn: compiling core.kernel.apply_threads (first use")
    assert messages[2].startswith("fastattn: compiling attention.group.group_rows for float32, quantized blocks ")

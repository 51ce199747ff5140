"""A cold first call compiles a kernel in a helper process beside its own compiles, and works without one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fastattn._core import helper_compile as _helper_compile
from fastattn._core.kernel import HANDLE_TYPE, unit_address

#: A process with an empty Numba cache makes one fused rope_ext call (the route compiles its unit here and its
#: entry kernel in a helper), and reports its compile notices, the result and whether the entry kernel is cached.
_CHILD = textwrap.dedent("""
    import json, logging, sys
    import numpy as np
    import fastattn
    from fastattn._core import helper_compile as _helper_compile
    from fastattn.rope import routes as _rope_routes
    from fastattn.reference import rope_ext as reference_rope_ext
    if sys.argv[1] == "failing helper":
        _helper_compile._HELPER_CODE = "import sys; sys.exit(1)"
    records = []
    class Collect(logging.Handler):
        def emit(self, record):
            records.append([record.fastattn_compile, record.getMessage()])
    logging.getLogger("fastattn").addHandler(Collect())
    x = np.random.default_rng(0).standard_normal((64, 4, 64)).astype(np.float32)
    pos = np.arange(64, dtype=np.int32)
    got = fastattn.rope_ext(x, pos, n_dims=64, mode=fastattn.ROPE_NEOX)
    want = reference_rope_ext(x, pos, n_dims=64, mode=fastattn.ROPE_NEOX)
    entry = _rope_routes.FUSED.kernel
    print(json.dumps(dict(records=records, error=float(np.abs(got - want).max()),
                          cached=[_helper_compile.in_cache(entry, sig) for sig in entry.signatures])))
""")


def _cold_call(tmp_path, mode: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"), **{_helper_compile.ENV: "1"})
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


needs_two_cores = pytest.mark.skipif(_helper_compile.usable_cores() < 2, reason="helpers need a second core")


@needs_two_cores
def test_a_cold_route_compiles_its_entry_kernel_in_a_helper(tmp_path):
    result = _cold_call(tmp_path, "helper")
    messages = [message for _, message in result["records"]]
    helped = [m for m in messages if "fused_entry" in m]
    assert len(helped) == 2 and "in a helper process" in helped[0] and "(helper process)" in helped[1], messages
    # the unit compiled here meanwhile, between the helper's start and end
    unit = [i for i, m in enumerate(messages) if "compiling rope.drivers._fused_tasks" in m]
    assert unit and messages.index(helped[0]) < unit[0] < messages.index(helped[1])
    assert result["cached"] == [True]
    assert result["error"] < 1e-5


@needs_two_cores
def test_a_failing_helper_leaves_the_compile_to_the_caller(tmp_path):
    result = _cold_call(tmp_path, "failing helper")
    messages = [message for _, message in result["records"]]
    # the helper's end is reported, then the entry kernel compiles here as without a helper
    ended = next(i for i, m in enumerate(messages) if "fused_entry" in m and "(helper process)" in m)
    assert any("compiling rope.routes.fused_entry" in m and "helper" not in m for m in messages[ended:])
    assert result["cached"] == [True]  # this process cached it
    assert result["error"] < 1e-5


def test_helpers_are_off_when_asked_or_on_one_core(monkeypatch):
    monkeypatch.setenv(_helper_compile.ENV, "0")
    assert not _helper_compile.enabled()
    monkeypatch.setenv(_helper_compile.ENV, "1")
    monkeypatch.setattr(_helper_compile, "usable_cores", lambda: 1)
    assert not _helper_compile.enabled()


def test_a_deferred_units_handle_runs_nothing_until_settled(monkeypatch):
    """Until ``settle`` fills it, a deferred unit's handle matches no call: a driver run with it does nothing
    and ``check_unit`` raises (never a jump to address 0)."""
    import numba
    from fastattn._core import kernel as _kernel

    started = []

    def fake_defer(dispatcher, arg_types, then=None):
        started.append(then)
        _helper_compile._pending[(dispatcher, arg_types)] = (subprocess.Popen([sys.executable, "-c", ""]), then, 0.0)
        return True

    @numba.njit(cache=False)
    def add_one(a):
        a[0] += 1.0

    @numba.njit(cache=False)
    def driver(handle, a):
        _kernel.call_unit(handle, (a,))

    monkeypatch.setattr(_helper_compile, "defer", fake_defer)
    arg_types = (numba.types.Array(numba.types.float32, 1, "C"),)
    handle = unit_address(add_one, arg_types, helper=True)
    assert started and handle[0] == 0 and handle[1] == _kernel._NOT_READY
    a = np.zeros(1, np.float32)
    driver(handle, a)
    assert a[0] == 0.0
    with pytest.raises(RuntimeError, match="internal error"):
        _kernel.check_unit(handle)
    handle[2] = 0
    _kernel.settle_units()
    assert not _helper_compile.pending() and handle[0] != 0
    driver(handle, a)
    assert a[0] == 1.0
    assert numba.typeof(handle) == HANDLE_TYPE

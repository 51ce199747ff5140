"""The on-disk kernel cache is keyed on the whole package's sources: an edited helper in another file takes
effect in the next process, where Numba's own per-file check would load the old machine code."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import fastattn

PACKAGE = Path(fastattn.__file__).resolve().parent
#: rms_norm_mul of ones by a weight of 3: the norm kernel widens both through ``to_f32``, defined elsewhere.
SCRIPT = ("import numpy as np, fastattn\n"
          "x = np.ones((1, 64), np.float32); w = np.full(64, 3, np.float32)\n"
          "print(float(fastattn.rms_norm_mul(x, w, eps=0.0)[0, 0]))\n")


def _helper_module(root: Path) -> Path:
    """The file that defines ``widen`` (the LLVM widening of one element that ``to_f32`` emits) in the copy."""
    (found,) = [p for p in root.rglob("*.py") if "def widen(builder, value, dtype)" in p.read_text()]
    return found


def _run(copy: Path, cache: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(copy), NUMBA_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=str(copy), env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


def test_an_edited_helper_in_another_file_takes_effect(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(PACKAGE, copy / "fastattn", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    assert _run(copy, cache) == 3.0
    assert _run(copy, cache) == 3.0  # from the cache

    helper = _helper_module(copy / "fastattn")
    source = helper.read_text()
    widen_float = "if dtype == types.float32:\n        return value\n"
    assert source.count(widen_float) == 1
    helper.write_text(source.replace(widen_float, widen_float.replace(
        "return value", "return builder.fmul(value, ir.Constant(ir.FloatType(), 2.0))")))
    # x and w both doubled on widening: (2 / rms(2)) * 6
    assert _run(copy, cache) == 6.0
    assert len([d for d in (cache / "fastattn").iterdir() if d.is_dir()]) == 2  # one directory per source hash


def test_the_reference_is_not_part_of_the_key(tmp_path):
    from fastattn._core import source_cache as _source_cache

    copy = tmp_path / "fastattn"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = _source_cache.source_hash(copy)
    (copy / "reference" / "__init__.py").write_text((copy / "reference" / "__init__.py").read_text() + "\n# x\n")
    assert _source_cache.source_hash(copy) == before
    (copy / "__init__.py").write_text((copy / "__init__.py").read_text() + "\n# x\n")
    assert _source_cache.source_hash(copy) != before

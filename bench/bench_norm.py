"""RMSNorm family: fast vs reference vs torch, beside a copy of the same bytes, at 1 and 2 threads.

Groups: ``rms_norm_mul (512, 4096)``, ``rms_norm_mul (1, 4096)``, ``add_rms_norm_mul (512, 4096)``, float32: the
main job's layer (``fastattn.jobs.LAYER``: prefill rows x hidden, and a decode row).
``extra_info``: GB/s (bytes read + written) and, for fast, ``vs_copy``: its GB/s over the copy's in this run.
"""
import numpy as np
import pytest

import fastattn
import fastattn.reference as ref
from conftest import THREADS, copy_baseline, measure, torch_or_none
from fastattn.jobs import LAYER

EPS, N, D = LAYER.eps, LAYER.n_prefill, LAYER.hidden
CASES = {  # group -> (op, rows)
    f"rms_norm_mul ({N}, {D}) f32": ("rms_norm_mul", N),
    f"rms_norm_mul (1, {D}) f32": ("rms_norm_mul", 1),
    f"add_rms_norm_mul ({N}, {D}) f32": ("add_rms_norm_mul", N),
}
IMPLS = ["copy", "fast", "reference", "torch"]  # copy first: fast's vs_copy needs it
_copy_gbs: dict[tuple[str, int], float] = {}


def _inputs(rows):
    rng = np.random.default_rng(0)
    x, residual = (rng.standard_normal((rows, D)).astype(np.float32) for _ in range(2))
    return x, residual, rng.standard_normal(D).astype(np.float32)


def _nbytes(op, x):
    return (2 if op == "rms_norm_mul" else 4) * x.nbytes


def _call(impl, op, x, residual, w):
    out, s = np.empty_like(x), np.empty_like(x)
    if impl == "copy":
        return copy_baseline(_nbytes(op, x))
    module = fastattn if impl == "fast" else ref
    if op == "rms_norm_mul":
        return lambda: module.rms_norm_mul(x, w, EPS, out=out)
    return lambda: module.add_rms_norm_mul(x, residual, w, EPS, out=out, sum_out=s)


def _torch_call(op, x, residual, w):
    torch = torch_or_none()
    if torch is None:
        pytest.skip("torch is not installed")
    tx, tr, tw = (torch.from_numpy(a) for a in (x, residual, w))

    def norm(t):
        return torch.nn.functional.rms_norm(t, (t.shape[-1],), tw, EPS)
    if op == "rms_norm_mul":
        return lambda: norm(tx)
    return lambda: norm(tx + tr)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("group", list(CASES))
def test_norm(benchmark, group, impl, threads):
    op, rows = CASES[group]
    x, residual, w = _inputs(rows)
    fn = _torch_call(op, x, residual, w) if impl == "torch" else _call(impl, op, x, residual, w)
    measure(benchmark, fn, group=group, threads=threads, nbytes=_nbytes(op, x))
    gbs = benchmark.extra_info.get("GB/s")
    if gbs is None:  # --benchmark-disable
        return
    if impl == "copy":
        _copy_gbs[group, threads] = gbs
    elif impl == "fast" and _copy_gbs.get((group, threads)):
        benchmark.extra_info["vs_copy"] = round(gbs / _copy_gbs[group, threads], 2)

"""The ops of ``examples/llama_layer.py`` timed where they run: inside the layer, between NumPy's matmuls.

A model calls each op between matmuls and other libraries' threads, not in a loop. Here the example's Llama-3-8B
layer (32 / 8 heads x 128, FFN 14336, float16 KV cache) runs decode tokens at context ``N_CTX`` and prefills of
``N_PREFILL`` tokens, alternating 1 and 2 threads from token to token (the order rotating), with NumPy's BLAS on
as many threads as a user leaves it (all cores; the other benchmarks pin it to one) and fastattn's default thread
rule ("measured": each call site above the size rule runs on the threads or on one, whichever it has timed
faster; 2 x TRIES untimed tokens at 2 threads let it try both first). For every op the group
records, in ``extra_info``, its median time in the layer at 1 and 2 threads and its median time called back to
back with the same arguments (the last call of the layer replayed in a loop), in microseconds.

``test_pool_wake`` measures what a parallel launch costs when Numba's thread pool has been idle: an empty
``prange`` kernel after 0-100 ms of sleep and right after a matmul.

Run it as a user leaves the OpenMP runtime, then as torch and ggml users often run it::

    python -m pytest bench/bench_layer.py --benchmark-group-by=group
    OMP_WAIT_POLICY=PASSIVE python -m pytest bench/bench_layer.py --benchmark-group-by=group

``extra_info["omp_wait_policy"]`` says which one a table came from; ``FASTATTN_THREAD_RULE=fixed`` in front runs
the layer with every ``prange`` kernel on the thread count it names (``extra_info["thread_rule"]``).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import threadpoolctl
from conftest import measure
from numba import prange

import fastattn
from fastattn._core import threads as _threads
from fastattn._core.kernel import kernel
from fastattn.jobs.timing import Rounds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from example_layer import load_example  # noqa: E402

N_CTX = 4096
N_PREFILL = 512
DECODE_ROUNDS = 24
PREFILL_ROUNDS = 8
#: fastattn's thread rule in the layer: the default unless FASTATTN_THREAD_RULE names another
RULE = os.environ.get("FASTATTN_THREAD_RULE", "measured")
BACK_TO_BACK = 30
#: the layer's fastattn steps and the public calls each one makes
STEP_CALLS = {"rms_norm_mul": ("rms_norm_mul",), "rope": ("rope_cache", "apply_rope_cache"),
              "rope_set_rows": ("rope_set_rows",), "set_rows": ("set_rows",), "flash_attn_ext": ("flash_attn_ext",),
              "add_rms_norm_mul": ("add_rms_norm_mul",)}


class Recorder:
    """Stands in for the ``fastattn`` module in the example: forwards every call and keeps the last arguments of
    each public op, so that the op can be replayed back to back."""

    def __init__(self):
        self.calls: dict[str, tuple] = {}

    def __getattr__(self, name):
        fn = getattr(fastattn, name)
        if not any(name in calls for calls in STEP_CALLS.values()):
            return fn

        def recorded(*args, **kwargs):
            self.calls[name] = (fn, args, kwargs)
            return fn(*args, **kwargs)
        return recorded


@pytest.fixture(scope="module")
def example():
    module = load_example()
    module.fastattn = Recorder()
    return module


@pytest.fixture
def user_blas():
    """NumPy's BLAS on every core and fastattn's default thread rule while the test runs (as a user leaves
    them); back to one BLAS thread and the benchmarks' fixed rule after."""
    with threadpoolctl.threadpool_limits(_threads.cores(), user_api="blas"):
        _threads.set_thread_rule(RULE)
        yield
        _threads.set_thread_rule("fixed")


def _layer(example, n_tokens: int):
    config = example.LlamaConfig(max_ctx=N_CTX + 4 * DECODE_ROUNDS + 8)
    layer = example.LlamaLayer(example.LayerWeights.random(config), config, np.float16, ops=example.fastattn)
    rng = np.random.default_rng(1)
    layer.k_cache[:N_CTX] = rng.standard_normal(layer.k_cache[:N_CTX].shape).astype(np.float16)
    layer.v_cache[:N_CTX] = rng.standard_normal(layer.v_cache[:N_CTX].shape).astype(np.float16)
    x = rng.standard_normal((n_tokens, config.hidden)).astype(np.float32)
    return layer, x


def _back_to_back(recorder, step: str, threads: int) -> float:
    """Median seconds of the step's last calls replayed in a loop on ``threads`` threads."""
    calls = [recorder.calls[name] for name in STEP_CALLS[step]]
    times = []
    with fastattn.num_threads(threads):
        for _ in range(BACK_TO_BACK):
            start = time.perf_counter()
            for fn, args, kwargs in calls:
                fn(*args, **kwargs)
            times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def _run_layer(benchmark, example, stage: str, rounds: int):
    n_tokens = 1 if stage == "decode" else N_PREFILL
    layer, x = _layer(example, n_tokens)
    pos = {"next": N_CTX}
    per_threads: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}

    def token(threads: int):
        if stage == "decode":
            at = np.array([pos["next"]], np.int32)
            pos["next"] += 1
        else:
            at = np.arange(n_tokens, dtype=np.int32)
        with fastattn.num_threads(threads):
            layer.forward(x, at)
        for step, spent in layer.times.items():
            per_threads[threads].setdefault(step, []).append(spent)
        layer.times.clear()

    def both():
        order = (1, 2) if len(per_threads[1].get("matmul", ())) % 2 == 0 else (2, 1)
        for threads in order:
            token(threads)

    # compiles or loads every kernel both thread counts take, and lets the measured rule try both of its
    # choices at every call site (TRIES calls each) before the timed rounds
    token(1)
    for _ in range(2 * _threads.TRIES):
        token(2)
    for times in per_threads.values():
        times.clear()
    measure(benchmark, both, group=f"layer {stage}: ops in the layer vs back to back", threads=2,
            rounds=rounds)
    if benchmark.stats is None:
        return
    info = benchmark.extra_info
    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "(unset)")
    info["thread_rule"] = RULE
    info["blas_threads"] = _threads.cores()
    for step in STEP_CALLS:
        for threads in (1, 2):
            info[f"{step} in layer {threads}t us"] = round(float(np.median(per_threads[threads][step])) * 1e6, 1)
        for threads in (1, 2):
            info[f"{step} back to back {threads}t us"] = round(_back_to_back(example.fastattn, step, threads) * 1e6,
                                                                 1)


def test_layer_decode(benchmark, example, user_blas):
    _run_layer(benchmark, example, "decode", DECODE_ROUNDS)


def test_layer_prefill(benchmark, example, user_blas):
    _run_layer(benchmark, example, "prefill", PREFILL_ROUNDS)


@kernel(parallel=True)
def _touch(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0


IDLE_S = (0.0, 0.003, 0.01, 0.03, 0.1)


def test_pool_wake(benchmark, user_blas):
    """An empty 2-thread ``prange`` launch after the pool idled 0-100 ms, and right after a 2048^2 matmul."""
    import numba

    a = np.zeros(2)
    m = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    numba.set_num_threads(2)
    _touch(a)
    waits = [lambda s=s: time.sleep(s) for s in IDLE_S] + [lambda: m @ m]
    names = [f"after {s * 1e3:g} ms idle" for s in IDLE_S] + ["after a matmul"]
    timed = Rounds(names)

    def each():
        for name, wait in zip(names, waits):
            wait()
            timed.time(name, _touch, a)

    measure(benchmark, each, group="layer: waking the thread pool", threads=2, rounds=10)
    if benchmark.stats is None:
        return
    benchmark.extra_info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "(unset)")
    for name, median in timed.medians().items():
        benchmark.extra_info[f"{name} us"] = round(median * 1e6, 1)

"""Compile time of every op's first call, cold (empty Numba cache) and warm (cache filled, new process).

    python bench/compile_times.py                      # every case, 2 threads, a markdown table on stdout
    python bench/compile_times.py --threads 1 --only attention
    python bench/compile_times.py --only combinations

Each case is one public call on inputs of a layer of the main job's model (32 query heads, 8 KV heads, head
size 128); the "combinations" group adds other dtype combinations, layouts, modes and options. It runs twice, each time in a fresh Python process: first with an empty ``NUMBA_CACHE_DIR`` of its own
(everything the call needs is compiled: the "cold" figure the first-use budget bounds at 10 s), then again
with that cache filled (the "warm" figure: loading the machine code, bounded at 0.5 s). The process reports
the call's wall and CPU seconds and the kernels fastattn's compile notices named, with their seconds.
Imports (NumPy, Numba, fastattn) are not counted. The first row times Numba's own start-up alone (its
registries, loaded at a process's first Numba call, whatever the op): the warm figures of the cases that call no
kernel while building their inputs include it. The table goes in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from fastattn.jobs.report import markdown, markdown_row

#: Setup shared by the "combinations" cases: bfloat16 and a K/V maker for any storage type.
_COMBINATION = """
import ml_dtypes
bf = ml_dtypes.bfloat16
def _kv(shape, dtype):
    a = rng.standard_normal(shape).astype(np.float32)
    return fastattn.quantize(a, dtype) if dtype in ("q8_0", "q4_0") else a.astype(dtype)
"""

#: name -> (op group, setup code defining ``call``). Shapes: one layer of the main job's model.
CASES = {
    # what every process's first Numba call pays once, whatever the op: Numba loading its typing and lowering
    # registries (the warm figures of cases that call no kernel while building their inputs include it)
    "Numba's start-up alone (no fastattn kernel)": ("startup", """
from numba.core.registry import cpu_target
call = lambda: cpu_target.target_context.refresh()"""),
    "rms_norm_mul (512, 4096) f32": ("norm", """
x = rng.standard_normal((512, 4096)).astype(np.float32); w = np.ones(4096, np.float32)
call = lambda: fastattn.rms_norm_mul(x, w, 1e-5)"""),
    "rms_norm_mul (1, 4096) f32": ("norm", """
x = rng.standard_normal((1, 4096)).astype(np.float32); w = np.ones(4096, np.float32)
call = lambda: fastattn.rms_norm_mul(x, w, 1e-5)"""),
    "add_rms_norm_mul (512, 4096) f16": ("norm", """
x = rng.standard_normal((512, 4096)).astype(np.float16); r = x.copy(); w = np.ones(4096, np.float32)
call = lambda: fastattn.add_rms_norm_mul(x, r, w, 1e-5)"""),
    "set_rows (512, 1024) f32 -> f16 cache": ("set_rows", """
cache = np.zeros((4096, 1024), np.float16); src = rng.standard_normal((512, 1024)).astype(np.float32)
idx = np.arange(512, dtype=np.int64)
call = lambda: fastattn.set_rows(cache, src, idx)"""),
    "set_rows (1, 1024) f32 -> f16 cache": ("set_rows", """
cache = np.zeros((4096, 1024), np.float16); src = rng.standard_normal((1, 1024)).astype(np.float32)
idx = np.arange(1, dtype=np.int64)
call = lambda: fastattn.set_rows(cache, src, idx)"""),
    "rope_ext (512, 32, 128) f32 NEOX": ("rope", """
x = rng.standard_normal((512, 32, 128)).astype(np.float32); pos = np.arange(512, dtype=np.int32)
call = lambda: fastattn.rope_ext(x, pos, n_dims=128, mode=fastattn.ROPE_NEOX, freq_base=500000.0)"""),
    "rope_ext (1, 32, 128) f32 NEOX": ("rope", """
x = rng.standard_normal((1, 32, 128)).astype(np.float32); pos = np.arange(1, dtype=np.int32)
call = lambda: fastattn.rope_ext(x, pos, n_dims=128, mode=fastattn.ROPE_NEOX, freq_base=500000.0)"""),
    "rope_ext (512, 32, 128) f16 NORMAL": ("rope", """
x = rng.standard_normal((512, 32, 128)).astype(np.float16); pos = np.arange(512, dtype=np.int32)
call = lambda: fastattn.rope_ext(x, pos, n_dims=128, mode=fastattn.ROPE_NORMAL)"""),
    "apply_rope_cache (1, 32, 128) f32 in place": ("rope", """
x = rng.standard_normal((1, 32, 128)).astype(np.float32)
cache = fastattn.rope_cache(np.arange(1, dtype=np.int32), n_dims=128, mode=fastattn.ROPE_NEOX)
call = lambda: fastattn.apply_rope_cache(x, cache, out=x)"""),
    "rope_set_rows (512, 8, 128) f32 -> f16 cache": ("rope", """
x = rng.standard_normal((512, 8, 128)).astype(np.float32); pos = np.arange(512, dtype=np.int32)
kv = np.zeros((4096, 8, 128), np.float16); idx = np.arange(512, dtype=np.int64)
call = lambda: fastattn.rope_set_rows(kv, x, pos, idx, n_dims=128, mode=fastattn.ROPE_NEOX)"""),
    "flash_attn_ext decode Nkv 512 f32 K/V": ("attention", """
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = rng.standard_normal((1, 8, 512, 128)).astype(np.float32); v = k.copy()
call = lambda: fastattn.flash_attn_ext(q, k, v, scale=128 ** -0.5)"""),
    "flash_attn_ext decode Nkv 512 f16 K/V": ("attention", """
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = rng.standard_normal((1, 8, 512, 128)).astype(np.float16); v = k.copy()
call = lambda: fastattn.flash_attn_ext(q, k, v, scale=128 ** -0.5)"""),
    "flash_attn_ext decode Nkv 4096 f16 K/V, f16 mask": ("attention", """
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = rng.standard_normal((1, 8, 4096, 128)).astype(np.float16); v = k.copy()
mask = np.zeros((1, 4096), np.float16)
call = lambda: fastattn.flash_attn_ext(q, k, v, mask, scale=128 ** -0.5)"""),
    "flash_attn_ext decode Nkv 512 bf16 K/V": ("attention", """
import ml_dtypes
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = rng.standard_normal((1, 8, 512, 128)).astype(ml_dtypes.bfloat16); v = k.copy()
call = lambda: fastattn.flash_attn_ext(q, k, v, scale=128 ** -0.5)"""),
    "flash_attn_ext prefill 512 causal f16 K/V": ("attention", """
q = rng.standard_normal((1, 32, 512, 128)).astype(np.float32)
k = rng.standard_normal((1, 8, 512, 128)).astype(np.float16); v = k.copy()
mask = np.triu(np.full((512, 512), -np.inf, np.float32), 1).astype(np.float16)
call = lambda: fastattn.flash_attn_ext(q, k, v, mask, scale=128 ** -0.5)"""),
    "set_rows (512, 1024) f32 -> q8_0 cache": ("quantized", """
cache = fastattn.quantize(np.zeros((4096, 1024), np.float32), "q8_0")
src = rng.standard_normal((512, 1024)).astype(np.float32); idx = np.arange(512, dtype=np.int64)
call = lambda: fastattn.set_rows(cache, src, idx)"""),
    "rope_set_rows (512, 8, 128) f32 -> q8_0 cache": ("quantized", """
x = rng.standard_normal((512, 8, 128)).astype(np.float32); pos = np.arange(512, dtype=np.int32)
kv = fastattn.quantize(np.zeros((4096, 8, 128), np.float32), "q8_0"); idx = np.arange(512, dtype=np.int64)
call = lambda: fastattn.rope_set_rows(kv, x, pos, idx, n_dims=128, mode=fastattn.ROPE_NEOX)"""),
    "flash_attn_ext decode Nkv 4096 q8_0 K/V": ("quantized", """
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = fastattn.quantize(rng.standard_normal((1, 8, 4096, 128)).astype(np.float32), "q8_0"); v = k
call = lambda: fastattn.flash_attn_ext(q, k, v, scale=128 ** -0.5)"""),
    "flash_attn_ext prefill 512 causal q8_0 K/V": ("quantized", """
q = rng.standard_normal((1, 32, 512, 128)).astype(np.float32)
k = fastattn.quantize(rng.standard_normal((1, 8, 512, 128)).astype(np.float32), "q8_0"); v = k
mask = np.triu(np.full((512, 512), -np.inf, np.float32), 1).astype(np.float16)
call = lambda: fastattn.flash_attn_ext(q, k, v, mask, scale=128 ** -0.5)"""),
    # other dtype combinations, layouts, modes and options: the first-use budget covers any combination
    "flash_attn_ext decode Nkv 512 K f32, V f16": ("combinations", _COMBINATION + """
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = _kv((1,8,512,128), np.float32); v = _kv((1,8,512,128), np.float16)
call = lambda: fastattn.flash_attn_ext(q, k, v, scale=0.08)"""),
    "flash_attn_ext decode Nkv 512 K q8_0, V f16": ("combinations", _COMBINATION + """
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = _kv((1,8,512,128), "q8_0"); v = _kv((1,8,512,128), np.float16)
call = lambda: fastattn.flash_attn_ext(q, k, v, scale=0.08)"""),
    "flash_attn_ext split_kv Nkv 4096 q4_0 K/V, f32 mask": ("combinations", _COMBINATION + """
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = _kv((1,8,4096,128), "q4_0"); v = k; m = np.zeros((1,4096), np.float32)
call = lambda: fastattn.flash_attn_ext(q, k, v, m, scale=0.08, path="split_kv")"""),
    "flash_attn_ext decode Nkv 2048 bf16 K/V, f16 mask, ALiBi, softcap, sinks": ("combinations", _COMBINATION + """
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
k = _kv((1,8,2048,128), bf); v = k; m = np.zeros((1,2048), np.float16)
call = lambda: fastattn.flash_attn_ext(q, k, v, m, scale=0.08, max_bias=8.0, logit_softcap=30.0, sinks=np.zeros(32, np.float32))"""),
    "flash_attn_ext prefill 256 causal bf16 K/V": ("combinations", _COMBINATION + """
q = rng.standard_normal((1, 32, 256, 128)).astype(np.float32)
k = _kv((1,8,256,128), bf); v = k
m = np.triu(np.full((256, 256), -np.inf, np.float32), 1).astype(np.float16)
call = lambda: fastattn.flash_attn_ext(q, k, v, m, scale=0.08)"""),
    "flash_attn_ext prefill 128 f32 K/V, per-head f32 mask, softcap, DK 64 DV 32": ("combinations", _COMBINATION + """
q = rng.standard_normal((2, 8, 128, 64)).astype(np.float32)
k = _kv((2,2,128,64), np.float32); v = _kv((2,2,128,32), np.float32)
m = np.zeros((2, 8, 128, 128), np.float32)
call = lambda: fastattn.flash_attn_ext(q, k, v, m, scale=0.1, logit_softcap=20.0)"""),
    "flash_attn_ext one_chunk 64 rows, K f16, V q4_0, f16 mask": ("combinations", _COMBINATION + """
q = rng.standard_normal((1, 8, 64, 64)).astype(np.float32)
k = _kv((1,2,256,64), np.float16); v = _kv((1,2,256,64), "q4_0")
m = np.zeros((64, 256), np.float16)
call = lambda: fastattn.flash_attn_ext(q, k, v, m, scale=0.1, path="one_chunk")"""),
    "flash_attn_ext prefill 256 causal q4_0 K/V": ("combinations", _COMBINATION + """
q = rng.standard_normal((1, 32, 256, 128)).astype(np.float32)
k = _kv((1,8,256,128), "q4_0"); v = k
m = np.triu(np.full((256, 256), -np.inf, np.float32), 1).astype(np.float16)
call = lambda: fastattn.flash_attn_ext(q, k, v, m, scale=0.08)"""),
    "flash_attn_ext decode Nkv 2048 f16 K/V, token-major cache view": ("combinations", _COMBINATION + """
q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
c = _kv((1,2048,8,128), np.float16); k = c.transpose(0,2,1,3); v = k
call = lambda: fastattn.flash_attn_ext(q, k, v, scale=0.08)"""),
    "rope_ext (64, 16, 128) f16 MROPE": ("combinations", _COMBINATION + """
x = rng.standard_normal((64, 16, 128)).astype(np.float16); pos = np.tile(np.arange(64, dtype=np.int32), (4, 1))
call = lambda: fastattn.rope_ext(x, pos, n_dims=128, mode=fastattn.ROPE_MROPE, sections=[16, 24, 24, 0])"""),
    "rope_ext (64, 16, 128) f32 VISION": ("combinations", _COMBINATION + """
x = rng.standard_normal((64, 16, 128)).astype(np.float32); pos = np.tile(np.arange(64, dtype=np.int32), (4, 1))
call = lambda: fastattn.rope_ext(x, pos, n_dims=64, mode=fastattn.ROPE_VISION, sections=[32, 32, 0, 0])"""),
    "rope_ext (512, 32, 128) f32 NORMAL, freq_factors, in place on a QKV view": ("combinations", _COMBINATION + """
qkv = rng.standard_normal((512, 48, 128)).astype(np.float32); x = qkv[:, :32]; pos = np.arange(512, dtype=np.int32)
ff = np.ones(64, np.float32)
call = lambda: fastattn.rope_ext(x, pos, n_dims=128, mode=fastattn.ROPE_NORMAL, freq_factors=ff, out=x)"""),
    "rope_set_rows (512, 8, 128) f16 -> bf16 cache": ("combinations", _COMBINATION + """
x = rng.standard_normal((512, 8, 128)).astype(np.float16); pos = np.arange(512, dtype=np.int32)
kv = np.zeros((4096, 8, 128), bf); idx = np.arange(512, dtype=np.int64)
call = lambda: fastattn.rope_set_rows(kv, x, pos, idx, n_dims=128, mode=fastattn.ROPE_NEOX)"""),
    "rope_set_rows (512, 8, 128) f16 -> q4_0 cache": ("combinations", _COMBINATION + """
x = rng.standard_normal((512, 8, 128)).astype(np.float16); pos = np.arange(512, dtype=np.int32)
kv = fastattn.quantize(np.zeros((4096, 8, 128), np.float32), "q4_0"); idx = np.arange(512, dtype=np.int64)
call = lambda: fastattn.rope_set_rows(kv, x, pos, idx, n_dims=128, mode=fastattn.ROPE_NORMAL)"""),
    "rope_set_rows (1, 8, 128) f32 -> f32 cache": ("combinations", _COMBINATION + """
x = rng.standard_normal((1, 8, 128)).astype(np.float32); pos = np.arange(1, dtype=np.int32)
kv = np.zeros((4096, 8, 128), np.float32); idx = np.arange(1, dtype=np.int64)
call = lambda: fastattn.rope_set_rows(kv, x, pos, idx, n_dims=128, mode=fastattn.ROPE_NEOX)"""),
    "apply_rope_cache_set_rows (512, 8, 128) f32 -> f16 cache": ("combinations", _COMBINATION + """
x = rng.standard_normal((512, 8, 128)).astype(np.float32)
cache = fastattn.rope_cache(np.arange(512, dtype=np.int32), n_dims=128, mode=fastattn.ROPE_NEOX)
kv = np.zeros((4096, 8, 128), np.float16); idx = np.arange(512, dtype=np.int64)
call = lambda: fastattn.apply_rope_cache_set_rows(kv, x, cache, idx)"""),
    "rms_norm (512, 4096) bf16": ("combinations", _COMBINATION + """
x = rng.standard_normal((512, 4096)).astype(bf)
call = lambda: fastattn.rms_norm(x, 1e-5)"""),
    "add_rms_norm_mul (1, 4096) bf16": ("combinations", _COMBINATION + """
x = rng.standard_normal((1, 4096)).astype(bf); r = x.copy(); w = np.ones(4096, np.float32)
call = lambda: fastattn.add_rms_norm_mul(x, r, w, 1e-5)"""),
    "set_rows (512, 1024) bf16 -> f32 cache": ("combinations", _COMBINATION + """
cache = np.zeros((4096, 1024), np.float32); src = rng.standard_normal((512, 1024)).astype(bf)
idx = np.arange(512, dtype=np.int64)
call = lambda: fastattn.set_rows(cache, src, idx)"""),
    "set_rows (512, 1024) f16 -> q4_0 cache": ("combinations", _COMBINATION + """
cache = fastattn.quantize(np.zeros((4096, 1024), np.float32), "q4_0"); src = rng.standard_normal((512, 1024)).astype(np.float16)
idx = np.arange(512, dtype=np.int64)
call = lambda: fastattn.set_rows(cache, src, idx)"""),
    "quantize (4096, 1024) f16 -> q4_0, then dequantize": ("combinations", _COMBINATION + """
x = rng.standard_normal((4096, 1024)).astype(np.float16)
call = lambda: fastattn.dequantize(fastattn.quantize(x, "q4_0"))"""),
}

_CHILD = """
import json, logging, time, sys
import numpy as np
import fastattn
rng = np.random.default_rng(0)
kernels = []
class Collect(logging.Handler):
    def emit(self, record):
        if getattr(record, "fastattn_compile", None) == "end":
            kernels.append((record.fastattn_kernel, round(record.fastattn_seconds, 2)))
logging.getLogger("fastattn").addHandler(Collect())
{setup}
with fastattn.num_threads({threads}):
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps(dict(wall=wall, cpu=cpu, kernels=kernels)))
"""


def run_case(setup: str, threads: int, cache_dir: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    code = _CHILD.format(setup=setup, threads=threads)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return dict(error=done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="Numba threads for the call (default 2)")
    parser.add_argument("--only", default="", help="op groups to run, comma-separated: startup, norm, set_rows, "
                                                   "rope, attention, quantized, combinations (default: all)")
    args = parser.parse_args()
    groups = {g for g in args.only.split(",") if g}
    print(markdown([f"first call ({args.threads} threads)", "cold wall s", "cold CPU s", "kernels compiled (s)",
                    "warm wall s"]))
    started = time.perf_counter()
    for name, (group, setup) in CASES.items():
        if groups and group not in groups:
            continue
        with tempfile.TemporaryDirectory(prefix="fastattn-compile-") as cache_dir:
            cold = run_case(setup, args.threads, cache_dir)
            if "error" in cold:
                print(f"| {name} | {cold['error']} | | | |", flush=True)
                continue
            warm = run_case(setup, args.threads, cache_dir)
        kernels = ", ".join(f"{kernel} ({seconds})" for kernel, seconds in cold["kernels"])
        print(markdown_row([name, f"{cold['wall']:.1f}", f"{cold['cpu']:.1f}", kernels,
                            f"{warm.get('wall', float('nan')):.2f}"]), flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()

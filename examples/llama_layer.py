"""One Llama-style decoder layer built from fastattn's kernels, run as a prefill followed by decode steps.

    python examples/llama_layer.py [--prefill 512] [--decode 16] [--threads 2] [--small] [--kv q8_0]

It prints the time per token of prefill and decode and the share of each op, then runs the same layer on
``fastattn.reference``'s ops with the same inputs and checks every output against it (``TOLERANCE``); the exit
status is 1 when they disagree. ``--small`` is a quick run (seconds once the kernels are compiled).

The layer, per call on N new tokens at positions ``pos`` (the non-GEMM ops are fastattn's, the GEMMs NumPy's):

    h    = rms_norm_mul(x, attn_norm)                   fused RMSNorm * weight
    qkv  = h @ wqkv (+ bqkv)                            one fused projection, (N, (Hq + 2 Hkv) * D)
    q    = rope(qkv[:, :Hq*D] as (N, Hq, D))            in place on a strided view of qkv: no copy
    kv_cache[rows] = rope(k), v                         rope_set_rows (fused) and set_rows, float16 cache
                                                        (--kv q8_0 / q4_0: a quantized cache, as llama.cpp's -ctk/-ctv)
    a    = flash_attn_ext(q, K[:n_kv], V[:n_kv], causal mask, path="auto")
    s, h = add_rms_norm_mul(x, a @ wo, ffn_norm)        residual add fused in front of the FFN norm
    out  = s + (silu(h @ w_gate) * (h @ w_up)) @ w_down   SwiGLU FFN

RoPE is NEOX by default; ``LlamaConfig(rope_mode=fastattn.ROPE_MROPE, rope_sections=(...))`` with (4, N) positions
and explicit cache ``rows`` makes it a Qwen2-VL text layer (with ``LayerWeights.bqkv``, the q/k/v biases).

On a machine with few cores, the idle workers of NumPy's OpenBLAS keep spinning after each matmul and hold the
cores fastattn's parallel kernels need (docs/design.md); ``OPENBLAS_THREAD_TIMEOUT=4`` in the environment makes
them sleep at once, without slowing the matmuls (measured in docs/benchmarks.md, "When OpenBLAS's workers
sleep"). ``tests/test_llama_layer.py`` checks it against Hugging Face's ``LlamaModel`` and
``tests/test_qwen2vl_layer.py`` against ``Qwen2VLTextModel`` when transformers is installed.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

import fastattn
import fastattn.reference


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int = 4096
    n_head: int = 32
    n_head_kv: int = 8
    head_dim: int = 128
    ffn: int = 14336
    eps: float = 1e-5
    rope_base: float = 500000.0
    max_ctx: int = 1024
    rope_mode: int = fastattn.ROPE_NEOX
    rope_sections: tuple[int, int, int, int] | None = None  # rotation pairs per stream t, h, w, e (M-RoPE modes)


@dataclass
class LayerWeights:
    """float32 weights, laid out for ``x @ w`` (input features first)."""

    attn_norm: np.ndarray  # (hidden,)
    wqkv: np.ndarray  # (hidden, (n_head + 2 n_head_kv) head_dim): the q, k and v projections side by side
    wo: np.ndarray  # (n_head head_dim, hidden)
    ffn_norm: np.ndarray  # (hidden,)
    w_gate: np.ndarray  # (hidden, ffn)
    w_up: np.ndarray  # (hidden, ffn)
    w_down: np.ndarray  # (ffn, hidden)
    bqkv: np.ndarray | None = None  # ((n_head + 2 n_head_kv) head_dim,): q, k, v biases (Qwen2), or none

    @classmethod
    def random(cls, c: LlamaConfig, seed: int = 0) -> "LayerWeights":
        rng = np.random.default_rng(seed)

        def w(*shape):
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        return cls(1 + 0.1 * w(c.hidden) * c.hidden ** 0.5, w(c.hidden, (c.n_head + 2 * c.n_head_kv) * c.head_dim),
                   w(c.n_head * c.head_dim, c.hidden), 1 + 0.1 * w(c.hidden) * c.hidden ** 0.5,
                   w(c.hidden, c.ffn), w(c.hidden, c.ffn), w(c.ffn, c.hidden))


#: The steps of ``forward`` that call fastattn (the others are NumPy's).
FASTATTN_STEPS = ("rms_norm_mul", "rope", "rope_set_rows", "set_rows", "flash_attn_ext", "add_rms_norm_mul")


class LlamaLayer:
    """A decoder layer with its own token-major KV cache of ``config.max_ctx`` rows.

    ``announce=True`` prints a line to stderr before each fastattn step's first call for prefill and for decode
    shapes, and its time after: the first calls compile the kernels (Numba caches them on disk, so only a first
    run on a machine takes long).
    """

    def __init__(self, weights: LayerWeights, config: LlamaConfig, kv_dtype=np.float16, announce: bool = False,
                 ops=fastattn):
        """``kv_dtype``: the cache's dtype (float16, float32, bfloat16) or a quantized type, "q8_0" or "q4_0".
        ``ops``: the module whose ops the layer calls, ``fastattn`` or ``fastattn.reference`` (the same names and
        signatures: the reference layer the script checks against)."""
        self.w, self.c, self.ops = weights, config, ops
        shape = (config.max_ctx, config.n_head_kv, config.head_dim)
        if isinstance(kv_dtype, str) and kv_dtype in ("q8_0", "q4_0"):
            self.k_cache = ops.quantize(np.zeros(shape, np.float32), kv_dtype)  # (R, Hkv, D) of blocks
            self.v_cache = ops.quantize(np.zeros(shape, np.float32), kv_dtype)
        else:
            self.k_cache = np.zeros(shape, kv_dtype)
            self.v_cache = np.zeros(shape, kv_dtype)
        self.times: dict[str, float] = defaultdict(float)
        self.announce = announce
        self._stage = "prefill"
        self._seen: set[tuple[str, str]] = set()

    @contextmanager
    def _timed(self, op: str):
        first = self.announce and op in FASTATTN_STEPS and (op, self._stage) not in self._seen
        if first:
            print(f"  {op}, {self._stage} shapes ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        yield
        spent = time.perf_counter() - t0
        self.times[op] += spent
        if first:
            self._seen.add((op, self._stage))
            print(f"  {op}, {self._stage} shapes: {spent:.2f} s", file=sys.stderr, flush=True)

    def forward(self, x: np.ndarray, pos: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """x (N, hidden) float32 for tokens at positions ``pos`` -> (N, hidden) float32.

        ``pos`` is (N,) int32, or (4, N) (streams t, h, w, e) for the M-RoPE modes. ``rows`` (N,) int32 are the
        tokens' KV-cache rows, which the causal mask orders; they default to ``pos`` when it is (N,).
        """
        c, w, t, ops = self.c, self.w, self._timed, self.ops
        n, hq, hkv, d = x.shape[0], c.n_head, c.n_head_kv, c.head_dim
        self._stage = "decode" if n == 1 else "prefill"
        if rows is None:
            if pos.ndim != 1:
                raise ValueError("rows (the KV-cache rows) is required with (4, N) positions")
            rows = pos
        rope = dict(n_dims=d, mode=c.rope_mode, freq_base=c.rope_base, sections=c.rope_sections)
        with t("rms_norm_mul"):
            h = ops.rms_norm_mul(x, w.attn_norm, c.eps)
        with t("matmul"):
            qkv = h @ w.wqkv
            if w.bqkv is not None:
                qkv += w.bqkv
        q = qkv[:, :hq * d].reshape(n, hq, d)  # strided views of the fused projection: no copies
        k = qkv[:, hq * d:(hq + hkv) * d].reshape(n, hkv, d)
        v = qkv[:, (hq + hkv) * d:].reshape(n, hkv, d)
        with t("rope"):
            cache = ops.rope_cache(pos, **rope)
            ops.apply_rope_cache(q, cache, out=q)
        with t("rope_set_rows"):
            ops.rope_set_rows(self.k_cache, k, pos, rows, **rope)
        with t("set_rows"):
            # set_rows writes rows of the second-to-last axis: the (R, Hkv, D) cache as (R, Hkv*D), no copy
            ops.set_rows(_cache_view(self.v_cache, lambda a: a.reshape(c.max_ctx, -1)), v.reshape(n, hkv * d),
                              rows)
        n_kv = int(rows.max()) + 1
        with t("flash_attn_ext"):
            # (1, Hkv, n_kv, D): a view of the cache
            keys = _cache_view(self.k_cache, lambda a: a[:n_kv].transpose(1, 0, 2)[None])
            values = _cache_view(self.v_cache, lambda a: a[:n_kv].transpose(1, 0, 2)[None])
            mask = np.where(np.arange(n_kv)[None, :] <= rows[:, None], 0.0, -np.inf).astype(np.float16)
            attn = ops.flash_attn_ext(q.transpose(1, 0, 2)[None], keys, values, mask,
                                           scale=1.0 / np.sqrt(d))  # (1, N, Hq, D)
        with t("matmul"):
            projected = attn.reshape(n, hq * d) @ w.wo
        with t("add_rms_norm_mul"):
            s, h = ops.add_rms_norm_mul(x, projected, w.ffn_norm, c.eps)
        with t("matmul"):
            gate = h @ w.w_gate
            up = h @ w.w_up
        with t("silu"):
            act = gate / (1.0 + np.exp(-gate)) * up
        with t("matmul"):
            return s + act @ w.w_down


def _cache_view(cache, view):
    """``view`` (a reshape, slice or transpose of the rows) of a cache: of its bytes when it is quantized (a row's
    blocks stay together: only the leading axes move)."""
    if isinstance(cache, fastattn.Quantized):
        return fastattn.Quantized(view(cache.data), cache.qtype)
    return view(cache)


def _report(label: str, layer: LlamaLayer, seconds: float, tokens: int) -> None:
    total = sum(layer.times.values())
    print(f"{label}: {seconds * 1e3:.1f} ms for {tokens} token(s), {seconds / tokens * 1e3:.3f} ms/token")
    for op, spent in sorted(layer.times.items(), key=lambda kv: -kv[1]):
        print(f"    {op:<18} {spent * 1e3:9.3f} ms  {100 * spent / total:5.1f} %")
    layer.times.clear()


#: The check's bound on max |fast - reference| over every output, as a share of the reference's largest
#: |value|, by KV cache type. The fast and reference ops agree to float32 rounding (fastattn.testing's rule), but
#: the cache rounds K and V to its type, where a float32 difference in the last place can move a value across a
#: rounding boundary: by one float16 ulp (2^-11 relative), or one step of a Q8_0 / Q4_0 block (1/127 or 1/8 of the
#: block's largest value) for a quantized cache. Such a step reaches the output through attention's weighted mean.
TOLERANCE = {"f16": 2e-4, "q8_0": 2e-3, "q4_0": 2e-2}


def check_against_reference(weights: LayerWeights, config: LlamaConfig, kv: str, inputs, outputs) -> bool:
    """Run the same layer on ``fastattn.reference``'s ops (float64 NumPy, the definition of each op; the GEMMs
    are the same NumPy float32 ones) on the same inputs, and compare every output with ``TOLERANCE``."""
    reference = LlamaLayer(weights, config, np.float16 if kv == "f16" else kv, ops=fastattn.reference)
    expected = [reference.forward(x, pos) for x, pos in inputs]
    error = max(float(np.abs(got - want).max()) for got, want in zip(outputs, expected))
    bound = TOLERANCE[kv] * max(float(np.abs(want).max()) for want in expected)
    ok = error <= bound
    print(f"checked against fastattn.reference (the same layer on the reference ops, {len(inputs)} calls): "
          f"max |fast - reference| = {error:.3g}, bound {bound:.3g} ({TOLERANCE[kv]:g} x the largest |output|, "
          f"{kv} cache): {'passed' if ok else 'FAILED'}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=None, help="prompt tokens (default 512; --small: 64)")
    parser.add_argument("--decode", type=int, default=None, help="decode steps (default 16; --small: 4)")
    parser.add_argument("--threads", type=int, default=fastattn.get_num_threads())
    parser.add_argument("--small", action="store_true",
                        help="a quick run: a 1/8-width layer, a 64-token prefill and 4 decode steps")
    parser.add_argument("--kv", choices=("f16", "q8_0", "q4_0"), default="f16",
                        help="the KV cache's type: float16, or quantized as llama.cpp's -ctk/-ctv q8_0 / q4_0")
    args = parser.parse_args(argv)
    args.prefill = args.prefill or (64 if args.small else 512)
    args.decode = args.decode or (4 if args.small else 16)
    kv_dtype = np.float16 if args.kv == "f16" else args.kv
    config = LlamaConfig(hidden=512, n_head=8, n_head_kv=2, head_dim=64, ffn=1536) if args.small else LlamaConfig()
    config = LlamaConfig(**{**config.__dict__, "max_ctx": args.prefill + args.decode})
    fastattn.set_num_threads(args.threads)
    weights = LayerWeights.random(config)
    layer = LlamaLayer(weights, config, kv_dtype)
    rng = np.random.default_rng(1)
    # Run the same shapes once untimed, so every kernel variant they pick (tiled vs one_chunk vs split_kv
    # attention, serial vs parallel norms and row writes) is compiled or loaded from Numba's cache first.
    print("compiling kernels (first run only: Numba caches them on disk; python -m fastattn warmup compiles "
          "them ahead of time) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    warm = LlamaLayer(LayerWeights.random(config), config, kv_dtype, announce=True)
    warm.forward(rng.standard_normal((args.prefill, config.hidden)).astype(np.float32),
                 np.arange(args.prefill, dtype=np.int32))
    warm.forward(rng.standard_normal((1, config.hidden)).astype(np.float32), np.array([args.prefill], np.int32))
    print(f"kernels ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    x = rng.standard_normal((args.prefill, config.hidden)).astype(np.float32)
    inputs = [(x, np.arange(args.prefill, dtype=np.int32))]
    t0 = time.perf_counter()
    outputs = [layer.forward(*inputs[0])]
    _report(f"prefill ({args.threads} threads)", layer, time.perf_counter() - t0, args.prefill)
    token = outputs[0][-1:]
    t0 = time.perf_counter()
    for step in range(args.decode):
        inputs.append((token, np.array([args.prefill + step], np.int32)))
        token = layer.forward(*inputs[-1])
        outputs.append(token)
    _report(f"decode ({args.threads} threads)", layer, time.perf_counter() - t0, args.decode)
    return 0 if check_against_reference(weights, config, args.kv, inputs, outputs) else 1


if __name__ == "__main__":
    sys.exit(main())

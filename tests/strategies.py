"""Hypothesis strategies shared by every test module, and the two profiles.

Profiles: ``ci`` (default: bounded, derandomised, attention's kernel variants drawn from a covering set: most of a
cold run is first-time Numba compilation) and ``fuzz`` (many more examples, random seeds, every kernel variant),
chosen with ``FASTATTN_HYPOTHESIS=fuzz``.

Arrays are drawn as *views*: a parent buffer larger than the array (padding on every axis, optional step 2,
optional permuted memory order) filled with random values, and the view the op sees. ``StridedView`` keeps a
copy of the parent so a test can check byte for byte that nothing outside the view changed (ggml's sentinels).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from fastattn.rope.modes import RopeMode
from fastattn.rope.cache import RECURRENCE_MAX_POS
from fastattn._core.validate import FLOAT16, FLOAT32

try:  # fastattn takes bfloat16 from ml_dtypes once it is imported; the tests import it to draw bfloat16 arrays
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - only without ml_dtypes
    BFLOAT16 = None
#: Every storage float the ops take (bfloat16 only with ml_dtypes).
STORAGE_FLOATS = (FLOAT32, FLOAT16) + ((BFLOAT16,) if BFLOAT16 is not None else ())

settings.register_profile(
    "ci", max_examples=20, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile(
    "fuzz", max_examples=400, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
PROFILE = os.environ.get("FASTATTN_HYPOTHESIS", "ci")
settings.load_profile(PROFILE)

#: Storage dtypes of half-precision-capable inputs (bfloat16 only with ml_dtypes).
float_dtypes = st.sampled_from(STORAGE_FLOATS)
f32_or_f16 = st.sampled_from((FLOAT32, FLOAT16))
thread_counts = st.sampled_from((1, 2))
seeds = st.integers(0, 2**32 - 1)
#: eps as the contract asks: 0 to 10, with the usual model values likely.
eps_values = st.one_of(st.sampled_from((0.0, 1e-6, 1e-5)), st.floats(0.0, 10.0, allow_nan=False))


def dims(lo: int = 1, hi: int = 64) -> st.SearchStrategy[int]:
    """A size that is often 1, odd, or at the bounds."""
    return st.one_of(st.sampled_from(sorted({lo, min(lo + 1, hi), hi})), st.integers(lo, hi))


def fill(rng: np.random.Generator, shape, dtype, kind: str = "normal", scale: float = 1.0) -> np.ndarray:
    """Random values of ``dtype``: ``normal`` (N(0, scale)), ``mixed`` (normal times 10**U(-4, 4))."""
    values = rng.standard_normal(shape) * scale
    if kind == "mixed":
        values = values * 10.0 ** rng.uniform(-4, 4, shape)
    return values.astype(dtype)


@dataclass
class StridedView:
    """An array that is a view into a larger parent buffer, and a snapshot of that parent."""

    array: np.ndarray
    parent: np.ndarray
    inside: np.ndarray  # bool mask over parent: True where the view's elements live
    snapshot: np.ndarray = field(repr=False)

    def assert_outside_unchanged(self) -> None:
        """Every parent element outside the view is byte-identical to before."""
        now = np.ascontiguousarray(self.parent).view(np.uint8).reshape(self.parent.shape + (-1,))  # permuted parents
        then = np.ascontiguousarray(self.snapshot).view(np.uint8).reshape(self.snapshot.shape + (-1,))
        changed = np.any(now != then, axis=-1) & ~self.inside
        assert not changed.any(), f"{int(changed.sum())} element(s) outside the view were written"

    def assert_all_unchanged(self) -> None:
        assert self.parent.tobytes() == self.snapshot.tobytes(), "the buffer was written"


@st.composite
def strided(draw, shape, dtype, *, kind: str = "normal", scale: float = 1.0, contiguous_ok: bool = True,
            values: np.ndarray | None = None) -> StridedView:
    """A ``StridedView`` of ``shape``/``dtype``: C-contiguous, padded, stepped or permuted (all drawn)."""
    shape = tuple(int(s) for s in shape)
    layout = draw(st.sampled_from(("contiguous", "padded", "stepped", "permuted")
                                  if contiguous_ok else ("padded", "stepped", "permuted")))
    ndim = len(shape)
    lo = [0] * ndim
    hi = [0] * ndim
    step = [1] * ndim
    order = list(range(ndim))
    if layout != "contiguous":
        lo = [draw(st.sampled_from((0, 1, 3))) for _ in shape]
        hi = [draw(st.sampled_from((0, 1, 2))) for _ in shape]
        if ndim:
            hi[-1] = max(hi[-1], 1)  # always some guard on the fast axis
    if layout == "stepped" and ndim:
        step = [draw(st.sampled_from((1, 2))) for _ in shape]
    if layout == "permuted" and ndim > 1:
        order = draw(st.permutations(range(ndim)))
    parent_shape = [s * k + a + b for s, k, a, b in zip(shape, step, lo, hi)]
    rng = np.random.default_rng(draw(seeds))
    memory = fill(rng, [parent_shape[a] for a in order], dtype, kind, scale)
    parent = memory.transpose(np.argsort(order))  # logical axes; memory order follows `order`
    index = tuple(slice(a, a + s * k, k) for s, k, a in zip(shape, step, lo))
    view = parent[index]
    if values is not None:
        view[...] = values
    inside = np.zeros(parent.shape, bool)
    inside[index] = True
    return StridedView(view, parent, inside, parent.copy())


def index_sets(n_rows: int, count: int, *, unique: bool = False):
    """``count`` row indices in [0, n_rows), duplicates allowed unless ``unique``."""
    if unique:
        return st.permutations(range(n_rows)).map(lambda p: np.array(p[:count], np.int64))
    return st.lists(st.integers(0, n_rows - 1), min_size=count, max_size=count).map(
        lambda xs: np.array(xs, np.int64))


def has_bf16() -> bool:
    return BFLOAT16 is not None


# ---------------------------------------------------------------------------------------------------------------
# Attention's kernel variants. Each (K/V storage dtype, mask dtype or no mask, mask with a row per head or shared
# by the heads) is compiled again for every path (seconds each on 2 cores, most of the suite's time), while shapes,
# strides and values are runtime arguments of the same compiled code. The ci profile draws the variants from
# ATTENTION_COVERING: every storage dtype, no mask, and each mask dtype both shared and per head, each at least once
# (7 of the 15 combinations, also used by the fixed-case tests, so they share the compilations); the fuzz profile
# draws all of them.
_SHARED, _PER_HEAD = False, True
ATTENTION_COVERING = [(FLOAT32, None, _SHARED), (FLOAT16, None, _SHARED), (FLOAT16, FLOAT16, _SHARED),
                      (FLOAT32, FLOAT32, _SHARED), (FLOAT32, FLOAT32, _PER_HEAD), (FLOAT16, FLOAT16, _PER_HEAD)]
if BFLOAT16 is not None:
    ATTENTION_COVERING.append((BFLOAT16, FLOAT32, _SHARED))
ATTENTION_ALL = [(kv, mask, per_head) for kv in STORAGE_FLOATS for mask, per_head in
                 ((None, _SHARED), (FLOAT16, _SHARED), (FLOAT16, _PER_HEAD), (FLOAT32, _SHARED), (FLOAT32, _PER_HEAD))]
#: (K/V storage dtype, mask dtype or None, per-head mask), as above.
attention_variants = st.sampled_from(ATTENTION_ALL if PROFILE == "fuzz" else ATTENTION_COVERING)


# Attention masks (added for flash_attn_ext): the kinds ggml's test suite draws, as float16 or float32 arrays.
@st.composite
def attention_masks(draw, B: int, Hq: int, Nq: int, Nkv: int, dtype=None, per_head: bool | None = None):
    """None, or an additive mask (..., Nm >= Nq, Nkv) broadcastable as ggml: causal, random ``-inf`` blocks,
    fully masked rows, or ALiBi-style distances; float16 or float32, 2-D or 4-D with head/batch axes that divide
    Hq and B. ``dtype`` given (a variant of ``attention_variants``): a mask of that dtype, with a head axis of
    more than one row when ``per_head`` (Hq must be at least 2) and of one row otherwise."""
    kinds = ("causal", "blocks", "full_rows", "distance")
    kind = draw(st.sampled_from(kinds if dtype is not None else ("none",) + kinds))
    if kind == "none":
        return None
    rng = np.random.default_rng(draw(seeds))
    Nm = Nq + draw(st.sampled_from((0, 0, 3)))  # ggml pads the mask's rows; extra rows are ignored
    heads = sorted({h for h in (1, 2, Hq) if Hq % h == 0})
    if per_head is not None:
        heads = [h for h in heads if (h > 1) == per_head]
    if per_head or draw(st.booleans()):
        Bm = draw(st.sampled_from(sorted({1, B})))
        Hm = draw(st.sampled_from(heads))
        shape = (Bm, Hm, Nm, Nkv)
    else:
        shape = (Nm, Nkv)
    values = np.zeros(shape) if kind == "causal" else rng.standard_normal(shape)
    rows = np.arange(Nm)[:, None]
    cols = np.arange(Nkv)[None, :]
    if kind == "causal":  # the last query row sees every key (decode of the newest tokens)
        values = np.where(cols > rows + (Nkv - Nq), -np.inf, values)
    elif kind == "blocks":
        for _ in range(draw(st.integers(1, 4))):
            r0, c0 = rng.integers(0, Nm), rng.integers(0, Nkv)
            r1, c1 = r0 + rng.integers(1, Nm + 1), c0 + rng.integers(1, Nkv + 1)
            values[..., r0:r1, c0:c1] = -np.inf
    elif kind == "full_rows":
        values[..., rng.random(Nm) < 0.5, :] = -np.inf
    else:  # distance: -|i - j| as ALiBi masks in ggml's tests, beyond a window -inf
        values = -np.abs(rows - cols + (Nkv - Nq)).astype(np.float64) * np.ones(shape)
        values = np.where(-values > draw(st.sampled_from((Nkv, 8))), -np.inf, values)
    return values.astype(draw(f32_or_f16) if dtype is None else dtype)


# ---------------------------------------------------------------------------------------------------------------
# RoPE: parameter sets of every mode and positions of every kind.
ROPE_MODES = (RopeMode.NORMAL, RopeMode.NEOX, RopeMode.MROPE, RopeMode.IMROPE, RopeMode.VISION)
MULTI_MODES = (RopeMode.MROPE, RopeMode.IMROPE, RopeMode.VISION)


@st.composite
def rope_configs(draw, mode=None):
    """(kwargs for rope_ext, head dim D, number of position streams)."""
    mode = draw(st.sampled_from(ROPE_MODES)) if mode is None else mode
    if mode == RopeMode.VISION:
        n_dims = 2 * draw(st.integers(1, 16))
        d = 2 * n_dims
    else:
        d = 2 * draw(st.integers(1, 40))
        n_dims = 2 * draw(st.integers(1, d // 2))
    n_pairs = n_dims if mode == RopeMode.VISION else n_dims // 2
    kwargs = dict(n_dims=n_dims, mode=mode)
    kwargs["freq_base"] = draw(st.sampled_from((10000.0, 500000.0, 1e6, 100.0)))
    kwargs["backward"] = draw(st.booleans())
    if draw(st.booleans()):  # YaRN / linear scaling
        kwargs["freq_scale"] = draw(st.sampled_from((1.0, 0.25, 0.125)) | st.floats(0.01, 1.0))
        kwargs["ext_factor"] = draw(st.sampled_from((0.0, 1.0)) | st.floats(0.0, 1.0))
        kwargs["attn_factor"] = draw(st.sampled_from((1.0,)) | st.floats(0.5, 2.0))
        kwargs["n_ctx_orig"] = draw(st.sampled_from((0, 4096, 8192)) | st.integers(0, 100000))
        kwargs["beta_fast"] = draw(st.sampled_from((32.0,)) | st.floats(1.0, 64.0))
        kwargs["beta_slow"] = draw(st.sampled_from((1.0,)) | st.floats(0.1, 4.0))
    if draw(st.booleans()):
        kwargs["freq_factors"] = np.array(draw(st.lists(st.floats(0.5, 40.0), min_size=n_pairs,
                                                          max_size=n_pairs)), draw(st.sampled_from((np.float32,
                                                                                                    np.float64))))
    if mode in MULTI_MODES:
        # sections summing below, to and above n_pairs (the cycle `pair % sum` then wraps)
        total = draw(st.sampled_from((max(1, n_pairs // 2), n_pairs, n_pairs + 3)))
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=3, max_size=3)))
        sections = [cuts[0], cuts[1] - cuts[0], cuts[2] - cuts[1], total - cuts[2]]
        if sum(sections[:3]) == 0:
            sections = [total, 0, 0, 0]
        if mode == RopeMode.VISION and draw(st.booleans()):
            sections = [n_pairs // 2, n_pairs - n_pairs // 2, 0, 0]  # Qwen2-VL's vision layout
        kwargs["sections"] = sections
    return kwargs, d, 4 if mode in MULTI_MODES else 1


def positions(streams: int, n: int, rng: np.random.Generator, kind: str) -> np.ndarray:
    if kind == "small":
        pos = rng.integers(-8, 4096, (streams, n))
    elif kind == "runs":  # consecutive runs (the cache's recurrence) with jumps, in some streams only
        start = rng.choice([-3, 0, 70_000, 999_990, RECURRENCE_MAX_POS - 3])
        steps = rng.choice([1, 1, 1, 0, 5], (streams, n))
        steps[:, 0] = 0
        pos = start + np.cumsum(steps, axis=1) + rng.integers(0, 2, (streams, 1))
    else:  # negative and large, up to 1e6
        pos = rng.integers(-1_000_000, 1_000_001, (streams, n))
    pos = pos.astype(np.int32)
    return pos[0] if streams == 1 else pos

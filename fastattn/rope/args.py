"""Argument parsing for RoPE (``rope_ext``, ``rope_cache``, ``rope_set_rows``), shared by fast and reference.

Everything is checked here, before any output is touched, so both sides reject the same inputs with the same
``TypeError``/``ValueError`` naming the argument. NumPy only.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import pairs as _rope_pairs
from .._core import validate as _validate
from .modes import RopeMode
from ..quant.blocks import BLOCK, BLOCK_BYTES, Quantized

#: Modes whose positions come as four streams (t, h, w, e) and that need ``sections``.
MULTI_MODES = (RopeMode.MROPE, RopeMode.IMROPE, RopeMode.VISION)
#: dtypes ``x`` may have.
X_DTYPES = (_validate.FLOAT32, _validate.FLOAT16)
#: int32 is ggml's position type; int64 is accepted as long as the values fit in int32.
POS_DTYPES = _validate.INDEX_INTS
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class Pairing(NamedTuple):
    """How a cos/sin table of one parameter set applies to a head of D dims."""

    n_pairs: int  # rotated pairs per head
    interleaved: bool  # NORMAL's adjacent pairs (2p, 2p+1), else (p, p + n_pairs)
    min_head_dim: int  # D >= min_head_dim ...
    exact_head_dim: bool  # ... and == when exact: VISION rotates all 2·n_dims dims


@dataclass(frozen=True)
class RopeParams:
    """The validated scalar parameters of one RoPE (everything except ``x``, ``pos`` and ``out``)."""

    n_dims: int
    mode: RopeMode
    freq_base: float
    freq_scale: float
    n_ctx_orig: int
    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float
    freq_factors: np.ndarray | None  # float64 (n_pairs,), read-only copy
    sections: tuple[int, int, int, int] | None
    backward: bool

    @property
    def n_pairs(self) -> int:
        """Rotated pairs per head: n_dims/2, or n_dims for VISION (which rotates all 2·n_dims dims)."""
        return self.n_dims if self.mode == RopeMode.VISION else self.n_dims // 2

    @property
    def n_streams(self) -> int:
        return 4 if self.mode in MULTI_MODES else 1

    def check_head_dim(self, name: str, head_dim: int) -> None:
        """``head_dim`` (D) must hold the rotated dims: n_dims <= D, and D == 2·n_dims for VISION."""
        if self.mode == RopeMode.VISION:
            if head_dim != 2 * self.n_dims:
                raise ValueError(f"n_dims must be {name}'s last axis / 2 for ROPE_VISION: got n_dims={self.n_dims}"
                                 f" with head dim {head_dim}")
        elif self.n_dims > head_dim:
            raise ValueError(f"n_dims must be <= {name}'s last axis (head dim {head_dim}), got {self.n_dims}")

    @property
    def interleaved(self) -> bool:
        """NORMAL pairs adjacent dims (2p, 2p+1); every other mode pairs p with p + n_pairs."""
        return self.mode == RopeMode.NORMAL

    @functools.cached_property
    def pairing(self) -> Pairing:
        """How a cos/sin table of these parameters applies to a head (``Pairing``)."""
        vision = self.mode == RopeMode.VISION
        return Pairing(self.n_pairs, self.interleaved, 2 * self.n_dims if vision else self.n_dims, vision)

    @functools.cached_property
    def table(self) -> _rope_pairs.PairTable:
        """The per-pair streams, angle factors and scales (``rope.pairs``), computed once per parameter set."""
        return _rope_pairs.pair_table(self.n_dims, self.mode, self.freq_base, self.freq_scale, self.n_ctx_orig,
                                      self.ext_factor, self.attn_factor, self.beta_fast, self.beta_slow,
                                      self.freq_factors, self.sections, self.backward)


#: Every parameter set parsed so far (at most _PARSED_MAX), by ``_key``: a decode step parses the same
#: parameters for every layer, and parsing (or making the tables) costs more than a one-token rotation.
_PARSED: dict = {}
_PARSED_MAX = 64


def _key(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow,
         freq_factors, sections, backward):
    """The arguments with their classes (``2 == 2.0 == True`` in a dict, but only one of them is a valid
    ``mode``), freq_factors by dtype, shape and values, and the sign of a zero attn_factor (it signs the zeros
    of the result); None when an argument cannot be a key (the parser names it)."""
    try:
        if freq_factors is not None:
            freq_factors = (freq_factors.__class__, freq_factors.dtype, freq_factors.shape, freq_factors.tobytes())
        if sections is not None:
            sections = (sections.__class__,) + tuple((e.__class__, e) for e in sections)
        key = (n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow,
               backward, n_dims.__class__, mode.__class__, freq_base.__class__, freq_scale.__class__,
               n_ctx_orig.__class__, ext_factor.__class__, attn_factor.__class__, beta_fast.__class__,
               beta_slow.__class__, backward.__class__, freq_factors, sections,
               attn_factor == 0 and math.copysign(1.0, attn_factor))
        hash(key)
        return key
    except Exception:  # anything unhashable or unusual: parsed (and reported) without the memo
        return None


def parse_params(*, n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast,
                 beta_slow, freq_factors, sections, backward) -> RopeParams:
    """Validate the scalar parameters (and freq_factors, sections) of one RoPE; remembered by value."""
    args = (n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow,
            freq_factors, sections, backward)
    key = _key(*args)
    params = None if key is None else _PARSED.get(key)
    if params is None:
        params = _parse_params(*args)
        if key is not None:
            if len(_PARSED) >= _PARSED_MAX:
                _PARSED.clear()
            _PARSED[key] = params
    return params


def _parse_params(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow,
                  freq_factors, sections, backward) -> RopeParams:
    n_dims = _validate.integer("n_dims", n_dims, minimum=2)
    if n_dims % 2:
        raise ValueError(f"n_dims must be even, got {n_dims}")
    mode = _validate.scalar(mode)
    if isinstance(mode, (bool, np.bool_)) or not isinstance(mode, (int, np.integer)):
        raise TypeError(f"mode must be one of the ROPE_* constants, got {_validate.scalar_type(mode)}")
    try:
        mode = RopeMode(int(mode))
    except ValueError:
        raise ValueError(f"mode must be one of {[f'{m.name}={m.value}' for m in RopeMode]}, got {mode}") from None
    freq_base = _validate.real("freq_base", freq_base)
    if freq_base <= 0:
        raise ValueError(f"freq_base must be > 0, got {freq_base}")
    freq_scale = _validate.real("freq_scale", freq_scale)
    if freq_scale <= 0:
        raise ValueError(f"freq_scale must be > 0, got {freq_scale}")
    n_ctx_orig = _validate.integer("n_ctx_orig", n_ctx_orig, minimum=0)
    ext_factor = _validate.real("ext_factor", ext_factor)
    attn_factor = _validate.real("attn_factor", attn_factor)
    beta_fast = _validate.real("beta_fast", beta_fast)
    beta_slow = _validate.real("beta_slow", beta_slow)
    for name, beta in (("beta_fast", beta_fast), ("beta_slow", beta_slow)):
        if beta <= 0:
            raise ValueError(f"{name} must be > 0, got {beta}")
    mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale) if ext_factor != 0 else 1.0)
    if not abs(mscale) <= _validate.FLOAT32_MAX:  # the kernels store cos and sin times mscale as float32
        raise ValueError(f"attn_factor must keep the magnitude scale within float32's range (|scale| <= "
                         f"{_validate.FLOAT32_MAX:.6g}), got attn_factor={attn_factor} (scale {mscale:.6g})")
    backward = _validate.scalar(backward)
    if not isinstance(backward, (bool, np.bool_)):
        raise TypeError(f"backward must be a bool, got {type(backward).__name__}")

    n_pairs = n_dims if mode == RopeMode.VISION else n_dims // 2
    if freq_factors is not None:
        _validate.array("freq_factors", freq_factors, dtypes=(np.float32, np.float64), ndim=1)
        if freq_factors.shape[0] != n_pairs:
            raise ValueError(f"freq_factors must have one entry per rotated pair ({n_pairs} for n_dims={n_dims} "
                             f"in mode {mode.name}), got {freq_factors.shape[0]}")
        if not (np.all(np.isfinite(freq_factors)) and np.all(freq_factors > 0)):
            raise ValueError("freq_factors must be finite and > 0")
        freq_factors = freq_factors.astype(np.float64)
        freq_factors.flags.writeable = False

    if mode in MULTI_MODES:
        if sections is None:
            raise ValueError(f"sections (4 ints: pairs per stream t, h, w, e) is required for mode {mode.name}")
        try:
            sections = tuple(sections)
        except TypeError:
            raise TypeError(f"sections must be a sequence of 4 integers, got {type(sections).__name__}") from None
        if len(sections) != 4:
            raise ValueError(f"sections must be 4 integers (pairs for streams t, h, w, e), got {sections!r}")
        sections = tuple(_validate.integer(f"sections[{i}]", s, minimum=0) for i, s in enumerate(sections))
        if sum(sections[:3]) == 0:
            raise ValueError(f"sections must give at least one pair to stream t, h or w, got {sections}")
    elif sections is not None:
        raise ValueError(f"sections only applies to ROPE_MROPE, ROPE_IMROPE and ROPE_VISION, not {mode.name}")

    return RopeParams(n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor, attn_factor, beta_fast,
                      beta_slow, freq_factors, sections, bool(backward))


def parse_pos(pos, params: RopeParams, n_tokens: int | None = None, name: str = "pos") -> np.ndarray:
    """Positions as a (streams, N) integer array: (N,) for NORMAL/NEOX, (4, N) for the multi-position modes."""
    if not isinstance(pos, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of int32, got {type(pos).__name__}")
    if pos.dtype not in POS_DTYPES:
        raise TypeError(f"{name} must have an integer dtype (int32, or int64 within int32's range), got {pos.dtype}")
    if params.n_streams == 1:
        if pos.ndim != 1:
            raise ValueError(f"{name} must have shape (N,) for mode {params.mode.name}, got {pos.shape}")
        pos = pos[None]
    elif pos.ndim != 2 or pos.shape[0] != 4:
        raise ValueError(f"{name} must have shape (4, N) (streams t, h, w, e) for mode {params.mode.name}, "
                         f"got {pos.shape}")
    if n_tokens is not None and pos.shape[1] != n_tokens:
        raise ValueError(f"{name} must have one position per token: {n_tokens}, got {pos.shape[1]}")
    if pos.dtype == np.int64 and pos.size and (pos.min() < _INT32_MIN or pos.max() > _INT32_MAX):
        raise ValueError(f"{name} values must fit in int32")
    return pos


def parse_x(x, name: str = "x", *, ndim: int | None = None) -> np.ndarray:
    """``x`` (..., N, H, D) float32 or float16 (exactly ``ndim`` axes when given)."""
    _validate.array(name, x, dtypes=X_DTYPES, min_ndim=3, ndim=ndim)
    return x


def parse_out(out, x: np.ndarray, *, dtypes, reads: tuple = ()) -> np.ndarray | None:
    """``out`` None, ``x`` itself (in place), or a writeable array of ``x``'s shape not partially aliasing it.
    ``reads``: (name, array) pairs of the other inputs (positions, tables), which the written array may not
    overlap at all."""
    if out is None:
        return out
    if out is not x:
        _validate.out_array("out", out, shape=x.shape, dtypes=dtypes)
        _validate.may_share_write("out", out, ("x", x))
    elif not x.flags.writeable:
        raise ValueError("out (x, in place) must be writeable")
    _validate.disjoint("out", out, *reads)
    return out


def parse_set_rows(dst, x, idx, params: RopeParams, *, dst_dtypes, reads: tuple = ()
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``dst`` (R, H, D) or (R, H·D) cache; ``x`` (N, H, D); ``idx`` (N,) int32/int64 in [0, R). ``reads``:
    (name, array) pairs of the other inputs (positions, tables); ``dst`` may overlap none of them, nor x or idx.

    Returns ``dst`` as an (R, H, D) view (no copy) and ``idx``. A ``Quantized`` dst (logical (R, H, D) or
    (R, H·D), D a multiple of 32) is returned as its bytes, an (R, H, D / 32 · block bytes) view."""
    _validate.array("x", x, dtypes=X_DTYPES, ndim=3)
    n, h, d = x.shape
    params.check_head_dim("x", d)
    if isinstance(dst, Quantized):
        if d % BLOCK:
            raise ValueError(f"x's head size D must be a multiple of {BLOCK} to write whole blocks of a Quantized "
                             f"dst, got x.shape {x.shape}")
        memory = dst.data
        width = d // BLOCK * BLOCK_BYTES[dst.qtype]  # one head row's bytes
    else:
        _validate.array("dst", dst, dtypes=dst_dtypes)
        memory = dst
        width = d
    if not memory.flags.writeable:
        raise ValueError("dst must be writeable")
    if dst.ndim == 3:
        if dst.shape[1:] != (h, d):
            raise ValueError(f"dst must have shape (R, {h}, {d}) or (R, {h * d}) for x of shape {x.shape}, "
                             f"got {dst.shape}")
        dst3 = memory
    elif dst.ndim == 2:
        if dst.shape[1] != h * d:
            raise ValueError(f"dst must have shape (R, {h}, {d}) or (R, {h * d}) for x of shape {x.shape}, "
                             f"got {dst.shape}")
        try:
            dst3 = memory.reshape(memory.shape[0], h, width, copy=False)
        except ValueError:
            raise ValueError("dst's rows must be splittable into (H, D) without a copy (a contiguous row axis)"
                             ) from None
    else:
        raise ValueError(f"dst must have 2 or 3 axes ((R, H·D) or (R, H, D)), got shape {dst.shape}")
    _validate.array("idx", idx, dtypes=_validate.INDEX_INTS, ndim=1)
    _validate.disjoint("dst", memory, ("x", x), ("idx", idx), *reads)
    if idx.shape[0] != n:
        raise ValueError(f"idx must have one row index per token: {n}, got {idx.shape[0]}")
    rows = dst3.shape[0]
    if n:
        # (a decode step writes one row: Python's min/max on a short list cost a tenth of NumPy's reductions)
        values = idx.tolist() if n <= 16 else None
        lo, hi = (min(values), max(values)) if values is not None else (idx.min(), idx.max())
        if lo < 0 or hi >= rows:
            bad = idx[(idx < 0) | (idx >= rows)][0]
            raise ValueError(f"idx values must be in [0, {rows}) (dst rows), got {bad}")
    return dst3, idx


def cache_error(cache, maker: str) -> TypeError:
    """The error for a ``cache`` argument that is not a RopeCache made by ``maker`` (each side, fast and reference,
    takes only its own: the fast one holds float32 tables, the reference's float64)."""
    got = type(cache)
    return TypeError(f"cache must be a RopeCache made by {maker}, got {got.__module__}.{got.__qualname__}"
                     + (" (a cache of the other side: build one with " + maker + ")"
                        if got.__name__ == "RopeCache" else ""))


"""``QuantizedKVCache``: a transformers ``Cache`` holding each layer's K and V as ggml's Q8_0 / Q4_0 blocks.

    cache = QuantizedKVCache(model.config, qtype="q8_0")       # or "q4_0"
    model.generate(input_ids, cache=cache, max_new_tokens=64)   # with attn_implementation="fastattn"

Storage: per layer, K and V are each a ``Quantized`` of logical shape (B, Hkv, capacity, D): the bytes of one
(batch, head) are a run of rows, so the live rows ``[:, :, a:b]`` are a strided view that ``flash_attn_ext`` reads
as (B, Hkv, Nkv, D) K/V without a copy. New rows are quantized straight into their place by ``set_rows``; the
capacity grows by 1/32 of what it must hold (at least ``MIN_GROWTH`` rows), the only copy of the cache.

``update`` returns ``QuantizedKV`` handles: torch tensors of the rows' shape and the model's dtype, without
storage of their own. The "fastattn" attention backend takes their blocks (``QuantizedKV.blocks``) and reads them
in place; any torch operation on a handle (another attention implementation) runs on the dequantized values,
which are exactly what fastattn attends over.

Sliding-window layers follow ``DynamicSlidingWindowLayer``: the same sequence length, mask sizes and returned
rows (the last ``window - 1`` rows before the new ones). Rows out of the window stay until the storage is full
or holds mostly such rows, then the rows still needed move to a new array of twice their size (the copy is paid
once per ``window`` tokens), so a window layer's memory stays within about twice the window.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, get_layer_types_and_kwargs
from transformers.configuration_utils import PreTrainedConfig

from .._core.tensors import as_array
from ..quant.api import dequantize
from ..quant.blocks import BLOCK, BLOCK_BYTES, QTYPES, Quantized
from ..rows.api import set_rows

#: The storage grows by 1/GROWTH_DIVISOR of the rows it must hold, and by at least MIN_GROWTH rows: a copy of the
#: cache every 1/32 of its length keeps the copies' cost per token constant and the unused capacity near 3%.
GROWTH_DIVISOR = 32
MIN_GROWTH = 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class QuantizedKV(torch.Tensor):
    """K or V rows of a ``QuantizedKVCache`` layer as a torch tensor (B, Hkv, N, D) of the model's dtype.

    ``blocks`` is the ``fastattn.Quantized`` view of the cache's bytes, which the "fastattn" attention backend
    reads in place. The tensor has no storage: every torch operation on it runs on its dequantized values (a new
    float tensor each time), so other attention implementations compute attention over the same values.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, blocks: Quantized, dtype: torch.dtype):
        handle = torch.Tensor._make_wrapper_subclass(cls, blocks.shape, dtype=dtype, device="cpu",
                                                     requires_grad=False)
        handle.blocks = blocks
        return handle

    def dequantized(self) -> torch.Tensor:
        """The values as a new torch tensor of the handle's dtype."""
        values = torch.from_numpy(dequantize(self.blocks))
        return values if self.dtype == torch.float32 else values.to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*_plain(args), **{name: _plain(a) for name, a in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"QuantizedKV(qtype={self.blocks.qtype!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _plain(a):
    """``a`` with every ``QuantizedKV`` in it (an operation's argument, or a list or tuple of them) dequantized."""
    if isinstance(a, QuantizedKV):
        return a.dequantized()
    if isinstance(a, (list, tuple)):
        return type(a)(_plain(x) for x in a)
    return a


def _check_qtype(qtype) -> str:
    if not isinstance(qtype, str) or qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    return qtype


def _check_states(name: str, states, layer_idx) -> None:
    if not isinstance(states, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor (B, Hkv, N, D), got {type(states).__name__}")
    if states.ndim != 4:
        raise ValueError(f"{name} must have 4 axes (B, Hkv, N, D), got shape {tuple(states.shape)}")
    if states.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {states.dtype}")
    if states.shape[3] % BLOCK:
        raise ValueError(f"QuantizedKVCache stores blocks of {BLOCK} values along the head dimension: {name} of layer "
                         f"{layer_idx} has head_dim {states.shape[3]}, not a multiple of {BLOCK}; use "
                         f"transformers' DynamicCache for this model")


def _empty_rows(batch: int, heads: int, capacity: int, dim: int, qtype: str) -> Quantized:
    return Quantized(np.empty((batch, heads, capacity, dim // BLOCK * BLOCK_BYTES[qtype]), np.uint8), qtype)


def _flat(blocks: Quantized) -> Quantized:
    """The storage (B, Hkv, capacity, D) as one axis of rows (B·Hkv·capacity, D): a view of it (the storage is
    allocated contiguous; ``copy=False`` would raise rather than write into a copy)."""
    return Quantized(np.reshape(blocks.data, (-1, blocks.data.shape[-1]), copy=False), blocks.qtype)


def _flat_rows(states: np.ndarray) -> np.ndarray:
    """New rows (B, Hkv, N, D) as (B·Hkv·N, D) (a copy unless they are contiguous)."""
    return states.reshape(-1, states.shape[-1])


def _storage_rows(blocks: Quantized, held: int, n_new: int) -> np.ndarray:
    """The rows of ``_flat(blocks)`` that N new rows per (batch, head) go to, in ``_flat_rows``' order: one
    index array, so that a step's write is one ``set_rows`` call on 2-axis arrays (no leading axes to merge: 7.6 µs
    against 8.8 for the (B, Hkv, N, D) call at decode size)."""
    batch, heads, capacity = blocks.shape[:3]
    first = np.arange(batch * heads, dtype=np.int64) * capacity + held
    return (first[:, None] + np.arange(n_new, dtype=np.int64)).reshape(-1)


def _moved(blocks: Quantized, start: int, stop: int, capacity: int) -> Quantized:
    """Rows [start, stop) of ``blocks`` at the front of a new storage of ``capacity`` rows."""
    data = blocks.data
    moved = np.empty(data.shape[:2] + (capacity,) + data.shape[3:], np.uint8)
    moved[:, :, :stop - start] = data[:, :, start:stop]
    return Quantized(moved, blocks.qtype)


def _selected(blocks: Quantized, index: np.ndarray, stop: int) -> Quantized:
    """The storage of batch entries ``index`` (rows [0, stop) copied), of the same capacity."""
    data = blocks.data
    selected = np.empty((index.shape[0],) + data.shape[1:], np.uint8)
    selected[:, :, :stop] = data[index, :, :stop]
    return Quantized(selected, blocks.qtype)


class QuantizedKVLayer(CacheLayerMixin):
    """One full-attention layer of a ``QuantizedKVCache``: every row since the first token."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, qtype: str = "q8_0", layer_idx: int | None = None):
        # CacheLayerMixin.__init__ is not called: ``keys`` and ``values`` are views of the blocks (properties)
        self.qtype = _check_qtype(qtype)
        self.layer_idx = layer_idx
        self.is_initialized = False
        self.cumulative_length = 0  # tokens seen
        self.base = 0  # the position of storage row 0 (a sliding layer drops the rows before its window)
        self.key_blocks: Quantized | None = None
        self.value_blocks: Quantized | None = None
        self.dtype = None
        self.device = torch.device("cpu")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _check_states("key_states", key_states, self.layer_idx)
        _check_states("value_states", value_states, self.layer_idx)
        if key_states.device.type != "cpu":
            raise ValueError(f"key_states are on {key_states.device}; QuantizedKVCache runs on the CPU")
        if value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError(f"value_states must match key_states in (B, Hkv, N) {tuple(key_states.shape[:3])}, "
                             f"got {tuple(value_states.shape)}")
        batch, heads = key_states.shape[:2]
        self.key_blocks = _empty_rows(batch, heads, 0, key_states.shape[3], self.qtype)
        self.value_blocks = _empty_rows(batch, heads, 0, value_states.shape[3], self.qtype)
        self.dtype = key_states.dtype
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[QuantizedKV, QuantizedKV]:
        """Quantize the new rows into the storage; return handles on the rows attention reads (the new ones
        included), as many as ``get_mask_sizes`` gave before this call."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        expected = (self.key_blocks.shape[0], self.key_blocks.shape[1])
        for name, states, blocks in (("key_states", key_states, self.key_blocks),
                                     ("value_states", value_states, self.value_blocks)):
            if (tuple(states.shape[:2]) != expected or states.shape[3] != blocks.shape[3]
                    or states.shape[2] != key_states.shape[2]):
                raise ValueError(f"{name} must have shape (B, Hkv, N, D) = {expected + ('N', blocks.shape[3])} as "
                                 f"the rows already cached in layer {self.layer_idx}, got {tuple(states.shape)}")
        n_new = key_states.shape[2]
        _, kv_offset = self.get_mask_sizes(n_new)
        self._reserve(n_new)
        held = self.cumulative_length - self.base
        rows = _storage_rows(self.key_blocks, held, n_new)
        set_rows(_flat(self.key_blocks), _flat_rows(as_array("key_states", key_states)), rows)
        set_rows(_flat(self.value_blocks), _flat_rows(as_array("value_states", value_states)), rows)
        self.cumulative_length += n_new
        return self._handles(kv_offset - self.base, held + n_new)

    def _handles(self, start: int, stop: int) -> tuple[QuantizedKV, QuantizedKV]:
        k, v = self.key_blocks, self.value_blocks
        return (QuantizedKV(Quantized(k.data[:, :, start:stop], k.qtype), self.dtype),
                QuantizedKV(Quantized(v.data[:, :, start:stop], v.qtype), self.dtype))

    def first_needed(self) -> int:
        """The position of the oldest row a later step can read."""
        return self.base

    def _reserve(self, n_new: int) -> None:
        """Room for ``n_new`` more rows: a new storage holding the rows still needed when the present one is
        full, or mostly rows no later step reads."""
        held = self.cumulative_length - self.base
        capacity = self.key_blocks.shape[2]
        keep_from = self.first_needed()
        dropped = keep_from - self.base
        if held + n_new <= capacity and 2 * dropped <= capacity:
            return
        need = self.cumulative_length - keep_from + n_new
        size = need + max(need // GROWTH_DIVISOR, MIN_GROWTH)
        if dropped:  # a window's storage: the next move after as many tokens as it keeps
            size = max(size, 2 * need)
        self.key_blocks = _moved(self.key_blocks, dropped, held, size)
        self.value_blocks = _moved(self.value_blocks, dropped, held, size)
        self.base = keep_from

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    @property
    def keys(self) -> QuantizedKV | None:
        """The rows the next step reads besides its own, as a ``QuantizedKV`` (None before the first update)."""
        return self._live(self.key_blocks)

    @property
    def values(self) -> QuantizedKV | None:
        return self._live(self.value_blocks)

    def _live(self, blocks: Quantized | None) -> QuantizedKV | None:
        if blocks is None:
            return None
        start = self.get_mask_sizes(0)[1] - self.base
        return QuantizedKV(Quantized(blocks.data[:, :, start:self.cumulative_length - self.base], blocks.qtype),
                           self.dtype)

    @property
    def nbytes(self) -> int:
        """The bytes of the K and V storage, its unused capacity included."""
        if not self.is_initialized:
            return 0
        return self.key_blocks.data.nbytes + self.value_blocks.data.nbytes

    def offload(self) -> None:
        """Nothing to do: the cache lives in CPU memory."""

    def prefetch(self) -> None:
        """Nothing to do: the cache lives in CPU memory."""

    def reset(self) -> None:
        """Drop the storage: the next update starts a new one."""
        self.key_blocks = self.value_blocks = None
        self.is_initialized = False
        self.cumulative_length = 0
        self.base = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a negative count, as ``DynamicLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the negative number of tokens to remove (DynamicLayer's convention), "
                             f"got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        remaining = max(self.cumulative_length + tokens_to_remove, 0)
        self._check_crop(remaining)
        self.cumulative_length = remaining

    def _check_crop(self, remaining: int) -> None:
        """A full layer holds every row: any crop is possible."""

    def _select_batch(self, index: np.ndarray) -> None:
        if self.is_initialized:
            held = self.cumulative_length - self.base
            self.key_blocks = _selected(self.key_blocks, index, held)
            self.value_blocks = _selected(self.value_blocks, index, held)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Batch entry ``b`` becomes the former entry ``beam_idx[b]`` (beam search)."""
        self._select_batch(np.asarray(beam_idx.cpu().numpy(), np.int64))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_batch(np.repeat(np.arange(self.key_blocks.shape[0]), repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch entries ``indices`` (integers or a boolean mask)."""
        if self.is_initialized:
            self._select_batch(np.arange(self.key_blocks.shape[0])[indices.cpu().numpy()])


class QuantizedSlidingWindowKVLayer(QuantizedKVLayer):
    """A sliding-window layer of a ``QuantizedKVCache``: ``DynamicSlidingWindowLayer``'s sizes and rows."""

    is_sliding = True

    def __init__(self, sliding_window: int, qtype: str = "q8_0", layer_idx: int | None = None):
        super().__init__(qtype, layer_idx)
        if not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
        self.sliding_window = sliding_window
        self.record_past = False

    def activate_past_recording(self, **kwargs) -> None:
        """Keep every row (the window's rows never move) while ``record_past`` is True, so that ``crop`` can roll
        steps back: transformers' assisted decoding sets it, and clears ``record_past`` when it is done."""
        self.record_past = True

    def first_needed(self) -> int:
        if self.record_past:
            return self.base
        return max(self.base, self.cumulative_length - self.sliding_window + 1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        if self.cumulative_length >= self.sliding_window:
            return self.sliding_window - 1 + query_length, kv_offset
        return self.cumulative_length + query_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def _check_crop(self, remaining: int) -> None:
        if max(remaining - self.sliding_window + 1, 0) < self.base:
            raise RuntimeError(f"crop to {remaining} tokens needs rows this sliding-window layer (layer "
                               f"{self.layer_idx}) has already dropped; call cache.activate_past_recording() "
                               f"before the steps to roll back")


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` storing every layer's K and V as Q8_0 or Q4_0 blocks (ggml's layout), read in
    place by the "fastattn" attention backend.

    ``config``: the model's config (its decoder config gives the layer types: full attention, sliding or
    chunked windows, and KV-sharing layers without a cache of their own). ``qtype``: "q8_0" (34 bytes per 32
    values, 0.27× float32) or "q4_0" (18 bytes, 0.14×). Head dimensions must be multiples of 32.
    """

    def __init__(self, config: PreTrainedConfig, qtype: str = "q8_0"):
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(f"config must be a transformers PreTrainedConfig (model.config), got "
                            f"{type(config).__name__}")
        self.qtype = _check_qtype(qtype)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        layers, unsupported = [], []
        for layer_idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if layer_type == "full_attention":
                layers.append(QuantizedKVLayer(qtype, layer_idx))
            elif layer_type in ("sliding_attention", "chunked_attention"):
                layers.append(QuantizedSlidingWindowKVLayer(kwargs["sliding_window"], qtype, layer_idx))
            elif layer_type == "dummy":
                layers.append(DummyLayer())
            else:
                unsupported.append(layer_type)
        if unsupported:
            raise ValueError(f"QuantizedKVCache holds full-attention and sliding-window layers; this model also has "
                             f"{sorted(set(unsupported))}: use transformers' DynamicCache for it")
        super().__init__(layers=layers)

    @property
    def nbytes(self) -> int:
        """The bytes the cache's storage holds: every layer's K and V blocks, unused capacity included."""
        return sum(layer.nbytes for layer in self.layers if isinstance(layer, QuantizedKVLayer))

    def __repr__(self) -> str:
        return f"QuantizedKVCache(qtype={self.qtype!r}, layers={len(self.layers)}, nbytes={self.nbytes})"

"""CPU torch tensors wherever an op takes an ndarray: read through NumPy without a copy.

``accept_tensors(op)`` wraps a public op (fast or reference). A call whose arguments hold no torch tensor goes
straight through (torch is never imported here: without ``torch`` in ``sys.modules`` no argument can be one).
Each tensor argument becomes the ndarray that shares its memory, so an op writing ``out=``/``dst`` writes the
tensor itself; results are ndarrays. float16 stays float16; bfloat16 becomes ``ml_dtypes.bfloat16`` through an
int16 view of the same bytes. Refused, with the argument's name: tensors on another device, tensors that
require grad (fastattn computes no gradient: call under ``torch.no_grad()`` or ``.detach()``), and layouts
NumPy cannot view (sparse, conjugate or negative views).
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable

import numpy as np

from . import validate as _validate


def as_array(name: str, t) -> np.ndarray:
    """The ndarray sharing ``t``'s memory (``t`` a torch tensor), or a ``TypeError``/``ValueError`` naming it."""
    try:  # torch's own view refuses every tensor the checks below refuse (and bfloat16): tried first, it is cheap
        return t.numpy()
    except (TypeError, RuntimeError):
        pass
    torch = sys.modules["torch"]
    if t.device.type != "cpu":
        raise ValueError(f"{name} is a torch tensor on {t.device}; fastattn runs on the CPU: pass {name}.cpu()")
    if t.requires_grad:
        raise ValueError(f"{name} is a torch tensor that requires grad; fastattn computes no gradient: call it "
                         f"under torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")
    if t.layout != torch.strided:
        raise TypeError(f"{name} is a {t.layout} torch tensor; pass a dense one ({name}.to_dense())")
    if t.is_conj() or t.is_neg():
        raise TypeError(f"{name} is a lazily conjugated or negated torch view; pass {name}.resolve_conj()"
                        f".resolve_neg()")
    if t.dtype == torch.bfloat16:
        try:
            import ml_dtypes  # noqa: F401  (imported here only: it takes over a second; see _validate)
        except ImportError:
            raise TypeError(f"{name} is a bfloat16 torch tensor; reading it needs ml_dtypes "
                            f"(pip install 'fastattn[bf16]')") from None
        return t.view(torch.int16).numpy().view(_validate.bfloat16())
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as error:
        raise TypeError(f"{name}: this torch tensor has no NumPy view ({error})") from None


#: Classes no torch tensor has: an argument of one is passed on without ``isinstance``, which costs about 0.2 us
#: against ``torch.Tensor`` (its metaclass checks), a third of a decode-sized call's own time.
_PLAIN = frozenset({np.ndarray, float, int, bool, str, type(None), np.float32, np.float64, np.int32, np.int64})


def _holds_tensor(values, tensor) -> bool:
    for a in values:
        if a.__class__ not in _PLAIN and isinstance(a, tensor):
            return True
    return False


def accept_tensors(op: Callable) -> Callable:
    """``op`` taking CPU torch tensors for any ndarray argument (see the module docstring)."""
    names = tuple(inspect.signature(op).parameters)

    @functools.wraps(op)
    def call(*args, **kwargs):
        torch = sys.modules.get("torch")
        if torch is not None:
            tensor = torch.Tensor
            if _holds_tensor(args, tensor):
                args = tuple(as_array(names[i] if i < len(names) else f"argument {i}", a)
                             if isinstance(a, tensor) else a for i, a in enumerate(args))
            if kwargs and _holds_tensor(kwargs.values(), tensor):
                kwargs = {k: as_array(k, a) if isinstance(a, tensor) else a for k, a in kwargs.items()}
        return op(*args, **kwargs)

    return call


def as_tensor(a: np.ndarray):
    """The CPU torch tensor sharing ``a``'s memory (bfloat16 through an int16 view of the same bytes)."""
    torch = sys.modules["torch"]
    if _validate.is_bfloat16(a.dtype):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def tensors_in_tensors_out(op: Callable) -> Callable:
    """``accept_tensors(op)``, and when its first argument is a torch tensor, each ndarray ``op`` returns (alone or
    in a tuple) comes back as the torch tensor sharing its memory (``as_tensor``): FlashAttention's functions
    answer a torch call with torch tensors."""
    inner = accept_tensors(op)
    first_name = next(iter(inspect.signature(op).parameters))

    @functools.wraps(op)
    def call(*args, **kwargs):
        result = inner(*args, **kwargs)
        torch = sys.modules.get("torch")
        first = args[0] if args else kwargs.get(first_name)
        if torch is None or first.__class__ in _PLAIN or not isinstance(first, torch.Tensor):
            return result
        if isinstance(result, tuple):
            return tuple(as_tensor(r) if isinstance(r, np.ndarray) else r for r in result)
        return as_tensor(result) if isinstance(result, np.ndarray) else result

    return call

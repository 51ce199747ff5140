"""The public namespace: what ``dir()`` shows, the version, the same signatures in ``fastattn`` and
``fastattn.reference``, and scalar arguments given as NumPy scalars, 0-d arrays or 0-d torch tensors."""
from __future__ import annotations

import importlib.metadata
import inspect
import re
import types

import numpy as np
import pytest

import fastattn
from fastattn import reference

OPS = [fastattn, reference]


@pytest.mark.parametrize("module", OPS, ids=["fastattn", "reference"])
def test_dir_shows_the_public_names_and_no_module(module):
    names = dir(module)
    assert set(module.__all__) <= set(names)
    for name in names:
        assert not isinstance(getattr(module, name), types.ModuleType), name
    assert "annotations" not in names and "importlib" not in names
    assert not [name for name in names if name.startswith("_") and not name.startswith("__")]
    for name in module.__all__:  # every public name resolves (fastattn's ops are loaded on first access)
        getattr(module, name)


def test_version_is_the_installed_distribution_s():
    try:
        expected = importlib.metadata.version("fastattn")
    except importlib.metadata.PackageNotFoundError:
        expected = "0+unknown"
    assert fastattn.__version__ == expected
    assert "__version__" in dir(fastattn)


def _shared_ops() -> list[str]:
    return sorted(name for name in set(fastattn.__all__) & set(reference.__all__)
                  if inspect.isfunction(getattr(fastattn, name)))


def test_every_shared_op_is_compared():
    assert {"flash_attn_ext", "rms_norm", "rope_cache", "rope_set_rows", "set_rows", "quantize"} <= set(_shared_ops())


@pytest.mark.parametrize("name", _shared_ops())
def test_fast_and_reference_signatures_are_identical(name):
    """Names, order, kinds (keyword-only or not), defaults and annotations of every parameter, and the return."""
    assert inspect.signature(getattr(fastattn, name)) == inspect.signature(getattr(reference, name))


# ---------------------------------------------------------------------------------------------------------------
# scalar arguments: a Python float, a NumPy scalar, a 0-d array and a 0-d torch tensor are the same number

def _torch_scalar(dtype: str):
    def make(value):
        torch = pytest.importorskip("torch")
        return torch.tensor(value, dtype=getattr(torch, dtype))
    return make


SCALARS = {  # every value used below is exact in float32
    "python": float,
    "numpy scalar": np.float64,
    "numpy float32 scalar": np.float32,
    "0-d array": np.array,
    "0-d float32 array": lambda x: np.array(x, np.float32),
    "0-d torch tensor": _torch_scalar("float32"),
    "0-d float64 torch tensor": _torch_scalar("float64"),
}


def _attention(ops, value, name):
    """A decode call without mask for ``scale``, a prefill call with an ALiBi-scaled mask for max_bias and
    logit_softcap."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 2, 9, 32), np.float32)
    if name == "scale":
        q = rng.standard_normal((1, 4, 1, 32), np.float32)
        return ops.flash_attn_ext(q, k, k, scale=value(0.125))
    q = rng.standard_normal((1, 4, 3, 32), np.float32)
    mask = rng.standard_normal((3, 9)).astype(np.float32)
    params = {"max_bias": 2.0, "logit_softcap": 8.0}
    params[name] = value(params[name])
    return ops.flash_attn_ext(q, k, k, mask, scale=0.125, **params)


def _norm(ops, value, name):
    x = np.random.default_rng(2).standard_normal((3, 64), np.float32)
    return ops.rms_norm(x, value(0.5))


def _rope(ops, value, name):
    x = np.random.default_rng(3).standard_normal((4, 2, 32), np.float32)
    pos = np.arange(4, dtype=np.int32)
    params = {"freq_base": 500000.0, "attn_factor": 0.5}
    params[name] = value(params[name])
    return ops.rope_ext(x, pos, n_dims=32, mode=fastattn.ROPE_NEOX, **params)


CALLS = {"scale": _attention, "max_bias": _attention, "logit_softcap": _attention, "eps": _norm,
         "freq_base": _rope, "attn_factor": _rope}


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("kind", SCALARS)
def test_scalars_as_numpy_scalars_0d_arrays_and_0d_tensors(ops, name, kind):
    call = CALLS[name]
    assert call(ops, SCALARS[kind], name).tobytes() == call(ops, float, name).tobytes()


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
def test_integer_scalars_as_0d_arrays(ops):
    x = np.random.default_rng(4).standard_normal((4, 2, 32), np.float32)
    pos = np.arange(4, dtype=np.int32)
    expected = ops.rope_ext(x, pos, n_dims=16, mode=fastattn.ROPE_NEOX, n_ctx_orig=4096, ext_factor=1.0)
    got = ops.rope_ext(x, pos, n_dims=np.array(16), mode=np.array(fastattn.ROPE_NEOX),
                       n_ctx_orig=np.int32(4096), ext_factor=1.0)
    assert got.tobytes() == expected.tobytes()
    with pytest.raises(TypeError, match=r"^n_dims must be an integer, got .*float64"):
        ops.rope_ext(x, pos, n_dims=np.array(16.0), mode=fastattn.ROPE_NEOX)


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("shape", [(1,), (2, 1)])
def test_scalars_with_axes_are_refused_by_name(ops, name, shape):
    expected = rf"^{name} must be a real number, got an ndarray of shape {re.escape(str(shape))}"
    with pytest.raises(TypeError, match=expected):
        CALLS[name](ops, lambda x: np.full(shape, x), name)


@pytest.mark.parametrize("ops", OPS, ids=["fast", "reference"])
def test_boolean_0d_arrays_are_not_numbers(ops):
    with pytest.raises(TypeError, match="^eps must be a real number, got bool"):
        _norm(ops, lambda x: np.array(True), "eps")

"""The public namespace: what ``dir()`` shows, the version, and the same signatures in ``fastattn`` and
``fastattn.reference``."""
from __future__ import annotations

import importlib.metadata
import inspect
import types

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

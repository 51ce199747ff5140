"""Numba's on-disk cache for fastattn's kernels, keyed on the sources of the whole package.

Numba checks a cached kernel against its own file's timestamp only. A kernel that inlines a helper from another
file (the decode loop inlines helpers from eight) would keep its old machine code after that helper is edited.
So every kernel of this package is cached in a directory named by a hash of all the package's ``.py`` files
(the NumPy reference, which holds no kernels, aside): an edit anywhere gives a new directory, and every kernel
is compiled again from the sources as they are.

Where: ``$NUMBA_CACHE_DIR/fastattn`` when ``NUMBA_CACHE_DIR`` is set, else ``$XDG_CACHE_HOME/fastattn`` or
``~/.cache/fastattn``; inside it ``<version>-<hash>/<sub-package>/``, the hash also covering the package's
location. Directories of other hashes not used for ``PRUNE_AFTER_DAYS`` are removed when a new one is made. ``install()`` puts the locator first in Numba's list;
kernels outside the package (or with no writable cache directory) fall back to Numba's own locators.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

from numba.core import caching, config

#: The package directory whose sources key the cache (``fastattn/``, above this ``_core`` module).
PACKAGE_DIR = Path(__file__).resolve().parent.parent
#: Sub-packages left out of the key: they hold no kernels and no kernel calls anything in them.
UNKEYED = ("reference",)
#: Other hashes' directories unused this long are removed when a new directory is made.
PRUNE_AFTER_DAYS = 7
_MARK = "last-used"


def source_hash(package_dir: Path = PACKAGE_DIR) -> str:
    """SHA-256 (first 16 hex digits) of the package's location and every keyed ``.py`` file's relative path and
    bytes, in path order. The location keeps two installs of the same sources (a checkout and a wheel) apart:
    Numba's index also records each file's timestamp, and two installs sharing a directory would keep replacing
    each other's entries."""
    digest = hashlib.sha256(str(package_dir).encode() + b"\0")
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir)
        if relative.parts[0] in UNKEYED:
            continue
        digest.update(relative.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """The directory that holds one sub-directory per source hash."""
    if config.CACHE_DIR:
        return Path(config.CACHE_DIR) / "fastattn"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastattn"


def _version() -> str:
    from .. import __version__
    return __version__.replace(os.sep, "_")


_directory: Path | None = None


def cache_directory() -> Path:
    """This package's cache directory (``<root>/<version>-<hash>``), made on first use; older ones pruned."""
    global _directory
    if _directory is None:
        root = cache_root()
        directory = root / f"{_version()}-{source_hash()}"
        if not directory.exists():
            _prune(root)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / _MARK).touch()
        _directory = directory
    return _directory


def _prune(root: Path) -> None:
    """Remove the directories of other hashes whose mark is older than ``PRUNE_AFTER_DAYS``."""
    if not root.is_dir():
        return
    limit = time.time() - PRUNE_AFTER_DAYS * 86400
    for other in root.iterdir():
        mark = other / _MARK
        try:
            stale = mark.stat().st_mtime < limit
        except OSError:
            continue  # not one of ours, or removed meanwhile
        if stale:
            shutil.rmtree(other, ignore_errors=True)


class SourceHashLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """Numba cache locator for the package's kernels: ``cache_directory()/<the file's sub-package>``."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        relative = Path(py_file).resolve().parent.relative_to(PACKAGE_DIR)
        self._cache_path = str(cache_directory().joinpath(*relative.parts))

    def get_cache_path(self):
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            Path(py_file).resolve().relative_to(PACKAGE_DIR)
        except ValueError:
            return None  # not this package's: Numba's own locators decide
        try:
            return super().from_function(py_func, py_file)
        except OSError:
            return None  # no writable cache directory here


def install() -> None:
    """Put ``SourceHashLocator`` first in Numba's locator list (once)."""
    locators = caching.CacheImpl._locator_classes
    if SourceHashLocator not in locators:
        locators.insert(0, SourceHashLocator)

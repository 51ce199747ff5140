"""Package discovery: every package under ``fastattn/``, and the NumPy reference, which lives in ``reference/``
and installs as ``fastattn.reference``. The rest of the metadata is in pyproject.toml."""
from setuptools import find_packages, setup

reference = ["fastattn.reference"] + [f"fastattn.reference.{p}" for p in find_packages("reference")]
setup(packages=find_packages(include=["fastattn", "fastattn.*"]) + reference,
      package_dir={"fastattn.reference": "reference"})

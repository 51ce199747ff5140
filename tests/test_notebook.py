"""docs/quickstart.ipynb runs top to bottom (its own asserts check fast against reference)."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_executes(path):
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(DOCS)}}).execute()

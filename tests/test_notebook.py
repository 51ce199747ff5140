"""docs/quickstart.ipynb runs top to bottom (its own asserts check fast against reference) and draws its figure."""
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_executes(path, monkeypatch):
    # the kernel runs in docs/: it imports the fastattn of this checkout, as the tests do
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(DOCS)}}).execute()
    for cell in notebook.cells:
        if cell.cell_type == "code" and "plt.show()" in cell.source:
            # the figure is shown inline: an image in the cell's outputs, not a figure left unshown
            assert any("image/png" in out.get("data", {}) for out in cell.outputs), cell.outputs
    printed = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for out in cell.outputs)
    assert "identical: False" not in printed  # no comparison printed as a bare failure without its reason

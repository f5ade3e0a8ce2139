"""Tutorial notebooks run top to bottom in a real Jupyter kernel (nbclient)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs"


def test_quickstart_trains_and_recovers(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "01_quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(_stream_text(c) for c in nb.cells if c.cell_type == "code")
    for epoch in range(5):
        assert f"[rank 0] epoch {epoch}: loss" in text
    assert "[rank 1] rank 1 of 2 done" in text
    assert "loss per epoch:" in text
    assert "rank 1 failed: RuntimeError: simulated crash on rank 1 (cell line 7)" in text
    assert "[rank 1] rank 1 finished in attempt 1" in text
    assert "succeeded, world size 2, restarts 1/1" in text

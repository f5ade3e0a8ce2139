"""Tutorial notebooks run top to bottom in a real Jupyter kernel (nbclient)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _text(cell) -> str:
    """What a reader sees without a kernel: streams and the plain-text of displays."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif "data" in output:
            parts.append(output.data.get("text/plain", ""))
    return "".join(parts)


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
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    # The dashboards were replaced by static records that render without a kernel.
    for epoch in range(5):
        assert f"[rank 0] epoch {epoch}: loss" in text
    assert "[rank 1] rank 1 of 2 done" in text
    assert "loss per epoch:" in text
    assert "rank 1 failed: RuntimeError: simulated crash on rank 1 (cell line 7)" in text
    assert "[rank 1] rank 1 finished in attempt 1" in text
    assert "succeeded · world size 2 · 1 node · restarts 1/1" in text
    html = [o.data["text/html"] for c in nb.cells for o in c.get("outputs", [])
            if "data" in o and "text/html" in o.data]
    assert len(html) == 2 and all("elastic-record" in h for h in html)


def test_elastic_training_recovers_and_resizes(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "02_elastic_training.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "starting at step 30 with world size 2" in text  # the restart resumed
    assert "same parameters as the uninterrupted run, bit for bit" in text
    assert "resize to 3 workers requested" in text and "resize to 1 worker requested" in text
    assert "succeeded, world size 1, restarts 0/0" in text and "resizes: 2" in text
    assert "same parameters as the uninterrupted run\n" in text


def test_multi_node_tutorial_joins_resizes_and_leaves(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "03_multi_node.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    # The printed command keeps the token off the joining machine's command line.
    assert re.search(r"ELASTIC_MAGIC_TOKEN=[0-9a-f]{32} elastic-magic join 127\.0\.0\.1:\d+",
                     text), text
    assert "--token" not in text
    assert "running: world size 2, machines 2" in text  # the other machine joined
    assert "running: world size 3, machines 2" in text  # this machine grew to 2 workers
    assert "other machine exited with 130" in text
    assert "running: world size 2, machines 1" in text  # it left; the job went on here
    assert "restarts: 0" in text and "same parameters as the run on one machine" in text
    # From its own log. Which round: a machine that arrives during a round's last call waits
    # for the next one, so there may be one more.
    assert re.search(r"rendezvous round \d+: world size 3 on 2 nodes", text), text


def test_sessions_tutorial_keeps_state_recovers_and_resizes(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "04_sessions.ipynb", as_version=4)
    before = sorted(p.name for p in NOTEBOOKS.iterdir())
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "[rank 1] rank 1 ready at step 0" in text
    assert re.search(r"\[rank 0\] step 20: loss \d", text), text
    assert "loss after 10 more steps" in text
    assert "rank 1 failed: killed by SIGKILL" in text
    assert "session re-formed: 1 setup cell replayed, State at step 30; world size 2" in text
    assert "[rank 1] rank 1: step 30" in text
    assert "[rank 2] rank 2 of 3: step 30" in text
    assert "restarts: 1/3" in text and "session ended" in text
    assert sorted(p.name for p in NOTEBOOKS.iterdir()) == before  # nothing left behind

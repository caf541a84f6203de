"""examples/notebook.ipynb runs top to bottom on the real pair (so it cannot rot)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.pair

NOTEBOOK = Path(__file__).parent.parent / "examples" / "notebook.ipynb"


def test_the_notebook_runs_top_to_bottom(tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    pictures = [output["data"]["image/png"] for output in outputs if "image/png" in output.get("data", {})]
    if target := os.environ.get("AGENTKV_NOTEBOOK_OUT"):  # keep what it drew (for the docs)
        Path(target).mkdir(parents=True, exist_ok=True)
        for index, picture in enumerate(pictures):
            (Path(target) / f"notebook-plot-{index}.png").write_bytes(base64.b64decode(picture))
        nbformat.write(notebook, Path(target) / "notebook.executed.ipynb")
    text = "".join(output.get("text", "") for output in outputs)
    assert "answers equal across modes: True" in text
    assert "engine processes still running: none" in text
    assert len(pictures) == 2  # the session's plot and the three modes'

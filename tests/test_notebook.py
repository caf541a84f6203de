"""examples/notebook.ipynb runs top to bottom on the real engines (so it cannot rot).

On a landing its cells run in this process, in an IPython shell (top-level ``await`` included),
on the suite's shared pair and colocated engine (tests/lending.py): the notebook's own
``EmbeddedPair(...).start()`` and ``Colocated(...).start()`` borrow them. The nightly tier runs
it as a user does, in a Jupyter kernel that starts its own engines, and checks that closing them
left no process.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from agentkv import Colocated, EmbeddedPair
from lending import lending

pytestmark = pytest.mark.pair

NOTEBOOK = Path(__file__).parent.parent / "examples" / "notebook.ipynb"


@contextlib.contextmanager
def _ipython() -> Iterator[object]:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        yield shell
    finally:
        InteractiveShell.clear_instance()


def test_the_notebook_runs_top_to_bottom_on_the_shared_engines(
    pair: EmbeddedPair, colocated: Colocated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    printed, pictures = io.StringIO(), 0
    with lending(pair=pair, colocated=colocated) as lender, _ipython() as shell:
        for cell in notebook.cells:
            if cell.cell_type != "code":
                continue
            with contextlib.redirect_stdout(printed):
                result = shell.run_cell(cell.source, store_history=True)  # type: ignore[attr-defined]
            result.raise_error()  # the cell's own exception, with its traceback
            pictures += hasattr(result.result, "savefig") or hasattr(result.result, "_repr_png_")
    text = printed.getvalue()
    assert lender.lent == ["EmbeddedPair", "Colocated"] and not lender.refused
    assert "answers equal across modes: True" in text
    assert pictures == 2  # the session's plot and the three modes'
    # The last cell closes what the notebook opened: its sessions close; the lent engines are the suite's
    # (their close is a no-op here), so the only processes it finds running are theirs.
    still = text.rsplit("engine processes still running:", 1)[1].split("\n", 1)[0].strip()
    assert still == "none" or {int(p) for p in still.strip("{}").split(",")} <= pair.pids | colocated.pids
    assert pair.is_open and colocated.is_open


@pytest.mark.nightly
def test_the_notebook_runs_top_to_bottom_in_a_kernel(tmp_path: Path) -> None:
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

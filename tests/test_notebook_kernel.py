"""In a real Jupyter kernel, on the scripted engine: re-running a cell and interrupting a turn."""

from __future__ import annotations

import os
import signal
import threading

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def _outputs(cell: nbformat.NotebookNode) -> str:
    return "".join(output.get("text", "") for output in cell.get("outputs", []))


def _run(client: NotebookClient, notebook: nbformat.NotebookNode, source: str) -> str:
    cell = nbformat.v4.new_code_cell(source)
    notebook.cells.append(cell)
    client.execute_cell(cell, len(notebook.cells) - 1)
    return _outputs(cell)


def test_rerunning_a_cell_closes_what_its_last_run_started_and_ctrl_c_keeps_the_session() -> None:
    notebook = nbformat.v4.new_notebook()
    client = NotebookClient(notebook, timeout=120, kernel_name="python3")
    with client.setup_kernel():
        _run(client, notebook, "from agentkv.testing import ScriptedEngine\nfrom agentkv import Session\nstarted = []")
        make = "engine = ScriptedEngine(['one', 'two', 'three'], delay_s=0.1).start()\nstarted.append(engine)"
        _run(client, notebook, make)
        _run(client, notebook, make)  # the same cell, run again
        assert _run(client, notebook, "print([e.is_open for e in started])").strip() == "[False, True]"
        loop = "for _ in range(2):\n    started.append(ScriptedEngine(['x']).start())"
        _run(client, notebook, loop)  # one line, two engines in one run: both stay open
        assert _run(client, notebook, "print([e.is_open for e in started[2:]])").strip() == "[True, True]"
        _run(client, notebook, loop)
        assert _run(client, notebook, "print([e.is_open for e in started[2:]])").strip() == "[False, False, True, True]"
        _run(client, notebook, "for e in started[4:]: e.close()")

        _run(client, notebook, "s = Session(engine=engine).start()\nprint(s.run_sync('a').text)")
        _run(client, notebook, "engine._delay_s = 60")
        stop_button = (os.kill, (client.km.provisioner.pid, signal.SIGINT))  # what Jupyter's stop button sends
        timer = threading.Timer(3.0, *stop_button)
        timer.start()
        with pytest.raises(CellExecutionError, match="KeyboardInterrupt"):
            _run(client, notebook, "s.run_sync('b')")
        timer.join()
        after = _run(client, notebook, "engine._delay_s = 0\nprint(len(s.messages), s.run_sync('b').text)")
        assert after.split() == ["2", "two"]  # the interrupted turn left nothing; the next one runs
        _run(client, notebook, "s.close(); engine.close()")

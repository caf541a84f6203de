"""Re-running a notebook cell replaces what that cell started, instead of leaking it.

ipykernel compiles each cell to a file named after a hash of its code, so a re-run of the
same cell has the same file name and line. ``start()`` of an engine or a session made in a
cell closes what the same line started on an earlier run of a cell (IPython's execution
count tells runs apart; a loop that starts several in one run keeps them all), so a re-run
cell never leaves an engine's processes behind. Outside notebooks nothing is tracked.
"""

from __future__ import annotations

import logging
import re
import sys
import weakref
from typing import Protocol

__all__ = ["replace_previous_from_this_cell"]

logger = logging.getLogger("agentkv")

_CELL_FILE = re.compile(r"ipykernel_\d+[/\\]\d+\.py$|^<ipython-input-")


class Closable(Protocol):
    @property
    def is_open(self) -> bool: ...

    def close(self) -> None: ...


_started: dict[tuple[str, int], tuple[int | None, list[weakref.ref[Closable]]]] = {}
"""Per cell line: the cell run (IPython's execution count) that last started something there, and what."""


def _cell_run() -> int | None:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "execution_count", None)


def replace_previous_from_this_cell(started: Closable, *, depth: int = 2) -> None:
    """Called by ``start()`` (`agentkv._lifecycle.Lifecycle`): close what the calling notebook line started on an
    earlier run.

    Several objects started by one line in one run (a loop) are all kept.
    """
    caller = sys._getframe(depth)
    filename = caller.f_code.co_filename
    if not _CELL_FILE.search(filename):
        return
    key, run = (filename, caller.f_lineno), _cell_run()
    previous_run, references = _started.get(key, (run, []))
    if previous_run != run:
        for reference in references:
            previous = reference()
            if previous is not None and previous.is_open:
                logger.warning("agentkv: closing the %s this cell started on its previous run", type(previous).__name__)
                previous.close()
        references = []
    _started[key] = (run, [*references, weakref.ref(started)])

"""SIGINT (a terminal's Ctrl-C) and SIGTERM for a foreground server that starts engines: a stop in order, always.

``agentkv serve`` starts its engines (a minute on a small CPU machine), serves, and stops: the door, then the
pool's sessions (releasing their pins), then the engines. A signal may come at any of these moments, to the
process alone or to its whole process group (the engine processes are in groups of their own and never
get it: ``run_engine_core_in_own_group`` in ``src/_agentkv_vllm/_patches.py``), and more than one may come.
`StopSignals` turns each into the same stop:

* **while starting** (engines starting or warming up), the first signal raises ``KeyboardInterrupt`` in the
  main thread, SIGTERM as Ctrl-C does: the start-up unwinds, and stops what it started once it is up;
* **while serving**, it sets `StopSignals.requested`, and the main thread stops the door (its requests in
  flight end with an error) and then the pool;
* **any later signal** is noted once on stderr and otherwise ignored: the stop under way is bounded (each
  engine gets 30 s to stop, then it is killed), and a stop cut short would leave the engines' processes and
  shared memory behind. SIGKILL still ends the process at once; the engines then stop on their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

__all__ = ["StopSignals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """SIGINT and SIGTERM handlers, from ``with`` to its end (the main thread only; elsewhere it installs nothing)."""

    def __init__(self, command: str = "agentkv") -> None:
        self.requested = threading.Event()
        """Set by the first signal."""
        self.received: int | None = None
        """The first signal's number."""
        self._command = command
        self._serving = False
        self._noted = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def serving(self) -> None:
        """The server runs: from now on a signal asks for a stop (`requested`) instead of interrupting."""
        self._serving = True

    @property
    def exit_code(self) -> int:
        """The shell's code for a command ended by the first signal (128 + its number), or 0 if none came."""
        return 0 if self.received is None else 128 + self.received

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            self.requested.set()
            _say(f"{self._command}: stopping (the engines take a few seconds)")
            if not self._serving:
                raise KeyboardInterrupt
        elif not self._noted:
            self._noted = True
            _say(f"{self._command}: stopping already, in order (SIGKILL would end it at once)")


def _say(line: str) -> None:
    """One line on stderr, written at once: a handler that printed could interrupt a print under way."""
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), f"{line}\n".encode())

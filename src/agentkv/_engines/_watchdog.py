"""A watchdog process that stops engine processes if this process dies without closing them.

agentkv's exit hook (``_vllm.py``) covers a normal exit and Ctrl-C, but not SIGTERM or SIGKILL
of the Python process that embeds the engines; vLLM's engine cores then keep running as orphans. The watchdog is
a small process that holds the read end of a pipe from this process: it learns the engine
pids as they start and stop, and when the pipe closes or this process is gone (however it
ended) it terminates every pid still registered. Both: the engine processes vLLM forks inherit the
pipe's write end, so while they run the pipe does not close when this process dies; the watchdog then
sees that its parent changed (an orphan is re-parented). The watchdog's code is in
``src/agentkv/_engines/_watchdog_process.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = ["forget_pids", "stop_watching", "watch_pids"]

logger = logging.getLogger("agentkv")

_WATCHDOG = Path(__file__).with_name("_watchdog_process.py")
"""The watchdog's own code, run as a script (see its docstring); ``-P``: its folder, whose modules are
agentkv's, is not put on its import path."""

_lock = threading.Lock()
_process: subprocess.Popen[str] | None = None


def _send(lines: Iterable[str]) -> None:
    global _process
    with _lock:
        if _process is None or _process.poll() is not None:
            _process = subprocess.Popen(
                [sys.executable, "-P", str(_WATCHDOG), str(os.getpid())],
                stdin=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )  # not in our process group: Ctrl-C spares it
        assert _process.stdin is not None
        try:
            _process.stdin.writelines(lines)
            _process.stdin.flush()
        except OSError:  # the watchdog is gone; the next call starts another
            logger.warning("agentkv: the engine watchdog died")


def watch_pids(pids: Iterable[int]) -> None:
    """Have these processes stopped if this process dies without stopping them."""
    _send(f"+{pid}\n" for pid in pids)


def forget_pids(pids: Iterable[int]) -> None:
    """These processes were stopped properly; stop watching them."""
    if _process is not None:
        _send(f"-{pid}\n" for pid in pids)


def stop_watching() -> None:
    """Let the watchdog go (agentkv's exit hook, once the engines are stopped): it ends the pids
    still registered, if any, and exits."""
    with _lock:
        if _process is not None and _process.stdin is not None:
            with contextlib.suppress(OSError):
                _process.stdin.close()

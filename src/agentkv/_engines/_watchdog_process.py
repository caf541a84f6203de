"""The watchdog process itself (started by ``src/agentkv/_engines/_watchdog.py``): it reads ``+pid`` and ``-pid``
lines from its stdin, and when its stdin closes or its owner is gone, terminates the pids still registered.

Run as a script by its path (``python .../_watchdog_process.py OWNER_PID``), not with ``-m``: it needs only the
standard library, and starts without importing agentkv (and what agentkv imports).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["main"]

_POLL_S = 0.5
"""How often the watchdog checks that its owner is still its parent."""

_GRACE_S = 3.0
"""How long the pids get after SIGTERM before SIGKILL (and after SIGKILL, before the watchdog exits)."""


def main(owner: int) -> None:
    """Watch until stdin closes or ``owner`` is no longer this process's parent, then stop the registered pids."""
    pids: set[int] = set()

    def read() -> None:
        for line in sys.stdin:
            sign, pid = line[0], int(line[1:])
            (pids.add if sign == "+" else pids.discard)(pid)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while reader.is_alive() and os.getppid() == owner:
        reader.join(_POLL_S)
    reader.join(_POLL_S)  # the owner is gone: what it wrote before is still read
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in list(pids):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(_GRACE_S)


if __name__ == "__main__":
    main(int(sys.argv[1]))

"""The check that closed engines freed their TCP ports, for the leak tests.

A port is leaked when, after the engine closed, it is still listening and held by a process born
while the test ran (an engine's process, or a child it left behind) or by the test process. A
port that a process which already ran before the test took up again once it was free (a shared
pair or a kernel of another test binding port 0) was freed, and reused: not a leak.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from agentkv._engines._system import listening_ports, port_holders, running_pids

__all__ = ["assert_ports_freed", "running_pids"]


def assert_ports_freed(ports: Iterable[int], *, running_before: set[int], wait_s: float = 5.0) -> None:
    """Fail if one of ``ports`` is still held by a process not in ``running_before`` (or by this one)."""
    wanted = set(ports)
    deadline = time.monotonic() + wait_s
    while (still := listening_ports() & wanted) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = {
        port: holders
        for port, holders in port_holders(still).items()
        if not holders or holders - running_before or os.getpid() in holders
    }
    assert not leaked, "ports still listening: " + "; ".join(
        f"{port} held by {_describe(holders)}" for port, holders in sorted(leaked.items())
    )


def _describe(pids: set[int]) -> str:
    if not pids:
        return "no process this user can see"
    return ", ".join(f"{pid} ({_command(pid)})" for pid in sorted(pids))


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "gone"

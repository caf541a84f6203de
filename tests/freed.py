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

import psutil

__all__ = ["assert_ports_freed", "listening_ports", "port_holders", "running_pids"]


def running_pids() -> set[int]:
    """Every process on this host."""
    return set(psutil.pids())


def _listening() -> list[tuple[int, int | None]]:
    """(port, holder pid or None where this user cannot see it) for each TCP socket in LISTEN state on this host."""
    return [
        (connection.laddr.port, connection.pid)
        for connection in psutil.net_connections(kind="tcp")
        if connection.status == psutil.CONN_LISTEN and connection.laddr
    ]


def listening_ports(*, held_by: Iterable[int] | None = None) -> set[int]:
    """TCP ports in LISTEN state on this host; with ``held_by``, only those whose socket one of these pids holds."""
    holders = None if held_by is None else set(held_by)
    return {port for port, pid in _listening() if holders is None or pid in holders}


def port_holders(ports: Iterable[int]) -> dict[int, set[int]]:
    """For each of ``ports`` in LISTEN state, the processes holding its socket (an empty set: none this user can see)."""
    wanted = set(ports)
    holders: dict[int, set[int]] = {}
    for port, pid in _listening():
        if port in wanted:
            holders.setdefault(port, set()).update({pid} if pid is not None else set())
    return holders


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

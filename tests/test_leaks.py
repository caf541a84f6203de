"""Leaks: opening and closing sessions and pairs, over and over, leaves nothing behind.

Counted before and after: processes below this one, threads, open file descriptors,
/dev/shm segments, listening TCP ports of this process and its children, and vLLM's IPC socket files
(ZMQ leaves them behind: each engine has a folder for them, removed when it stops).
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from dataclasses import dataclass

import pytest

from agentkv import EmbeddedPair, Session
from agentkv._engines._system import descendants, is_helper
from freed import listening_ports

pytestmark = pytest.mark.pair

THREAD_SLACK = 2
"""anyio keeps idle worker threads (tokenizer loads, sync tools) for 10 s before they exit, and
the number alive at a given moment depends on how many ran at once: a couple more or fewer
threads is not a leak; a leak grows with the cycles (10 on a landing, 100 nightly)."""


@dataclass(frozen=True)
class Footprint:
    children: frozenset[int]
    threads: int
    fds: int
    shm: frozenset[str]
    ports: frozenset[int]
    ipc: frozenset[str]

    def growth(self, later: Footprint) -> list[str]:
        found = []
        if later.children - self.children:
            found.append(f"processes {sorted(later.children - self.children)}")
        if later.threads > self.threads + THREAD_SLACK:
            found.append(f"threads {self.threads} -> {later.threads}")
        if later.fds > self.fds:
            found.append(f"file descriptors {self.fds} -> {later.fds}")
        if later.shm - self.shm:
            found.append(f"/dev/shm segments {sorted(later.shm - self.shm)}")
        if later.ports - self.ports:
            found.append(f"listening ports {sorted(later.ports - self.ports)}")
        if later.ipc - self.ipc:
            found.append(f"IPC sockets or their folders {sorted(later.ipc - self.ipc)}")
        return found


def footprint() -> Footprint:
    children = frozenset(pid for pid in descendants(os.getpid()) if not is_helper(pid))
    return Footprint(
        children=children,
        threads=threading.active_count(),
        fds=len(os.listdir("/proc/self/fd")),
        shm=frozenset(os.listdir("/dev/shm")),
        ports=frozenset(listening_ports(held_by={os.getpid(), *children})),
        ipc=ipc_leftovers(),
    )


def ipc_leftovers() -> frozenset[str]:
    """Socket files and engines' IPC folders (``agentkv-<engine>-*``) in the temporary folder."""
    folder = tempfile.gettempdir()
    found = set()
    for entry in os.scandir(folder):
        try:
            with_mode = entry.stat(follow_symlinks=False).st_mode
        except FileNotFoundError:  # gone meanwhile
            continue
        if stat.S_ISSOCK(with_mode) or (stat.S_ISDIR(with_mode) and entry.name.startswith("agentkv-")):
            found.add(entry.name)
    return frozenset(found)


@pytest.mark.parametrize("cycles", [pytest.param(10, id="10"), pytest.param(100, id="100", marks=pytest.mark.nightly)])
def test_sessions_opened_and_closed_on_a_shared_pair_leak_nothing(pair: EmbeddedPair, cycles: int) -> None:
    def cycle(number: int) -> None:
        with Session(engine=pair, system="You are terse.", max_tokens=2) as session:
            assert session.run_sync(f"Say {number}.").steps[0].stats.output_tokens >= 1

    for number in range(3):  # first-use costs (tokenizer, anyio's worker threads) come before the count
        cycle(number)
    before = footprint()
    for number in range(cycles):
        cycle(number)
    assert before.growth(footprint()) == []
    assert pair.is_open and not pair.is_dead


@pytest.mark.nightly
def test_pairs_opened_and_closed_leak_nothing() -> None:
    # Nightly (a pair start is ~60 s on two loaded cores). On a landing, the pairs that
    # tests/test_faults.py's own session opens, kills and replaces are checked the same way.
    def cycle() -> None:
        with EmbeddedPair(max_model_len=512, warmup=False, pin_ttl_s=30.0) as pair:
            assert len(pair.pids) >= 2

    cycle()  # the first pair starts process-wide helpers (the multiprocessing resource tracker)
    before = footprint()
    for _ in range(2):
        cycle()
    assert before.growth(footprint()) == []

"""Cores, ports and processes: what an embedded engine needs from the operating system (Linux)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

__all__ = [
    "bind_order",
    "cpu_list",
    "split_cores_among_pairs",
    "descendants",
    "alive",
    "available_cores",
    "compute_cores",
    "free_port",
    "is_helper",
    "kill_and_reap",
    "repin_threads",
    "single_engine_cores",
    "split_cores",
]

logger = logging.getLogger("agentkv")


def available_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def compute_cores(cores: Iterable[int] | None = None) -> list[int]:
    """The cores a single engine's compute threads are bound to by default on a CPU host: all of ``cores`` (default:
    the available ones) but the last, which is left to the engine's scheduler process and the caller's front end.

    vLLM's own binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) reserves a core per worker the same way. Bound to every
    core instead, the compute threads (which spin between forward passes) and the scheduler that feeds them take
    turns on the same cores: stock vLLM ran about 2x slower that way under a multi-turn load on a 2-core host
    (docs/benchmarks.md, "The colocated baseline"). A single core is used as it is.
    """
    ordered = sorted(cores) if cores is not None else available_cores()
    return ordered[:-1] if len(ordered) > 1 else ordered


def single_engine_cores(given: Iterable[int] | None = None) -> tuple[list[int], list[int]]:
    """A single engine's compute cores (its bound threads) and home cores (where its other threads, the scheduler
    process among them, run). Given cores hold both; by default the compute threads get `compute_cores` and the rest
    of the engine every available core, so the core left free is its scheduler's, as stock vLLM runs."""
    if given is not None:
        return list(given), list(given)
    home = available_cores()
    return compute_cores(home), home


def split_cores(cores: Iterable[int] | None = None) -> tuple[list[int], list[int]]:
    """Disjoint core sets for P and D: P gets the first half (rounded up), D the rest.

    Two engines on shared cores thrash (D decoded 30x slower on this machine), so the
    sets never overlap; on a single core both get it and a warning is logged.
    """
    ordered = sorted(cores) if cores is not None else available_cores()
    if len(ordered) < 2:
        logger.warning("agentkv: one core only; prefill and decode engines will share it")
        return ordered, ordered
    half = (len(ordered) + 1) // 2
    return ordered[:half], ordered[half:]


def split_cores_among_pairs(pairs: int, cores: Iterable[int] | None = None) -> list[tuple[list[int], list[int]]]:
    """The P and D core sets of ``pairs`` pairs: each pair its own share of the cores, split as `split_cores`.

    With fewer than two cores per pair, every pair gets the same split of all cores (pairs then
    share cores: a bigger machine, or ``core_policy``, is the cure), and a warning is logged.
    """
    ordered = sorted(cores) if cores is not None else available_cores()
    share = len(ordered) // pairs
    if share < 2:
        logger.warning("agentkv: %d cores for %d pairs; the pairs share cores", len(ordered), pairs)
        return [split_cores(ordered) for _ in range(pairs)]
    return [split_cores(ordered[i * share : (i + 1) * share]) for i in range(pairs)]


def cpu_list(cores: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``, the form ``VLLM_CPU_OMP_THREADS_BIND`` takes."""
    ordered = sorted(set(cores))
    parts: list[str] = []
    start = prev = ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(parts)


def bind_order(cores: Iterable[int]) -> str:
    """``[1, 0]`` -> ``"1,0"``: a ``VLLM_CPU_OMP_THREADS_BIND`` list in its given order (thread i on the i-th core)."""
    return ",".join(str(core) for core in cores)


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux says which ports it gives outgoing connections (and ``bind(0)``): 32768-60999 by default."""

_BELOW_EPHEMERAL = 12_000
"""How many ports under the ephemeral range `free_port` draws from (20768-32767 with Linux's default range)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral ports where it says which they are.

    A port is chosen well before its server binds it (an engine's NIXL side channel: tens of seconds, while the
    engine loads its model), and an ephemeral one can meanwhile become the source port of any outgoing
    connection on the host; vLLM's engine then waits for its side channel for ever (its listener thread failed
    to bind, 2026-12). A port below that range is taken only by a server that binds it by number. Where the
    range is unknown or leaves no room below it, the OS picks the port (``bind(0)``).
    """
    low = _ephemeral_low()
    if low is not None and low - _BELOW_EPHEMERAL > 1024:
        for port in random.sample(range(low - _BELOW_EPHEMERAL, low), 64):
            if _binds(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int | None:
    try:
        return int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children, ...; zombies not yet collected too)."""
    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def is_helper(pid: int) -> bool:
    """Whether ``pid`` is a Python multiprocessing helper (resource tracker, forkserver).

    Such a helper starts with the first engine but serves the whole process and exits with
    it: it is not an engine process.
    """
    try:
        command = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return "resource_tracker" in command or "forkserver" in command


def repin_threads(pids: Iterable[int], cores: Iterable[int]) -> int:
    """Move every thread of ``pids`` that may run outside ``cores`` onto ``cores``.

    vLLM's NIXL worker pins its main thread to the last core of the NUMA node, whatever
    the process's own binding: on two cores that puts P's worker on D's core. Threads
    already inside ``cores`` (vLLM's per-core OMP threads) keep their finer binding.
    Returns how many threads were moved.
    """
    allowed = set(cores)
    moved = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    if not os.sched_getaffinity(int(tid)) <= allowed:
                        os.sched_setaffinity(int(tid), allowed)
                        moved += 1
    return moved


def alive(pids: Iterable[int]) -> set[int]:
    """The processes of ``pids`` that still run (zombies count as gone)."""
    running: set[int] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                running.add(pid)
    return running


def kill_and_reap(pids: Iterable[int], *, grace_s: float = 10.0) -> set[int]:
    """Wait up to ``grace_s`` for ``pids`` to exit, then SIGKILL what is left.

    Returns the pids that had to be killed.
    """
    pending = set(pids)
    deadline = time.monotonic() + grace_s
    while (pending := alive(pending)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pending:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    _reap(pids, until=time.monotonic() + 2.0)
    return pending


def _reap(pids: Iterable[int], *, until: float) -> None:
    """Collect the exit status of those of ``pids`` that are our children (no zombies left)."""
    waiting = set(pids)
    while waiting and time.monotonic() < until:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child, or already collected
                waiting.discard(pid)
                continue
            if done:
                waiting.discard(pid)
        if waiting:
            time.sleep(0.05)

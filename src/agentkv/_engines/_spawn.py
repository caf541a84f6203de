"""An engine's turn to start its engine-core process with its own environment.

vLLM takes an engine's settings that agentkv passes by environment (its cores or GPUs, its NIXL
side-channel port, the plugin's switches) from the environment of the process that builds the
``AsyncLLM``: its checks read them there, and the engine-core process inherits them when it is made,
forked or spawned; its workers inherit them from the core. So two engines in one process must not build
at the same moment. They need not *wait* one at a time, though: most of an engine's start (a spawned
process importing vLLM, then its worker doing the same, loading the model and sizing the KV cache) comes
after its core exists. `spawn_turn` holds the turn, with the environment set, only until the core exists
(a watcher thread sees the new child process), so a pair's P and D start side by side.

The core is told from other children by being a `multiprocessing` process (vLLM starts it with
``multiprocessing``, forked or spawned): vLLM's build also runs short commands in this process (``lscpu``
through a shell, ``numactl`` probes), and on a machine with cold caches the watcher saw one, handed the turn on
with the environment restored, and the engine core was started without its own: both engines of a pair bound
vLLM's default NIXL port, and the second failed its handshake listener (seen on a fresh machine, first run).
A multiprocessing child is registered only once it exists with its environment fixed (forked, or spawned and
exec'd), so the hand-on waits for it.

The same window keeps the engines' own output (vLLM's and NIXL's warnings, Triton and torch notices, NUMA
binding lines) out of the caller's terminal: while the turn is held, this process's fds 1 and 2 point at the
engine log (`engine_output`, ``$AGENTKV_HOME/logs/engines-<pid>.log``), so the engine core, and the workers it
makes, inherit the file instead of the terminal; they are pointed back when the core exists.
``AGENTKV_ENGINE_OUTPUT=-`` leaves the output inherited, as it was before.

The environment also gives each engine a folder of its own for vLLM's ZMQ IPC sockets (`ipc_folder`): vLLM names
them ``ipc://$VLLM_RPC_BASE_PATH/<uuid>`` and ZMQ leaves the socket files behind when they close (seven per engine
on a CPU host, in the temporary folder, one lot per engine started); the engine's folder goes when it stops.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import IO

from .._model import home_dir
from ._system import descendants

__all__ = ["OUTPUT_VARIABLE", "QUIET", "SpawnTurn", "engine_output", "quiet_env", "spawn_turn", "stop_signals_blocked"]

_TURN = threading.Lock()
"""Held by one engine of this process from the start of its build until its engine-core process exists."""

_POLL_S = 0.05
"""How often the watcher looks for the new engine core (a build takes seconds before it makes one)."""


QUIET = {"VLLM_LOGGING_LEVEL": "WARNING", "NIXL_LOG_LEVEL": "WARN"}
"""The log levels of the engines agentkv runs in its caller's process: warnings and errors only. vLLM and NIXL
log at INFO by default, a few hundred lines per engine start, into the caller's terminal."""


OUTPUT_VARIABLE = "AGENTKV_ENGINE_OUTPUT"
"""Where the engines' own output goes: unset, ``$AGENTKV_HOME/logs/engines-<pid>.log``; a path, that file
(appended to); ``-``, wherever this process's own output goes (the engines inherit it)."""

_vllm_log: IO[str] | None = None
"""The engine log, opened for vLLM's logger in this process (its warnings go where its engines' go)."""


def engine_output() -> Path | None:
    """The file the engines' output goes to (`OUTPUT_VARIABLE`), or None where they inherit this process's."""
    value = os.environ.get(OUTPUT_VARIABLE, "")
    if value == "-":
        return None
    return Path(value) if value else home_dir() / "logs" / f"engines-{os.getpid()}.log"


def quiet_env() -> dict[str, str]:
    """`QUIET` for the variables the caller has not set (``VLLM_LOGGING_LEVEL=INFO`` brings vLLM's start-up log
    back), and vLLM's logger in this process set to match (configured when vLLM was first imported)."""
    quiet = {key: value for key, value in QUIET.items() if key not in os.environ}
    if "VLLM_LOGGING_LEVEL" in quiet:
        logging.getLogger("vllm").setLevel(logging.WARNING)
    return quiet


class SpawnTurn:
    """The engine-core processes an engine's build made: known once its turn has ended."""

    def __init__(self) -> None:
        self.cores: set[int] = set()
        self.log_path: Path | None = None
        """Where the engine's output went (`engine_output`); None where it was inherited."""

    def processes(self) -> set[int]:
        """The engine's processes now: its cores and everything below them (workers)."""
        return self.cores | {pid for core in self.cores for pid in descendants(core)}


def _new_children(before: set[int]) -> set[int]:
    """The multiprocessing children of this process made since ``before`` (not a build's passing commands, nor
    multiprocessing's helpers, which are not `multiprocessing.Process` objects)."""
    return {child.pid for child in multiprocessing.active_children() if child.pid is not None} - before


@contextlib.contextmanager
def spawn_turn(env: dict[str, str]) -> Iterator[SpawnTurn]:
    """Wait for this process's turn, set ``env``, and hand the turn on as soon as a new child process
    (the engine core the caller's build makes) exists, or when the block ends, whichever comes first."""
    turn = SpawnTurn()
    _TURN.acquire()
    try:
        turn.log_path = engine_output()
        terminal = _output_to(turn.log_path)
    except BaseException:
        _TURN.release()
        raise
    before = descendants(os.getpid())
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    handed = threading.Event()
    handing = threading.Lock()

    def hand_on(found: set[int]) -> None:
        with handing:
            if handed.is_set():
                return
            turn.cores = found
            _output_back(terminal)
            for key, old in saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old
            handed.set()
            _TURN.release()  # a Lock, not an RLock: the watcher thread may release it

    def watch() -> None:
        while not handed.wait(_POLL_S):
            if found := _new_children(before):
                hand_on(found)

    watcher = threading.Thread(target=watch, name="agentkv-spawn-watch", daemon=True)
    watcher.start()
    try:
        yield turn
    finally:
        if not handed.is_set():
            hand_on(_new_children(before))
        watcher.join()
        if turn.log_path is not None:
            _vllm_logs_to(turn.log_path)


def _output_to(path: Path | None) -> tuple[int, int] | None:
    """Point fds 1 and 2 at ``path`` (after flushing what Python holds for them); returns the fds they had, kept
    open as duplicates, or None where ``path`` is None (nothing moved)."""
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _flush()
    terminal = (os.dup(1), os.dup(2))
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return terminal


def _output_back(terminal: tuple[int, int] | None) -> None:
    """Point fds 1 and 2 back where they were before `_output_to`."""
    if terminal is None:
        return
    _flush()  # what this process wrote in the window goes to the log, with the engine's
    for fd, kept in zip((1, 2), terminal, strict=True):
        os.dup2(kept, fd)
        os.close(kept)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or replaced by an object without flush
            stream.flush()


def _vllm_logs_to(path: Path) -> None:
    """Send the warnings of vLLM's logger in this process (the engines' front ends) to the engine log too: vLLM
    configures it, on import, to write to the terminal (``sys.stdout``)."""
    global _vllm_log
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr):
            if _vllm_log is None or _vllm_log.name != str(path):
                _vllm_log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115  # kept for the process
            handler.setStream(_vllm_log)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread (a worker thread: the main one still gets them) while it starts
    an engine. The engine-core process it makes is born with them blocked, forked or spawned: a Ctrl-C to this
    process's group while that process starts, still in this group, stays pending there until it has moved to a
    group of its own and drops it (``run_engine_core_in_own_group`` in ``src/_agentkv_vllm/_patches.py``)."""
    if threading.current_thread() is threading.main_thread():
        yield  # blocked here, they would keep a Ctrl-C from the caller for the whole start
        return
    # Python's resource tracker, started by the first process multiprocessing spawns, unblocks both signals in
    # the thread that starts it (multiprocessing/resource_tracker.py): started first, it leaves this block alone.
    resource_tracker.ensure_running()
    stops = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ipc_folder(name: str, *, inside: str | None = None) -> str:
    """A new folder for the ZMQ IPC sockets of the engine ``name`` (its ``VLLM_RPC_BASE_PATH``), inside ``inside``
    or the caller's ``VLLM_RPC_BASE_PATH`` if set, else the temporary folder; `remove_ipc_folder` removes it when
    the engine stops."""
    return tempfile.mkdtemp(prefix=f"agentkv-{name}-", dir=inside or os.environ.get("VLLM_RPC_BASE_PATH") or None)


def remove_ipc_folder(folder: str | None) -> None:
    """Remove an engine's IPC folder and the socket files ZMQ left in it (its processes have ended)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)

"""Launching one vLLM API server process: its command, environment, log file, readiness and stop.

Used by `LaunchedPair` (two servers on this host) and by ``agentkv engine`` (one server, in
the foreground, for a pair spread over hosts).

A server started without a launch prefix gets a folder of its own for vLLM's ZMQ IPC sockets
(`agentkv._engines._spawn.ipc_folder`, named ``agentkv-server-<role>-*``), removed when it stops: ZMQ leaves
the socket files behind. One under a prefix keeps vLLM's naming (in the ``VLLM_RPC_BASE_PATH`` of its
environment, if set): the prefix may run it where that folder is not.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import anyio
import anyio.to_thread
import httpx

from .._errors import EngineStartError, UserError
from ._engine_launch import EngineLaunch
from ._pair_config import Role
from ._spawn import ipc_folder, remove_ipc_folder
from ._start_log import record_engine_start
from ._system import descendants, kill_and_reap, repin_threads
from ._vllm_features import warn_engine_features
from ._watchdog import forget_pids, watch_pids

__all__ = ["Role", "ServerProcess", "ServerSpec", "parse_vllm_flags", "server_command", "server_env", "vllm_flags"]

logger = logging.getLogger("agentkv")

SERVED_MODEL_NAME = "agentkv"


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """Everything that defines one server of a pair: its engine (`engine_launch`) and how it serves."""

    role: Role
    launch: EngineLaunch
    port: int
    host: str = "127.0.0.1"
    """The address the server listens on for HTTP."""
    extra_env: Mapping[str, str] = field(default_factory=dict[str, str])
    """More environment for the server (``UCX_TLS``, ``UCX_NET_DEVICES``, ...); it wins."""
    launch_prefix: Sequence[str] = ()
    """Run the server under these words (``["ip", "netns", "exec", "ns1"]``, ``["numactl", ...]``).

    The wrapper must exec the server in the foreground: stopping the server signals its pid."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def cores(self) -> list[int] | None:
        return self.launch.cores

    @property
    def side_channel_port(self) -> int | None:
        return self.launch.side_channel_port

    @property
    def engine_id(self) -> str | None:
        return self.launch.engine_id


def server_command(spec: ServerSpec) -> list[str]:
    """The command line that starts ``spec``'s server (agentkv's entry point over vLLM's server)."""
    return [
        *spec.launch_prefix,
        sys.executable,
        "-m",
        "agentkv._engines._server",
        *vllm_flags(spec.launch.engine_args),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]


def vllm_flags(engine_args: Mapping[str, Any]) -> list[str]:
    """``AsyncEngineArgs`` keyword arguments as ``vllm serve`` flags (``--no-x`` for a false boolean, JSON for a
    mapping, one word per item for a list: ``--cudagraph-capture-sizes 1 2 4``)."""
    flags: list[str] = []
    for key, value in engine_args.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        elif isinstance(value, Mapping):
            flags += [f"--{name}", json.dumps(dict(value))]
        elif isinstance(value, list | tuple):
            flags += [f"--{name}", *(json.dumps(item) if isinstance(item, Mapping) else str(item) for item in value)]
        else:
            flags += [f"--{name}", str(value)]
    return flags


def parse_vllm_flags(words: Sequence[str]) -> dict[str, Any]:
    """``vllm serve`` engine flags (``["--tensor-parallel-size", "2", "--no-enforce-eager"]``) as ``AsyncEngineArgs``
    keyword arguments (``{"tensor_parallel_size": 2, "enforce_eager": False}``): `vllm_flags` read back.

    vLLM's own parser reads them (its types, its ``--no-x`` booleans, its JSON and ``--x.key value`` forms), and
    only the flags given are kept. A word it does not know is a `UserError`; so is a missing vLLM.
    """
    if not words:
        return {}
    from ._platforms import current_platform

    current_platform()  # vLLM's parser needs a platform: where vLLM finds none, say so (not "Failed to infer ...")
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        raise UserError("vLLM's own parser reads the engine arguments after --; vLLM is not installed") from exc

    class Parser(FlexibleArgumentParser):  # type: ignore[misc]  # vLLM is not type-checked here
        def error(self, message: str) -> NoReturn:
            raise UserError(f"the vLLM engine arguments after --: {message}")

    try:
        parser = AsyncEngineArgs.add_cli_args(Parser(prog="vllm", add_help=False))
        given: dict[str, str] = {}
        for action in parser._actions:
            action.default = argparse.SUPPRESS  # the namespace holds only what was given
            if callable(action.type):
                action.type = _noting(action.type, action.dest, given)
        parsed = vars(parser.parse_args(list(words)))
    except UserError:
        raise
    except Exception as exc:  # vLLM's parser failing on this host or on a value: the command line's to fix
        raise UserError(f"vLLM could not read the engine arguments after -- ({type(exc).__name__}: {exc})") from exc
    return {name: _plain(value, given.get(name)) for name, value in parsed.items()}


def _noting(convert: Callable[[str], Any], dest: str, given: dict[str, str]) -> Callable[[str], Any]:
    """``convert`` (an argument's type), noting the text it was given."""

    def parse(text: str) -> Any:
        given[dest] = text
        return convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names it in its errors
    return parse


def _plain(value: Any, text: str | None) -> Any:
    """A parsed value as plain Python that JSON writes (a launched server gets it as a flag again): enums as their
    values; a config object vLLM built from JSON (``--compilation-config '{"mode": 3}'``) as that JSON, which
    vLLM's engine arguments take as well."""
    value = _without_enums(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        if text is None:
            raise UserError(
                f"a vLLM engine argument after -- parsed to {type(value).__name__}, not plain data"
            ) from None
        try:
            return json.loads(text)
        except ValueError:
            return text
    return value


def _without_enums(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _without_enums(value.value)
    if isinstance(value, Mapping):
        return {key: _without_enums(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_without_enums(item) for item in value]
    return value


def server_env(spec: ServerSpec) -> dict[str, str]:
    """The environment variables ``spec``'s server needs on top of the caller's."""
    return {**spec.launch.env, "VLLM_CONFIGURE_LOGGING": "1", **spec.extra_env}


class ServerProcess:
    """One server process started by agentkv: its log file, readiness, and stop."""

    def __init__(self, spec: ServerSpec, *, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self.pids: set[int] = set()
        self.ipc_folder: str | None = None
        """The folder of the server's ZMQ IPC sockets while it runs (None: vLLM's own naming, under a prefix)."""

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def exit_code(self) -> int | None:
        """The server's exit status once it has exited (None while it runs, or before it started)."""
        return self._process.poll() if self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the server process is still alive."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the process (returns at once; see `wait_ready`)."""
        warn_engine_features(server_env(self.spec))  # here, not only in the server's log; the server inherits it
        record_engine_start(kind="server", role=self.spec.role)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **server_env(self.spec)}
        if not self.spec.launch_prefix:
            self.ipc_folder = ipc_folder(f"server-{self.spec.role}", inside=env.get("VLLM_RPC_BASE_PATH"))
            env["VLLM_RPC_BASE_PATH"] = self.ipc_folder
        try:
            with open(self.log_path, "ab") as log:
                self._process = subprocess.Popen(
                    server_command(self.spec),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C in the caller's terminal goes to the caller; close stops us
                )
        except BaseException:
            remove_ipc_folder(self.ipc_folder)
            self.ipc_folder = None
            raise
        self.pids = {self._process.pid}
        watch_pids(self.pids)

    async def wait_ready(self, *, timeout_s: float, progress: Callable[[str], None]) -> None:
        """Poll ``/health`` until it answers 200; fail with the log's tail if the process exits first."""
        started = time.monotonic()
        next_report = started + 10.0
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self.running:
                    raise EngineStartError(
                        f"the {self.spec.role} server exited during start-up (log: {self.log_path}):\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        break
                now = time.monotonic()
                if now - started > timeout_s:
                    raise EngineStartError(
                        f"the {self.spec.role} server was not ready after {timeout_s:.0f} s "
                        f"(log: {self.log_path}):\n{self.log_tail()}"
                    )
                if now >= next_report:
                    next_report = now + 10.0
                    last = self.log_tail(1).strip().rsplit("] ", 1)[-1][:100]  # the message, not vLLM's prefix
                    progress(f"agentkv: {self.spec.role} server starting ({now - started:.0f} s): {last}")
                await anyio.sleep(0.5)
        self.adopt_children()

    def adopt_children(self) -> None:
        """Watch the server's engine processes too, and keep their threads on the server's cores."""
        if self._process is None:
            return
        children = descendants(self._process.pid)
        if children - self.pids:
            watch_pids(children - self.pids)
            self.pids |= children
        if self.spec.cores:
            repin_threads(children, self.spec.cores)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 16_384))
                return b"\n".join(log.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def stop(self, *, grace_s: float = 15.0) -> set[int]:
        """SIGTERM the server (vLLM then stops its engine), SIGKILL whatever is left after ``grace_s``.

        Returns the pids that had to be killed.
        """
        process, self._process = self._process, None
        if process is None:
            return set()
        pids = self.pids | descendants(process.pid)
        with contextlib.suppress(OSError):
            process.send_signal(signal.SIGTERM)
        killed = kill_and_reap(pids, grace_s=grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=2.0)
        forget_pids(pids)
        self.pids = set()
        remove_ipc_folder(self.ipc_folder)  # its processes have ended
        self.ipc_folder = None
        return killed

    async def stop_async(self) -> None:
        killed = await anyio.to_thread.run_sync(self.stop)
        if killed:
            logger.warning("agentkv: %s server processes %s had to be killed", self.spec.role, sorted(killed))

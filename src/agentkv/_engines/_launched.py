"""`LaunchedPair`: agentkv starts a prefill and a decode vLLM API server and drives them over HTTP."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Unpack

import anyio
import anyio.to_thread

from .._errors import UserError
from .._model import home_dir, prepare_model_off_loop
from ._base import EngineDetails
from ._engine_launch import pair_engine_launch
from ._http import HTTPPair
from ._pair_config import PairConfig, PairSettings, Role
from ._platforms import PairDevices, Platform, current_platform, pair_devices
from ._server_process import ServerProcess, ServerSpec
from ._system import free_port, split_cores

__all__ = ["LaunchedPair"]

logger = logging.getLogger("agentkv")


class LaunchedPair(HTTPPair):
    """Two vLLM OpenAI API-server processes (P and D, NIXL between them) that agentkv starts and stops.

    The same pair as `EmbeddedPair` (the same settings, the same stats, push-back on by
    default), but each engine serves HTTP from a process of its own: the step from one
    process to one host per engine. The servers run agentkv's entry point over vLLM's
    server (``python -m agentkv._engines._server``), which streams D's KV handle and reports
    the prefill split and NIXL totals (see ``docs/engines.md``).

    Its pair settings are `EmbeddedPair`'s: a `PairConfig` as ``config`` and/or its fields as
    keyword arguments (``model``, ``push_back``, ``prefill_prefix_cache``, ``cores``,
    ``prefill_devices``, ``decode_devices``, ``max_model_len``, ``kv_cache_gib``, ``pin_ttl_s``,
    ``max_pinned_blocks``, ``recompute_threshold``, ``slo``, ``connector_options``, ``idle_poll_ms``, ``warmup``, ``step_timeout_s``,
    ``engine_args``, ``prefill_engine_args``, ``decode_engine_args``). The engine arguments become
    each server's ``vllm serve`` flags (``--tensor-parallel-size 2``); on a GPU host each server gets
    its GPUs as `EmbeddedPair`'s engines do, by ``CUDA_VISIBLE_DEVICES`` in its environment. And these:

    Args:
        hosts: the addresses P and D listen on and give each other for NIXL.
        launch_prefixes: words to run each server under, e.g. ``["ip", "netns", "exec", "ns1"]``
            (the wrapper must exec the server in the foreground).
        server_env: more environment for both servers (e.g. ``{"UCX_TLS": "tcp"}``).
        log_dir: where the servers' logs go (default: a new folder under agentkv's cache).
        start_timeout_s: a server not healthy after this long fails `open` with its log's tail.
        attempts: tries per server call on transient errors (refused connection, 5xx).
        progress: called with one line per start-up stage (default: the ``agentkv`` logger).
    """

    _agentkv_servers = True

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        config: PairConfig | None = None,
        hosts: tuple[str, str] = ("127.0.0.1", "127.0.0.1"),
        launch_prefixes: tuple[Sequence[str], Sequence[str]] = ((), ()),
        server_env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 600.0,
        attempts: int = 4,
        progress: Callable[[str], None] | None = None,
        **settings: Unpack[PairSettings],
    ) -> None:
        self.config = PairConfig.of(config, model, **settings)
        super().__init__(
            self.config.model,
            step_timeout_s=self.config.step_timeout_s,
            attempts=attempts,
            warmup=self.config.warmup,
            progress=progress,
            push_back=self.config.push_back,
            exclusive=True,  # agentkv started the servers: nobody else talks to them
            transfer=self.config.transfer,
            max_pinned_blocks=self.config.max_pinned_blocks,
            slo=self.config.slo,
        )
        if len(hosts) != 2 or len(launch_prefixes) != 2:
            raise UserError("hosts and launch_prefixes take two entries: prefill's, then decode's")
        self._hosts = hosts
        self._prefixes = launch_prefixes
        self._server_env = dict(server_env or {})
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._start_timeout_s = start_timeout_s
        self._servers: dict[Role, ServerProcess] = {}
        self._generation = 0
        self._tag = uuid.uuid4().hex[:8]
        self._restart_lock = anyio.Lock()
        self._platform: Platform | None = None
        """The host's platform, read at open."""
        self._devices: PairDevices | None = None
        """The GPUs of P's and D's servers (a GPU host), chosen at open and kept across restarts."""

    # ----------------------------------------------------------------- what it started

    @property
    def pids(self) -> set[int]:
        """Every process the pair started (both servers and their engine processes)."""
        return {pid for server in self._servers.values() for pid in server.pids}

    @property
    def pids_by_role(self) -> dict[str, set[int]]:
        """The processes of each server (``"prefill"``, ``"decode"``)."""
        return {role: set(server.pids) for role, server in self._servers.items()}

    @property
    def ports(self) -> list[int]:
        """The HTTP and NIXL side-channel ports of both servers."""
        return [port for s in self._servers.values() for port in (s.spec.port, s.spec.side_channel_port) if port]

    @property
    def log_paths(self) -> dict[str, Path]:
        """Each server's log file."""
        return {role: server.log_path for role, server in self._servers.items()}

    # ----------------------------------------------------------------- lifecycle

    async def _start(self) -> None:
        self._platform = current_platform()  # first: a host vLLM finds no platform on fails before the model
        model_path = await prepare_model_off_loop(self._model, progress=self._progress)
        if self._log_dir is None:
            self._log_dir = home_dir() / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{self._tag}"
        placement: EngineDetails
        if self._platform.pins_cores:
            p_cores, d_cores = (list(c) for c in self.config.cores) if self.config.cores else split_cores()
            placement = {"prefill_cores": p_cores, "decode_cores": d_cores}
        else:  # a GPU host: each server on its own GPUs (CUDA_VISIBLE_DEVICES in its environment), no cores
            if self.config.cores is not None:
                raise UserError(
                    "cores= binds the servers' threads on vLLM's CPU platform; on this GPU host give P and D "
                    "their GPUs with prefill_devices= and decode_devices="
                )
            self._devices = pair_devices(self._platform, self.config.prefill_devices, self.config.decode_devices)
            p_cores, d_cores = [], []
            placement = {
                "platform": self._platform.kind,
                "prefill_devices": list(self._devices.prefill),
                "decode_devices": list(self._devices.decode),
            }
        self._servers = {
            "prefill": self._server("prefill", model_path, p_cores),
            "decode": self._server("decode", model_path, d_cores),
        }
        await self._launch(list(self._servers.values()))
        self._know_prefill()
        await self._open_servers(
            self._servers["prefill"].url, self._servers["decode"].url, kind="launched", model_path=model_path
        )
        self._info_details({**placement, "log_dir": str(self._log_dir)})

    def _server(self, role: Role, model_path: Path, cores: Sequence[int]) -> ServerProcess:
        index = 0 if role == "prefill" else 1
        launch = pair_engine_launch(
            self.config,
            role,
            model_path=model_path,
            cores=cores,
            engine_id=f"agentkv-{role}-{self._tag}-{self._generation}",
            side_channel_port=free_port(),
            nixl_host=self._hosts[index],
            platform=self._platform,
            devices=self._devices,
        )
        spec = ServerSpec(
            role=role,
            launch=launch,
            port=free_port(),
            host=self._hosts[index],
            launch_prefix=list(self._prefixes[index]),
            extra_env=self._server_env,
        )
        assert self._log_dir is not None
        return ServerProcess(spec, log_path=self._log_dir / f"{role}-{self._generation}.log")

    async def _launch(self, servers: list[ServerProcess]) -> None:
        started = time.perf_counter()
        for server in servers:
            self._progress(f"agentkv: starting the {server.spec.role} server at {server.url} (log: {server.log_path})")
            server.start()
        async with anyio.create_task_group() as group:
            for server in servers:
                group.start_soon(self._wait_ready, server)
        self._progress(f"agentkv: servers up in {time.perf_counter() - started:.0f} s")

    async def _wait_ready(self, server: ServerProcess) -> None:
        await server.wait_ready(timeout_s=self._start_timeout_s, progress=self._progress)

    def _know_prefill(self) -> None:
        """P's NIXL coordinates, which a pushed step's D registers with (a restarted P has new ones)."""
        spec = self._servers["prefill"].spec
        assert spec.engine_id is not None and spec.side_channel_port is not None
        self._prefill_coordinates = (spec.engine_id, self._hosts[0], spec.side_channel_port)

    def _info_details(self, details: EngineDetails) -> None:
        self._info = dataclasses.replace(self.info, details={**self.info.details, **details})

    async def _warm_up(self) -> None:
        await super()._warm_up()
        for server in self._servers.values():
            server.adopt_children()  # threads NIXL started during the handshakes go to the server's cores

    async def _stop(self) -> None:
        await super()._stop()
        servers, self._servers = list(self._servers.values()), {}
        async with anyio.create_task_group() as group:
            for server in servers:
                group.start_soon(server.stop_async)

    # ----------------------------------------------------------------- failures

    async def _server_gone(self) -> str | None:
        for _ in range(20):  # a server that was just killed takes a moment to be seen gone
            if not all(server.running for server in self._servers.values()):
                break
            await anyio.sleep(0.1)
        gone = [server for server in self._servers.values() if not server.running]
        if not gone:
            return None
        return "; ".join(f"the {s.spec.role} server exited (code {s.exit_code}; log: {s.log_path})" for s in gone)

    async def _before_step(self) -> None:
        """Restart a server whose process died (new ports and engine id: no stale handle can reach it)."""
        if all(server.running for server in self._servers.values()):
            return
        async with self._restart_lock:
            dead = [role for role, server in self._servers.items() if not server.running]
            if not dead:
                return
            self._generation += 1
            for role in dead:
                old = self._servers[role]
                logger.warning("agentkv: the %s server died (code %s); restarting it", role, old.exit_code)
                await old.stop_async()
                if old.spec.engine_id is not None:
                    self._retired_engines.add(old.spec.engine_id)
                self._baseline.totals.pop(role, None)  # a new server counts NIXL bytes from zero
                if role == "decode":
                    self._forget_pins()  # the new D holds none of the old one's pins
                self._servers[role] = self._server(role, old.spec.launch.model_path, old.spec.cores or [])
            await self._launch([self._servers[role] for role in dead])
            self._know_prefill()
            await self._reconnect(self._servers["prefill"].url, self._servers["decode"].url)

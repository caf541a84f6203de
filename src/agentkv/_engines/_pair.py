"""`EmbeddedPair`: a prefill engine P and a decode engine D in this process, joined by NIXL.

Here the pair starts and stops: the model prepared, P and D placed (cores of their own and the
host's core table on vLLM's CPU platform, GPUs of their own on CUDA), both engines started side by
side, warmed up, and stopped side by side. What a step does with them is `PairSteps`
(``src/agentkv/_engines/_pair_step.py``).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Unpack

import anyio

from _agentkv_vllm._cores import CoreTable, elastic_bind_order
from _agentkv_vllm._patches import AUTO_PLACEMENT, ELASTIC_CORES

from .._errors import UserError
from .._model import prepare_model_off_loop
from ._base import EngineDetails, EngineInfo
from ._engine_launch import pair_engine_launch
from ._pair_config import PairConfig, PairSettings, Role
from ._pair_step import PairSteps
from ._platforms import Platform, current_platform, pair_devices
from ._system import free_port, split_cores
from ._vllm import AsyncLLMRunner
from ._vllm_features import feature_problem, has_feature

__all__ = ["EmbeddedPair"]

logger = logging.getLogger("agentkv")


class EmbeddedPair(PairSteps):
    """Two vLLM engines (P, D) in the calling process, NIXL between them, push-back on by default.

    Its settings are a `PairConfig`: pass one as ``config``, or its fields as keyword
    arguments (``EmbeddedPair(max_model_len=2048, pin_ttl_s=60)``), or both (the keywords
    replace the config's fields). ``model`` is the config's ``model``.

    Args:
        model: a bundled model name, a local HF folder or a Hugging Face id ``org/name[@revision]``
            from the HF cache (see `prepare_model`; default: the bundled SmolLM2-135M).
        config: the pair's settings (default: `PairConfig`'s defaults).
        progress: called with one line per start-up stage (default: the ``agentkv`` logger).
        **settings: `PairConfig` fields (``push_back``, ``prefill_prefix_cache``, ``cores``,
            ``prefill_devices``, ``decode_devices``, ``max_model_len``, ``kv_cache_gib``, ``pin_ttl_s``,
            ``max_pinned_blocks``, ``recompute_threshold``, ``slo``, ``connector_options``, ``idle_poll_ms``, ``warmup``,
            ``step_timeout_s``, ``engine_args``, ``prefill_engine_args``, ``decode_engine_args``).

    On a GPU host (vLLM's CUDA platform) P and D run on GPUs of their own: by default the visible
    devices in two halves, each engine's tensor-parallel size the number of its devices (see
    ``docs/engines.md``, "Platforms, devices and engine arguments").
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        config: PairConfig | None = None,
        progress: Callable[[str], None] | None = None,
        **settings: Unpack[PairSettings],
    ) -> None:
        super().__init__(PairConfig.of(config, model, **settings))
        self._progress = progress or (lambda line: logger.info("%s", line))
        self._info: EngineInfo | None = None
        self._core_policy = self.config.core_policy

    @property
    def push_back(self) -> bool:
        """Whether D pins KV and P can pull it back."""
        return self.config.push_back

    @property
    def pin_ttl_s(self) -> float:
        """How long D pins a step's blocks."""
        return self.config.pin_ttl_s

    @property
    def prefill_prefix_cache(self) -> bool:
        """Whether P has its own prefix cache."""
        return self.config.prefill_prefix_cache

    @property
    def info(self) -> EngineInfo:
        return self._info_once_started(self._info)

    @property
    def pids(self) -> set[int]:
        """Every process the pair started (engine cores and workers of P and D)."""
        return {pid for engine in (self._p, self._d) if engine is not None for pid in engine.pids}

    @property
    def ports(self) -> list[int]:
        """The NIXL side-channel ports of P and D."""
        return [e.side_channel_port for e in (self._p, self._d) if e is not None and e.side_channel_port]

    # ----------------------------------------------------------------- lifecycle

    async def _start(self) -> None:
        config = self.config
        platform = current_platform()  # first: a host vLLM finds no platform on fails before the model is prepared
        model_path = await prepare_model_off_loop(config.model, progress=self._progress)
        if not platform.pins_cores:
            await self._start_on_gpus(model_path, platform)
            return
        p_cores, d_cores = (list(c) for c in config.cores) if config.cores else split_cores()
        own: dict[Role, list[int]] = {"prefill": p_cores, "decode": d_cores}
        table = CoreTable()
        slots = {role: table.claim(own[role]) for role in own}  # other engines on the host see these two busy
        elastic = (
            config.core_policy == "elastic"
            and not set(p_cores) & set(d_cores)
            and all(slot is not None for slot in slots.values())
            and has_feature(ELASTIC_CORES)  # off where vLLM lacks its targets: one warning, the pair runs split
        )
        self._core_policy = "elastic" if elastic else "split"
        tag = uuid.uuid4().hex[:8]
        roles: tuple[tuple[Role, Role], ...] = (("prefill", "decode"), ("decode", "prefill"))
        runners: list[AsyncLLMRunner] = []
        for role, other in roles:
            slot = slots[role]
            launch = pair_engine_launch(
                config,
                role,
                model_path=model_path,
                cores=elastic_bind_order(own[role], own[other]) if elastic else own[role],
                engine_id=f"agentkv-{role}-{tag}",
                side_channel_port=free_port(),
                core_table=f"{slot.path}:{slot.index}" if elastic and slot is not None else None,
                platform=platform,
            )
            runner = AsyncLLMRunner(launch, core_slot=slot)
            runners.append(runner)
        self._p, self._d = runners
        await self._start_both()
        self._know_started(
            model_path, {"prefill_cores": p_cores, "decode_cores": d_cores, "core_policy": self._core_policy}
        )

    async def _start_on_gpus(self, model_path: Path, platform: Platform) -> None:
        """P and D on GPUs of their own (`pair_devices`), each told its devices by ``CUDA_VISIBLE_DEVICES`` in
        its environment at its start (`AsyncLLMRunner.start`); none of the CPU machinery (no cores, no core
        table, no re-pinning)."""
        config = self.config
        if config.cores is not None:
            raise UserError(
                "cores= binds the engines' threads on vLLM's CPU platform; on this GPU host give P and D "
                "their GPUs with prefill_devices= and decode_devices="
            )
        devices = pair_devices(platform, config.prefill_devices, config.decode_devices)
        tag = uuid.uuid4().hex[:8]
        roles: tuple[Role, Role] = ("prefill", "decode")
        self._p, self._d = (
            AsyncLLMRunner(
                pair_engine_launch(
                    config,
                    role,
                    model_path=model_path,
                    cores=None,
                    engine_id=f"agentkv-{role}-{tag}",
                    side_channel_port=free_port(),
                    platform=platform,
                    devices=devices,
                )
            )
            for role in roles
        )
        await self._start_both()
        self._know_started(
            model_path,
            {
                "platform": platform.kind,
                "prefill_devices": list(devices.prefill),
                "decode_devices": list(devices.decode),
            },
        )

    async def _start_both(self) -> None:
        """P and D at once: each waits tens of seconds for its processes, which need not wait for the other's
        (`spawn_turn` in `src/agentkv/_engines/_spawn.py`). The first failure is raised once both have ended;
        close stops whichever started."""
        failed: list[Exception] = []

        async def start(runner: AsyncLLMRunner) -> None:
            try:
                await runner.start_async(self._progress)
            except Exception as exc:
                failed.append(exc)

        async with anyio.create_task_group() as group:
            for runner in (self._p, self._d):
                assert runner is not None
                group.start_soon(start, runner)
        if failed:
            raise failed[0]

    def _know_started(self, model_path: Path, placement: EngineDetails) -> None:
        """The pair's `EngineInfo`, once both engines run: ``placement`` says where each computes."""
        config = self.config
        assert self._d is not None
        problem = feature_problem(AUTO_PLACEMENT) if config.transfer == "pull" else None
        self._placement_off = problem if config.transfer == "pull" else "a push pair prefills every step on P"
        off_reasons = {}
        if problem is not None and config.push_back:
            off_reasons["places_steps"] = f"auto placement is off on this vLLM ({problem})"
        self._info = EngineInfo(
            model_path=model_path,
            max_model_len=config.max_model_len,
            pins=config.push_back,
            disaggregated=True,
            places_steps=config.push_back and self._placement_off is None,
            off_reasons=off_reasons,
            details={
                **placement,
                "transfer": config.transfer,
                "pin_ttl_s": config.pin_ttl_s,
                "prefill_prefix_cache": config.prefill_prefix_cache,
                "decode_kv_blocks": self._d.num_blocks,
            },
        )

    async def _warm_up(self) -> None:
        if self.config.warmup:
            self._progress("agentkv: warming up (kernels, NIXL handshakes)")
            await self._calibrate()
        for engine in self._engines():
            engine.repin()  # threads that NIXL started during the handshakes

    async def _stop(self) -> None:
        """Both engines at once: each takes seconds to exit (docs/vllm-patches.md section 1), and neither waits
        for the other."""
        async with anyio.create_task_group() as group:
            for engine in (self._d, self._p):
                if engine is not None:
                    group.start_soon(engine.shutdown_async)

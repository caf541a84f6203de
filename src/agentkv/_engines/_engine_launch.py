"""`EngineLaunch`: how one vLLM engine starts, and `engine_launch`, the one place agentkv writes it.

`engine_launch` turns one engine's settings into vLLM engine arguments, its ``kv_transfer_config`` and its
processes' environment; `pair_engine_launch` does it for P or D from a `PairConfig`. Separate from the settings
themselves (src/agentkv/_engines/_pair_config.py), which every pair checks and reads without starting an engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _agentkv_vllm._patches import CORE_TABLE_ENV

from .._errors import UserError
from ._pair_config import PairConfig, check_engine_args, connector_choice, role_engine_args
from ._platform_settings import platform_engine_settings
from ._platforms import (
    SHARED_DEVICE_MEMORY_FRACTION,
    PairDevices,
    Platform,
    Role,
    current_platform,
    pair_devices,
)
from ._system import cpu_list

__all__ = ["PREFILL_SCHEDULING", "EngineLaunch", "engine_launch", "pair_engine_launch"]


@dataclass(frozen=True, kw_only=True)
class EngineLaunch:
    """How one vLLM engine starts: its engine arguments and the environment of its processes."""

    name: str
    model_path: Path
    cores: list[int] | None
    engine_args: dict[str, Any]
    """``AsyncEngineArgs`` keyword arguments; ``vllm serve`` takes the same as flags."""
    env: dict[str, str]
    """Environment variables the engine's processes must start with."""
    engine_id: str | None = None
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    devices: list[str] | None = None
    """The GPUs the engine sees (its ``CUDA_VISIBLE_DEVICES``); None on CPU, or where vLLM chooses."""
    home_cores: list[int] | None = None
    """The cores the engine's other threads (its scheduler process) stay on, a superset of ``cores``; None: ``cores``."""

    @property
    def where(self) -> str:
        """Where the engine computes, for progress lines: ``"cores 0-3"``, ``"GPUs 0,1"``."""
        if self.cores:
            return f"cores {cpu_list(self.cores)}"
        if self.devices:
            return f"GPUs {','.join(self.devices)}"
        return "the devices vLLM chooses"


def engine_launch(
    *,
    name: str,
    model_path: Path,
    cores: Sequence[int] | None,
    max_model_len: int,
    kv_cache_gib: float,
    prefix_caching: bool = True,
    kv_transfer: dict[str, Any] | None = None,
    side_channel: tuple[str, int] | None = None,
    idle_poll_ms: int | None = None,
    dtype: str = "auto",
    max_num_seqs: int = 64,
    platform: Platform | None = None,
    devices: Sequence[str] | None = None,
    memory_fraction: float | None = None,
    engine_args: Mapping[str, Any] | None = None,
    home_cores: Sequence[int] | None = None,
) -> EngineLaunch:
    """The engine arguments and environment of one engine (the only place agentkv writes them).

    ``platform``: default `current_platform` (vLLM's). ``devices``: the engine's GPUs (CUDA).
    ``memory_fraction``: its ``gpu_memory_utilization`` (CUDA; None: vLLM's). ``engine_args``: the
    user's vLLM engine arguments, over agentkv's (checked by `check_engine_args`). ``home_cores``: where
    the engine's threads other than its compute threads may run (`EngineLaunch.home_cores`).
    """
    platform = platform or current_platform()
    own, env = platform_engine_settings(
        platform,
        model_path=model_path,
        max_model_len=max_model_len,
        prefix_caching=prefix_caching,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        cores=cores,
        devices=devices,
        kv_cache_gib=kv_cache_gib,
        idle_poll_ms=idle_poll_ms,
        memory_fraction=memory_fraction,
    )
    if kv_transfer is not None:
        own["kv_transfer_config"] = kv_transfer
    if side_channel is not None:
        host, port = side_channel
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    own.update(check_engine_args(engine_args or {}, "engine_args"))
    return EngineLaunch(
        name=name,
        model_path=model_path,
        cores=list(cores) if cores else None,
        engine_args=own,
        env=env,
        engine_id=kv_transfer["engine_id"] if kv_transfer else None,
        side_channel_host=side_channel[0] if side_channel else None,
        side_channel_port=side_channel[1] if side_channel else None,
        devices=list(devices) if devices else None,
        home_cores=list(home_cores) if home_cores else None,
    )


def pair_engine_launch(
    config: PairConfig,
    role: Role,
    *,
    model_path: Path,
    cores: Sequence[int] | None,
    engine_id: str,
    side_channel_port: int,
    nixl_host: str = "127.0.0.1",
    core_table: str | None = None,
    platform: Platform | None = None,
    devices: PairDevices | None = None,
) -> EngineLaunch:
    """P's or D's engine: NIXL (P ``kv_producer``, D ``kv_consumer``), the pair's connector settings.

    ``core_table``: ``"<path>:<slot>"``, the engine's slot in the host's `CoreTable` (elastic cores, CPU), or
    None. ``platform``: default `current_platform`. ``devices``: the GPUs of both engines (default:
    `pair_devices` of the config's); where P and D share one, each takes ``SHARED_DEVICE_MEMORY_FRACTION``
    of its memory unless its engine arguments say otherwise (the two may not ask for more than all of it).
    The config's ``engine_args``, then the role's own, go over agentkv's settings.
    """
    platform = platform or current_platform()
    if devices is None:
        devices = pair_devices(platform, config.prefill_devices, config.decode_devices)
    memory_fraction = None
    if devices.shared:
        memory_fraction = SHARED_DEVICE_MEMORY_FRACTION
        asked = {r: role_engine_args(config, r).get("gpu_memory_utilization", memory_fraction) for r in _ROLES}
        if sum(asked.values()) > 1:
            raise UserError(
                f"P and D share GPU(s) {','.join(devices.shared)}: their gpu_memory_utilization "
                f"({asked['prefill']} and {asked['decode']}) add up to more than all of its memory"
            )
    launch = engine_launch(
        name=role,
        model_path=model_path,
        cores=cores,
        max_model_len=config.max_model_len,
        kv_cache_gib=config.kv_cache_gib,
        prefix_caching=config.prefill_prefix_cache if role == "prefill" else True,
        kv_transfer={
            **connector_choice(config),
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": platform.kv_buffer_device,
            "engine_id": engine_id,
            "kv_connector_extra_config": config.connector_config(),
        },
        side_channel=(nixl_host, side_channel_port),
        idle_poll_ms=config.idle_poll_ms,
        dtype=config.dtype,
        platform=platform,
        devices=devices.of(role),
        memory_fraction=memory_fraction,
        engine_args={**PREFILL_SCHEDULING, **role_engine_args(config, role)}
        if role == "prefill"
        else role_engine_args(config, role),
    )
    if core_table is not None and platform.pins_cores:
        launch.env[CORE_TABLE_ENV] = core_table
    return launch


_ROLES: tuple[Role, Role] = ("prefill", "decode")

PREFILL_SCHEDULING = {"scheduling_policy": "priority"}
"""P schedules by priority (the user's ``prefill_engine_args`` may say otherwise): a pin's release, a one-token
request that lets D free a conversation's blocks, is sent with `RELEASE_PRIORITY` and so is scheduled before the
prefills queued on P; every other request has vLLM's default priority 0, which keeps them first come, first
served."""

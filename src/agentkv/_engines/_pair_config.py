"""`PairConfig`: the settings of a P/D pair, and the one place they become vLLM's settings.

`EmbeddedPair` and `LaunchedPair` take the same settings (a `PairConfig`, or its fields as
keyword arguments); `agentkv engine` builds one from its flags. `engine_launch` turns the
settings of one engine into vLLM engine arguments (``AsyncEngineArgs`` fields, or the
same as ``vllm serve`` flags), its ``kv_transfer_config``, and the environment the
engine's processes need: the embedded engines, the launched servers and ``agentkv
serve`` all start from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

from .._errors import UserError
from ._system import bind_order, cpu_list
from ._vllm_patches import CORE_TABLE_ENV, engine_env

__all__ = [
    "PUSH_CONNECTOR",
    "CorePolicy",
    "EngineLaunch",
    "PairConfig",
    "PairSettings",
    "Role",
    "Transfer",
    "connector_choice",
    "kv_buffer_device",
    "engine_launch",
    "pair_engine_launch",
    "resolve_dtype",
]

Role = Literal["prefill", "decode"]
Transfer = Literal["pull", "push"]
"""How a step's KV goes from P to D: D reads it once P is done (``"pull"``, vLLM's ``NixlConnector``), or P
writes it into blocks D registered while P computed (``"push"``). Push-back (D to P) is a read either way."""
CorePolicy = Literal["split", "elastic"]
"""How P and D share the cores: each on its own half (``"split"``), or each with a thread team on its
own half that grows onto the other engine's half while no engine owning that half has anything to
compute (``"elastic"``)."""


@dataclass(frozen=True, kw_only=True)
class PairConfig:
    """The settings of a P/D pair (embedded or launched), checked when made.

    Build variants with `dataclasses.replace`. Every field is also a keyword argument of
    `EmbeddedPair` and `LaunchedPair`.
    """

    model: str | os.PathLike[str] | None = None
    """A bundled model name or a local HF folder (default: the bundled SmolLM2-135M)."""
    bidirectional: bool = True
    """D pins each step's KV and P can pull it back (vLLM ``bidirectional_kv_xfer``). Off, the pair is
    standard disaggregated inference."""
    transfer: Transfer = "pull"
    """``"pull"``: D reads P's KV after P's prefill; ``"push"``: P writes it into D as soon as it is computed,
    D submitted beside P (with push-back: agentkv's connector, `agentkv._engines._push_connector`). See
    ``docs/transfer.md``."""
    prefill_prefix_cache: bool = True
    """P's own prefix cache (off reproduces the source's baseline)."""
    cores: tuple[Sequence[int], Sequence[int]] | None = None
    """The core sets of P and D (disjoint); default: the available cores split in two halves."""
    core_policy: CorePolicy = "elastic"
    """``"elastic"``: an engine computes on both core sets while no other engine owning them has anything to
    compute (host-wide), on its own set otherwise; ``"split"``: always on its own set. See
    ``docs/performance.md``."""
    dtype: str = "auto"
    """Weights and KV dtype of both engines: ``"auto"`` (bfloat16 where the CPU computes it natively,
    else float32), ``"float32"`` or ``"bfloat16"``."""
    max_model_len: int = 4096
    """Context length of both engines."""
    kv_cache_gib: float = 1.0
    """KV cache per engine, whole GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    pin_ttl_s: float = 480.0
    """How long D pins a step's blocks (``decoder_kv_blocks_ttl``)."""
    max_pinned_blocks: int | None = None
    """At most this many of D's KV blocks held by pins (an embedded pair: the least recently pinned
    conversations are released first; None: as many as leave room in D's cache for the steps in flight).
    See ``docs/reliability.md``."""
    recompute_threshold: int = 16
    """P recomputes instead of pulling fewer tokens than this (``kv_recompute_threshold``)."""
    connector_options: Mapping[str, Any] = field(default_factory=dict[str, Any])
    """More ``kv_connector_extra_config`` for vLLM's NIXL connector (they win)."""
    idle_poll_ms: int | None = 50
    """How often an engine with nothing to run checks its parked KV, and NIXL's progress thread polls
    when no event wakes it; new requests wake the engine at once. ``None`` keeps vLLM's and NIXL's busy
    loops (about a core per engine while KV is parked). See ``docs/vllm-patches.md``."""
    warmup: bool = True
    """Run two short steps at open, so first-call costs (kernels, NIXL handshakes) miss the first turn."""
    step_timeout_s: float = 300.0
    """A step that makes no progress for this long fails with `EngineError`."""

    def __post_init__(self) -> None:
        if self.pin_ttl_s <= 10:
            raise UserError("pin_ttl_s must exceed 10 s: P declines reads within 5 s of expiry")
        if self.idle_poll_ms is not None and self.idle_poll_ms < 1:
            raise UserError("idle_poll_ms must be at least 1 ms (or None for the busy loops)")
        if self.max_model_len < 16:
            raise UserError("max_model_len must be at least 16 tokens")
        if self.max_pinned_blocks is not None and self.max_pinned_blocks < 1:
            raise UserError("max_pinned_blocks must be at least 1 block (or None: bounded by D's cache)")
        if self.recompute_threshold < 0:
            raise UserError("recompute_threshold must be 0 (always pull) or more")
        kv_cache_space(self.kv_cache_gib)
        for name in ("step_timeout_s", "pin_ttl_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise UserError(f"{name} must be a positive number, not {value!r}")
        if self.cores is not None and (len(self.cores) != 2 or not all(self.cores)):
            raise UserError("cores takes two non-empty core lists: prefill's, then decode's")
        if self.core_policy not in ("split", "elastic"):
            raise UserError(f"core_policy is 'split' or 'elastic', not {self.core_policy!r}")
        if self.transfer not in ("pull", "push"):
            raise UserError(f"transfer is 'pull' or 'push', not {self.transfer!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise UserError(f"dtype is 'auto', 'float32', 'bfloat16' or 'float16', not {self.dtype!r}")
        object.__setattr__(self, "connector_options", dict(self.connector_options))

    @classmethod
    def of(
        cls, config: PairConfig | None = None, model: str | os.PathLike[str] | None = None, **settings: Any
    ) -> PairConfig:
        """``config`` (default: the defaults) with ``settings`` (and ``model``, unless None) replacing its fields."""
        if model is not None:
            settings["model"] = model
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise UserError(
                f"unknown pair setting(s) {', '.join(unknown)}; the settings are {', '.join(sorted(names))}"
            )
        return dataclasses.replace(config or cls(), **settings)

    def connector_config(self) -> dict[str, Any]:
        """``kv_connector_extra_config`` of both engines (``connector_options`` win)."""
        push = {"push_registration_timeout": self.step_timeout_s} if self.transfer == "push" else {}
        return {
            "bidirectional_kv_xfer": self.bidirectional,
            "kv_recompute_threshold": self.recompute_threshold,
            "decoder_kv_blocks_ttl": self.pin_ttl_s,
            **push,  # vLLM logs a D still waiting for its push after this long (it does not give up: PushedStep)
            **self.connector_options,
        }


class PairSettings(TypedDict, total=False):
    """`PairConfig`'s fields as keyword arguments (``EmbeddedPair(max_model_len=2048)``)."""

    bidirectional: bool
    transfer: Transfer
    prefill_prefix_cache: bool
    cores: tuple[Sequence[int], Sequence[int]] | None
    core_policy: CorePolicy
    dtype: str
    max_model_len: int
    kv_cache_gib: float
    pin_ttl_s: float
    max_pinned_blocks: int | None
    recompute_threshold: int
    connector_options: Mapping[str, Any]
    idle_poll_ms: int | None
    warmup: bool
    step_timeout_s: float


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
) -> EngineLaunch:
    """The engine arguments and environment of one engine (the only place agentkv writes them)."""
    engine_args: dict[str, Any] = {
        "model": str(model_path),
        "dtype": resolve_dtype(dtype),
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": True,  # skip torch.compile: start-up ~20 s instead of ~75 s on CPU
        "enable_prefix_caching": prefix_caching,
    }
    env = {"VLLM_CPU_KVCACHE_SPACE": kv_cache_space(kv_cache_gib), **engine_env(idle_poll_ms)}
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cores) if list(cores) == sorted(set(cores)) else bind_order(cores)
    if kv_transfer is not None:
        engine_args["kv_transfer_config"] = kv_transfer
    if side_channel is not None:
        host, port = side_channel
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    return EngineLaunch(
        name=name,
        model_path=model_path,
        cores=list(cores) if cores else None,
        engine_args=engine_args,
        env=env,
        engine_id=kv_transfer["engine_id"] if kv_transfer else None,
        side_channel_host=side_channel[0] if side_channel else None,
        side_channel_port=side_channel[1] if side_channel else None,
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
) -> EngineLaunch:
    """P's or D's engine: NIXL (P ``kv_producer``, D ``kv_consumer``), the pair's connector settings.

    ``core_table``: ``"<path>:<slot>"``, the engine's slot in the host's `CoreTable` (elastic cores), or None.
    """
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
            "kv_buffer_device": kv_buffer_device(),
            "engine_id": engine_id,
            "kv_connector_extra_config": config.connector_config(),
        },
        side_channel=(nixl_host, side_channel_port),
        idle_poll_ms=config.idle_poll_ms,
        dtype=config.dtype,
    )
    if core_table is not None:
        launch.env[CORE_TABLE_ENV] = core_table
    return launch


PUSH_CONNECTOR = {
    "kv_connector": "AgentKVPushConnector",
    "kv_connector_module_path": "agentkv._engines._push_connector",
}
"""agentkv's connector: vLLM 0.32's push connector refuses ``bidirectional_kv_xfer``."""


def connector_choice(config: PairConfig) -> dict[str, str]:
    """The ``KVTransferConfig`` fields that name the connector of ``config``'s transfer."""
    if config.transfer == "pull":
        return {"kv_connector": "NixlConnector"}
    return dict(PUSH_CONNECTOR) if config.bidirectional else {"kv_connector": "NixlPushConnector"}


def kv_buffer_device() -> str:
    """Where NIXL registers the KV: the platform's own memory (``"cpu"`` here; ``"cuda"`` on a GPU host, where
    NIXL moves VRAM to VRAM over RDMA/EFA). vLLM's platform says which; without vLLM, ``"cpu"``."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "cpu"
    return str(current_platform.device_type) or "cpu"


def resolve_dtype(dtype: str) -> str:
    """``"auto"``: bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), else float32.

    On a CPU without native bf16 (e.g. AVX2-only EPYC) vLLM emulates it: prefill ran ~10x slower.
    """
    if dtype != "auto":
        return dtype
    try:
        with open("/proc/cpuinfo") as file:
            flags = next((line for line in file if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def kv_cache_space(gib: float) -> str:
    """``VLLM_CPU_KVCACHE_SPACE`` for ``gib``: vLLM 0.32 reads a whole number of GiB (a fraction failed its start)."""
    if not (isinstance(gib, int | float) and math.isfinite(gib) and gib >= 1 and float(gib).is_integer()):
        raise UserError(f"kv_cache_gib must be a whole number of GiB, at least 1 (vLLM's CPU KV cache): not {gib!r}")
    return str(int(gib))

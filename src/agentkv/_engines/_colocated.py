"""`Colocated`: one vLLM engine with prefix caching, the baseline to a pair."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from _agentkv_vllm._cores import CoreTable

from .._errors import EngineDeadError, UserError
from .._model import prepare_model_off_loop
from ._base import Engine, EngineDetails, EngineInfo, StepEvent, StepRequest, StepTimings
from ._engine_launch import engine_launch
from ._pair_config import check_engine_args
from ._pair_layer import run_warmup_steps
from ._platforms import current_platform
from ._system import single_engine_cores
from ._vllm import AsyncLLMRunner, DecodeStream, EngineRequest
from ._vllm_readouts import engine_seconds
from ._vllm_sampling import vllm_sampling

__all__ = ["Colocated"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""The dtypes an engine takes (`PairConfig.dtype` checks the same four)."""

logger = logging.getLogger("agentkv")


class Colocated(Engine):
    """One vLLM engine that prefills and decodes, reusing KV through its prefix cache.

    Args:
        model: a bundled model name, a local HF folder or a Hugging Face id ``org/name[@revision]``
            from the HF cache (see `prepare_model`; default: the bundled SmolLM2-135M).
        cores: cores for the engine's compute threads (default: all available but one, left to its scheduler and
            the front end, as vLLM binds its own: `agentkv._engines._system.compute_cores`, while its
            other threads, its scheduler process among them, may run on any available core). Given, every thread
            of the engine stays on them. CPU only.
        max_model_len: context length.
        kv_cache_gib: KV cache size (``VLLM_CPU_KVCACHE_SPACE``). CPU only: on CUDA the KV takes what
            ``gpu_memory_utilization`` leaves.
        dtype: weights and KV dtype: ``"auto"`` (on CPU: bfloat16 where the CPU computes it natively, else
            float32; on CUDA: the model's), ``"float32"``, ``"bfloat16"`` or ``"float16"``, as `PairConfig.dtype`.
        warmup: run one short request at start.
        step_timeout_s: a step that makes no progress for this long fails with `EngineError`.
        engine_args: vLLM engine arguments (``AsyncEngineArgs`` field names) over agentkv's, as
            `PairConfig.engine_args` (the same names are refused).
        progress: called with one line per start-up stage.

    On a GPU host (vLLM's CUDA platform) the engine runs on the visible GPUs, its tensor-parallel
    size their number (``engine_args={"tensor_parallel_size": 1}`` for one), with vLLM's defaults.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        cores: Sequence[int] | None = None,
        max_model_len: int = 4096,
        kv_cache_gib: float = 1.0,
        dtype: str = "auto",
        warmup: bool = True,
        step_timeout_s: float = 300.0,
        engine_args: Mapping[str, Any] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        if dtype not in _DTYPES:
            raise UserError(f"dtype is one of {', '.join(map(repr, _DTYPES))}, not {dtype!r}")
        self._engine_args = check_engine_args(engine_args or {}, "engine_args")
        self._model = model
        self._cores = list(cores) if cores is not None else None
        self._max_model_len = max_model_len
        self._kv_cache_gib = kv_cache_gib
        self._dtype = dtype
        self._warmup = warmup
        self._step_timeout_s = step_timeout_s
        self._progress = progress or (lambda line: logger.info("%s", line))
        self._engine: AsyncLLMRunner | None = None
        self._info: EngineInfo | None = None

    @property
    def info(self) -> EngineInfo:
        return self._info_once_started(self._info)

    @property
    def pids(self) -> set[int]:
        """Every process the engine started."""
        return set(self._engine.pids) if self._engine is not None else set()

    async def _start(self) -> None:
        platform = current_platform()  # first: a host vLLM finds no platform on fails before the model is prepared
        model_path = await prepare_model_off_loop(self._model, progress=self._progress)
        cores: list[int] | None = None
        home: list[int] | None = None
        devices: tuple[str, ...] = ()
        if platform.pins_cores:  # CPU: cores of its own, claimed in the host's core table below
            cores, home = single_engine_cores(self._cores)
            where: EngineDetails = {"cores": cores}
        else:  # a GPU host: the visible GPUs, none of the CPU machinery
            if self._cores is not None:
                raise UserError("cores= binds the engine's threads on vLLM's CPU platform; this host runs CUDA")
            devices = platform.visible_devices
            where = {"platform": platform.kind, "devices": list(devices)}
        launch = engine_launch(
            name="colocated",
            model_path=model_path,
            cores=cores,
            max_model_len=self._max_model_len,
            kv_cache_gib=self._kv_cache_gib,
            dtype=self._dtype,
            platform=platform,
            devices=devices or None,
            engine_args=self._engine_args,
            home_cores=home,
        )
        # elastic pairs on the host see a claimed slot busy and keep off its cores
        core_slot = CoreTable().claim(home) if home is not None else None
        self._engine = AsyncLLMRunner(launch, core_slot=core_slot)
        await self._engine.start_async(self._progress)
        self._know_started(model_path, where)

    def _know_started(self, model_path: Path, details: EngineDetails) -> None:
        self._info = EngineInfo(model_path=model_path, max_model_len=self._max_model_len, details=details)

    async def _warm_up(self) -> None:
        if self._warmup:
            await run_warmup_steps(self, push_back=False)

    async def _stop(self) -> None:
        if self._engine is not None:
            await self._engine.shutdown_async()

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        if request.pin is not None:
            raise UserError("a colocated engine takes no pin")
        engine = self._engine
        assert engine is not None
        started = time.perf_counter()
        params = vllm_sampling(request.sampling, kv_transfer_params=None, stream=True)
        asked = EngineRequest(request.prompt_token_ids, params, request.request_id, request.cache_salt)
        stream = DecodeStream(engine, asked, idle_timeout_s=self._step_timeout_s)
        try:
            async with contextlib.aclosing(aiter(stream)) as deltas:  # a caller leaving early closes it now
                async for delta in deltas:
                    yield delta
        except EngineDeadError as exc:
            self._dead = exc
            await self.aclose()
            raise
        output, stats, _, completion = stream.finished()
        prefill_s, wait_s, decode_s = engine_seconds(output)
        prompt_tokens = len(request.prompt_token_ids)
        local = stats.num_cached_tokens if stats is not None else min(output.num_cached_tokens or 0, prompt_tokens)
        timings = StepTimings(
            ttft_s=(stream.first_token_at or time.perf_counter()) - started,
            prefill_s=prefill_s,
            kv_wait_s=wait_s,
            decode_s=decode_s,
            local_hit_tokens=local,
            computed_tokens=prompt_tokens - local,
            kv_bytes=0,
            kv_transfer_s=0.0,
        )
        yield stream.done(completion, timings)

"""`EmbeddedPair`: a prefill engine P and a decode engine D in this process, joined by NIXL.

One step (DESIGN.md section 5): P prefills the prompt with ``max_tokens=1``, pulling the
conversation's earlier KV back from D when given D's handle; D pulls from P what it lacks,
decodes, pins its blocks and returns a new handle.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread

from .._errors import EngineDeadError, EngineError, UserError
from .._model import prepare_model
from ._base import Engine, EngineInfo, Sampling, StepDone, StepEvent, StepRequest, StepTimings
from ._handle import KVHandle, parse_handle, parse_prefill_result, prefill_params
from ._idle import idle_env
from ._system import free_port, split_cores
from ._vllm import DecodeStream, TransferLedger, VLLMEngine, VLLMSettings, engine_seconds, vllm_sampling

__all__ = ["EmbeddedPair", "check_pair_options", "connector_config", "run_warmup_steps"]

logger = logging.getLogger("agentkv")


class EmbeddedPair(Engine):
    """Two vLLM engines (P, D) in the calling process, NIXL between them, push-back on by default.

    Args:
        model: a bundled model name or a local HF folder (default: the bundled SmolLM2-135M).
        bidirectional: D pins each step's KV and P can pull it back (vLLM ``bidirectional_kv_xfer``).
            Off, the pair is standard disaggregated inference.
        prefill_prefix_cache: P's own prefix cache (off reproduces the source's baseline).
        cores: the core sets of P and D; default: the available cores split in two halves.
        max_model_len: context length of both engines.
        kv_cache_gib: KV cache per engine (``VLLM_CPU_KVCACHE_SPACE``).
        pin_ttl_s: how long D pins a step's blocks (``decoder_kv_blocks_ttl``).
        recompute_threshold: P recomputes instead of pulling fewer tokens than this.
        connector_options: more ``kv_connector_extra_config`` for vLLM's NIXL connector (they win).
        idle_poll_ms: how often an engine with nothing to run checks its parked KV (reads
            finished, pins expired) and NIXL's progress thread polls when no event wakes it.
            New requests wake the engine at once. ``None`` keeps vLLM's and NIXL's busy loops:
            about a core per engine while KV is parked.
        warmup: run two short steps at start so first-call costs (kernels, NIXL handshakes)
            do not land on the user's first turn.
        step_timeout_s: a step that makes no progress for this long fails with `EngineError`.
        progress: called with one line per start-up stage (default: the ``agentkv`` logger).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        bidirectional: bool = True,
        prefill_prefix_cache: bool = True,
        cores: tuple[Sequence[int], Sequence[int]] | None = None,
        max_model_len: int = 4096,
        kv_cache_gib: float = 1.0,
        pin_ttl_s: float = 480.0,
        recompute_threshold: int = 16,
        connector_options: Mapping[str, Any] | None = None,
        idle_poll_ms: int | None = 50,
        warmup: bool = True,
        step_timeout_s: float = 300.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        check_pair_options(pin_ttl_s=pin_ttl_s, idle_poll_ms=idle_poll_ms)
        self._model = model
        self.bidirectional = bidirectional
        self.prefill_prefix_cache = prefill_prefix_cache
        self._cores = cores
        self._max_model_len = max_model_len
        self._kv_cache_gib = kv_cache_gib
        self.pin_ttl_s = pin_ttl_s
        self._recompute_threshold = recompute_threshold
        self._connector_options = dict(connector_options or {})
        self._idle_poll_ms = idle_poll_ms
        self._warmup = warmup
        self._step_timeout_s = step_timeout_s
        self._progress = progress or (lambda line: logger.info("%s", line))
        self._p: VLLMEngine | None = None
        self._d: VLLMEngine | None = None
        self._info: EngineInfo | None = None

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError("EmbeddedPair is not open")
        return self._info

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
        model_path = await anyio.to_thread.run_sync(lambda: prepare_model(self._model, progress=self._progress))
        p_cores, d_cores = (list(c) for c in self._cores) if self._cores else split_cores()
        settings = VLLMSettings(
            model_path=model_path, max_model_len=self._max_model_len, kv_cache_gib=self._kv_cache_gib
        )
        tag = uuid.uuid4().hex[:8]
        extra = connector_config(
            bidirectional=self.bidirectional,
            recompute_threshold=self._recompute_threshold,
            pin_ttl_s=self.pin_ttl_s,
            options=self._connector_options,
        )
        for name, role, cores, prefix in (
            ("prefill", "kv_producer", p_cores, self.prefill_prefix_cache),
            ("decode", "kv_consumer", d_cores, True),
        ):
            engine = VLLMEngine(
                name=name,
                cores=cores,
                settings=settings,
                prefix_caching=prefix,
                side_channel_port=free_port(),
                extra_env=idle_env(self._idle_poll_ms),
                kv_transfer={
                    "kv_connector": "NixlConnector",
                    "kv_role": role,
                    "kv_buffer_device": "cpu",
                    "engine_id": f"agentkv-{name}-{tag}",
                    "kv_connector_extra_config": extra,
                },
            )
            if name == "prefill":
                self._p = engine
            else:
                self._d = engine
            await engine.start_async(self._progress)
        self._info = EngineInfo(
            kind="pair",
            model_path=model_path,
            max_model_len=self._max_model_len,
            push_back=self.bidirectional,
            extra={
                "prefill_cores": p_cores,
                "decode_cores": d_cores,
                "pin_ttl_s": self.pin_ttl_s,
                "prefill_prefix_cache": self.prefill_prefix_cache,
            },
        )

    async def _warm_up(self) -> None:
        if self._warmup:
            self._progress("agentkv: warming up (kernels, NIXL handshakes)")
            await run_warmup_steps(self, push_back=self.bidirectional)
        for engine in self._engines():
            engine.repin()  # threads that NIXL started during the handshakes

    async def _stop(self) -> None:
        engines = [e for e in (self._d, self._p) if e is not None]
        for engine in engines:
            await engine.shutdown_async()

    # ----------------------------------------------------------------- one step

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        if request.handle is not None and not self.bidirectional:
            raise UserError("this pair runs without bidirectional transfer: it takes no handle")
        try:
            async for event in self._step(request):
                yield event
        except EngineDeadError as exc:
            await self._mark_dead(exc)
            raise

    async def _step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        p, d = self._engines()
        started = time.perf_counter()
        declined = False
        p_out, p_stats, p_ledger = await self._prefill(p, request, request.handle)
        if p_out is None and request.handle is not None:
            # P failed to read D's blocks (expired or failed): the handle is spent; recompute.
            declined = True
            p_out, p_stats, p_ledger = await self._prefill(p, request, None)
        if p_out is None:
            raise EngineError("the prefill engine failed the request")
        handoff = parse_prefill_result(p_out.kv_transfer_params)
        params = vllm_sampling(request.sampling, kv_transfer_params=handoff.model_dump(), stream=True)
        stream = DecodeStream(
            d,
            request.prompt_token_ids,
            params,
            f"{request.request_id}-d",
            idle_timeout_s=self._step_timeout_s,
            cache_salt=request.cache_salt,
        )
        async for delta in stream:
            yield delta
        d_out, d_stats, d_ledger = stream.result()
        completion = d_out.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise EngineError(f"the decode engine ended the step with {completion.finish_reason!r}")
        prefill_s, p_wait, _ = engine_seconds(p_out)
        _, d_wait, decode_s = engine_seconds(d_out)
        timings = StepTimings(
            ttft_s=stream.first_token_at - started if stream.first_token_at else time.perf_counter() - started,
            prefill_s=prefill_s,
            kv_wait_s=p_wait + d_wait,
            decode_s=decode_s,
            handoff_tokens=d_stats.num_external_cached_tokens if d_stats is not None else 0,
            pullback_declined=declined or p_ledger.expired > 0,
            **_transfer(p_ledger, d_ledger),
            **_prompt_split(p_stats, len(request.prompt_token_ids), p_out.num_cached_tokens),
        )
        yield StepDone(
            token_ids=stream.token_ids,
            text=stream.text,
            finish_reason=completion.finish_reason,
            handle=parse_handle(d_out.kv_transfer_params) if self.bidirectional else None,
            timings=timings,
        )

    async def _prefill(
        self, p: VLLMEngine, request: StepRequest, handle: KVHandle | None
    ) -> tuple[Any, Any, TransferLedger]:
        """Run P to completion; the output is None when P failed (e.g. declined an expired read)."""
        params = vllm_sampling(Sampling(max_tokens=1), kv_transfer_params=prefill_params(handle), stream=False)
        request_id = f"{request.request_id}-p{'h' if handle else ''}"
        final: Any = None
        with anyio.fail_after(self._step_timeout_s):
            async for output in p.generate(request.prompt_token_ids, params, request_id, cache_salt=request.cache_salt):
                final = output
        stats, ledger = p.finish(request_id)
        if final is None or final.outputs[0].finish_reason == "error" or final.kv_transfer_params is None:
            return None, stats, ledger
        return final, stats, ledger

    def _engines(self) -> tuple[VLLMEngine, VLLMEngine]:
        if self._p is None or self._d is None:
            raise EngineError("EmbeddedPair is not open")
        for engine in (self._p, self._d):
            if engine.errored:
                raise EngineDeadError(f"the {engine.name} engine died")
        return self._p, self._d

    async def _mark_dead(self, exc: BaseException) -> None:
        if self._dead is None:
            logger.error("agentkv: an engine of the pair died; stopping the pair: %s", exc)
            self._dead = exc
            await self.aclose()


def _prompt_split(stats: Any, prompt_tokens: int, num_cached_tokens: int | None) -> dict[str, int]:
    """Where the prompt's KV came from, from P's ``PrefillStats`` (exact)."""
    if stats is None:  # vLLM reported no split (not seen in 0.32): say so, rather than guess quietly
        logger.warning("agentkv: vLLM gave no prefill split for a step; its cached tokens are reported as local")
        local = min(num_cached_tokens or 0, prompt_tokens)
        return {"local_hit_tokens": local, "pulled_tokens": 0, "computed_tokens": prompt_tokens - local}
    return {
        "local_hit_tokens": stats.num_local_cached_tokens,
        "pulled_tokens": stats.num_external_cached_tokens,
        "computed_tokens": prompt_tokens - stats.num_local_cached_tokens - stats.num_external_cached_tokens,
    }


def _transfer(*ledgers: TransferLedger) -> dict[str, Any]:
    if any(ledger.shared for ledger in ledgers):
        return {"kv_bytes": None, "kv_transfer_s": None}
    return {
        "kv_bytes": sum(ledger.bytes for ledger in ledgers),
        "kv_transfer_s": sum(ledger.seconds for ledger in ledgers),
    }


async def run_warmup_steps(pair: Engine, *, push_back: bool) -> None:
    """Two short steps (one pushing the first one's handle back): kernels and NIXL handshakes run now."""
    prompt = [1] + [28] * 300  # two CPU blocks of one repeated token: shapes and handshakes only
    handle: KVHandle | None = None
    for index in range(2 if push_back else 1):
        request = StepRequest(
            request_id=f"agentkv-warmup-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            sampling=Sampling(max_tokens=4),
            handle=handle,
        )
        async for event in pair.step(request):
            if isinstance(event, StepDone):
                handle = event.handle
        prompt = prompt + [28] * (40 + index)


def check_pair_options(*, pin_ttl_s: float, idle_poll_ms: int | None) -> None:
    """Reject pair settings that cannot work, before anything starts."""
    if pin_ttl_s <= 10:
        raise UserError("pin_ttl_s must exceed 10 s: P declines reads within 5 s of expiry")
    if idle_poll_ms is not None and idle_poll_ms < 1:
        raise UserError("idle_poll_ms must be at least 1 ms (or None for the busy loops)")


def connector_config(
    *, bidirectional: bool, recompute_threshold: int, pin_ttl_s: float, options: Mapping[str, Any]
) -> dict[str, Any]:
    """``kv_connector_extra_config`` of both engines of a pair (``options`` win)."""
    return {
        "bidirectional_kv_xfer": bidirectional,
        "kv_recompute_threshold": recompute_threshold,
        "decoder_kv_blocks_ttl": pin_ttl_s,
        **options,
    }

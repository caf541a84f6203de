"""`EmbeddedPair`: a prefill engine P and a decode engine D in this process, joined by NIXL.

One step (docs/concepts.md, "Turns, steps, P and D"): P prefills the prompt with ``max_tokens=1``, pulling the
conversation's earlier KV back from D when given D's handle; D pulls from P what it lacks,
decodes, pins its blocks and returns a new handle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Unpack

import anyio
import anyio.to_thread

from _agentkv_vllm._cores import CoreTable, elastic_bind_order
from _agentkv_vllm._patches import AUTO_PLACEMENT, ELASTIC_CORES

from .._errors import EngineDeadError, EngineError, SessionClosedError, UserError
from .._model import prepare_model_off_loop
from ._base import (
    EngineInfo,
    StepDone,
    StepEvent,
    StepRequest,
    StepTimings,
    TokenDelta,
    pair_modes,
    prompt_split,
)
from ._handle import KVHandle, PushSource, parse_handle, parse_prefill_result, prefill_params, release_params
from ._pair_config import PairConfig, PairSettings, Role, pair_engine_launch
from ._pair_layer import ON_DECODE_PARAMS, PairLayer
from ._placement import PlacementChoice
from ._platforms import Platform, current_platform, pair_devices
from ._push import PushedStep
from ._system import free_port, split_cores
from ._vllm import AsyncLLMRunner, DecodeStream, TransferLedger, engine_seconds
from ._vllm_features import feature_problem, has_feature
from ._vllm_sampling import continued_sampling, first_token_of_prefill, prefill_sampling, vllm_sampling

__all__ = ["EmbeddedPair"]

logger = logging.getLogger("agentkv")


class EmbeddedPair(PairLayer):
    """Two vLLM engines (P, D) in the calling process, NIXL between them, push-back on by default.

    Its settings are a `PairConfig`: pass one as ``config``, or its fields as keyword
    arguments (``EmbeddedPair(max_model_len=2048, pin_ttl_s=60)``), or both (the keywords
    replace the config's fields). ``model`` is the config's ``model``.

    Args:
        model: a bundled model name, a local HF folder or a Hugging Face id ``org/name[@revision]``
            from the HF cache (see `prepare_model`; default: the bundled SmolLM2-135M).
        config: the pair's settings (default: `PairConfig`'s defaults).
        progress: called with one line per start-up stage (default: the ``agentkv`` logger).
        **settings: `PairConfig` fields (``bidirectional``, ``prefill_prefix_cache``, ``cores``,
            ``prefill_devices``, ``decode_devices``, ``max_model_len``, ``kv_cache_gib``, ``pin_ttl_s``,
            ``max_pinned_blocks``, ``recompute_threshold``, ``connector_options``, ``idle_poll_ms``, ``warmup``,
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
        config = PairConfig.of(config, model, **settings)
        super().__init__(max_pinned_blocks=config.max_pinned_blocks)
        self.config = config
        self._progress = progress or (lambda line: logger.info("%s", line))
        self._p: AsyncLLMRunner | None = None
        self._d: AsyncLLMRunner | None = None
        self._info: EngineInfo | None = None
        self._core_policy = self.config.core_policy

    @property
    def bidirectional(self) -> bool:
        """Whether D pins KV and P can pull it back."""
        return self.config.bidirectional

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
        if self._info is None:
            raise SessionClosedError(f"the {type(self).__name__} is not open")
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
        config = self.config
        model_path = await prepare_model_off_loop(config.model, progress=self._progress)
        platform = current_platform()
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

    def _know_started(self, model_path: Path, placement: dict[str, Any]) -> None:
        """The pair's `EngineInfo`, once both engines run: ``placement`` says where each computes."""
        config = self.config
        assert self._d is not None
        problem = feature_problem(AUTO_PLACEMENT) if config.transfer == "pull" else None
        self._placement_off = problem if config.transfer == "pull" else "a push pair prefills every step on P"
        modes_off = {}
        if problem is not None and config.bidirectional:
            modes_off["auto"] = f"auto placement is off on this vLLM ({problem})"
        self._info = EngineInfo(
            model_path=model_path,
            max_model_len=config.max_model_len,
            modes=pair_modes(push_back=config.bidirectional, placement=self._placement_off is None),
            extra={
                **placement,
                **({"modes_off": modes_off} if modes_off else {}),
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

    # ----------------------------------------------------------------- one step

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        if request.handle is not None and not self.bidirectional:
            raise UserError("this pair runs without bidirectional transfer: it takes no handle")
        try:
            async with contextlib.aclosing(
                self._pinned_step(request)
            ) as events:  # a caller leaving early closes it now
                async for event in events:
                    yield event
        except EngineDeadError as exc:
            await self._mark_dead(exc)
            raise

    async def _step_via_prefill(
        self, request: StepRequest, started: float, choice: PlacementChoice
    ) -> AsyncGenerator[StepEvent, None]:
        p, d = self._engines()
        if self.config.transfer == "push":
            async with contextlib.aclosing(self._pushed_step(p, d, request, started, choice)) as events:
                async for event in events:
                    yield event
            return
        whole = vllm_sampling(request.sampling, kv_transfer_params=None, stream=True)  # D's, refused before P works
        if request.sampling.structured is not None:
            d.check(whole)  # P samples without the grammar; every other field P checks itself as it takes the request
        (p_out, p_stats, p_ledger), declined = await self._prefill_or_recompute(p, request)
        handoff = parse_prefill_result(p_out.kv_transfer_params)
        first = first_token_of_prefill(request, p_out, d.block_size)
        sampling, d_prompt = request.sampling, list(request.prompt_token_ids)
        if first is not None:  # P's token is the answer's first: stream it now, D continues after it
            first_token_at = time.perf_counter()
            yield first
            sampling = continued_sampling(sampling)
            d_prompt.extend(first.token_ids)
        params = vllm_sampling(sampling, kv_transfer_params=handoff.as_decode_params(), stream=True)
        stream = self._decode_stream(d, d_prompt, params, request, "d")
        async with contextlib.aclosing(aiter(stream)) as deltas:
            async for delta in deltas:
                yield delta
        d_out, d_stats, d_ledger, completion = _finished(stream)
        if first is None:
            first_token_at = stream.first_token_at or time.perf_counter()
        _, p_wait, _ = engine_seconds(p_out)
        _, d_wait, _ = engine_seconds(d_out)
        timings = self._timings(
            request,
            choice,
            ttft_s=first_token_at - started,
            kv_wait_s=p_wait + d_wait,
            declined=declined,
            prefill=(p_out, p_stats, p_ledger),
            decode=(d_out, d_stats, d_ledger),
        )
        yield self._done(first, stream, completion, d_out, timings)

    def _timings(
        self,
        request: StepRequest,
        choice: PlacementChoice,
        *,
        ttft_s: float,
        kv_wait_s: float,
        declined: bool,
        prefill: tuple[Any, Any, TransferLedger],
        decode: tuple[Any, Any, TransferLedger],
    ) -> StepTimings:
        """A step through P and D: where its prompt's KV came from, what moved, and the times."""
        (p_out, p_stats, p_ledger), (d_out, d_stats, d_ledger) = prefill, decode
        prefill_s, _, _ = engine_seconds(p_out)
        _, _, decode_s = engine_seconds(d_out)
        if p_stats is None and self._p is not None and self._p.keeps_prefill_stats:  # not seen in 0.32: say so
            logger.warning("agentkv: vLLM gave no prefill split for a step; its cached tokens are reported as local")
        split = (p_stats.num_local_cached_tokens, p_stats.num_external_cached_tokens) if p_stats is not None else None
        return StepTimings(
            ttft_s=ttft_s,
            prefill_s=prefill_s,
            kv_wait_s=kv_wait_s,
            decode_s=decode_s,
            handoff_tokens=d_stats.num_external_cached_tokens if d_stats is not None else 0,
            pullback_declined=declined or p_ledger.expired > 0,
            prefill_engine="prefill",
            placement_reason=choice.reason,
            **_transfer(p_ledger, d_ledger),
            **prompt_split(len(request.prompt_token_ids), split=split, cached_tokens=p_out.num_cached_tokens),
        )

    def _done(
        self, first: TokenDelta | None, stream: DecodeStream, completion: Any, d_out: Any, timings: StepTimings
    ) -> StepDone:
        """The step's end: its tokens (P's first, when streamed, then D's) and D's new handle."""
        handle, handle_error = parse_handle(d_out.kv_transfer_params) if self.bidirectional else (None, None)
        logprobs = stream.logprobs
        if first is not None and logprobs is not None:
            logprobs = [*(first.logprobs or ()), *logprobs]
        return StepDone(
            token_ids=[*first.token_ids, *stream.token_ids] if first is not None else stream.token_ids,
            text=first.text + stream.text if first is not None else stream.text,
            finish_reason=completion.finish_reason,
            handle=handle,
            handle_error=handle_error,
            timings=timings,
            logprobs=logprobs,
        )

    async def _pushed_step(
        self, p: AsyncLLMRunner, d: AsyncLLMRunner, request: StepRequest, started: float, choice: PlacementChoice
    ) -> AsyncGenerator[StepEvent, None]:
        """One step with P pushing (``transfer="push"``): P and D start together under one request id. D
        registers the blocks it lacks with P and waits; P prefills (pulling D's pin back when given the handle)
        and writes into them; D decodes. D samples the first token (it was sent before P's existed)."""
        shared_id = f"{request.request_id}-x"
        launch = p.launch
        assert launch.engine_id and launch.side_channel_host and launch.side_channel_port  # every pair engine's
        source = PushSource(
            remote_engine_id=launch.engine_id,
            remote_host=launch.side_channel_host,
            remote_port=launch.side_channel_port,
            remote_request_id=shared_id,
        )
        params = vllm_sampling(request.sampling, kv_transfer_params=source.as_decode_params(), stream=True)
        d.check(params)  # refused before either engine works: D's refusal would leave P's push without a reader
        # D idles until P's write lands: not counted busy till then, so P prefills on all the cores
        stream = self._decode_stream(d, request.prompt_token_ids, params, request, "x", waits_for_push=True)

        async def rescue() -> bool:
            return (await self._prefill(p, request, None, request_id=shared_id))[0] is not None

        halves = PushedStep(
            self._prefill_or_recompute(p, request, request_id=shared_id),
            aiter(stream),
            rescue,
            timeout_s=self.config.step_timeout_s,
        )
        try:
            async for delta in halves:
                yield delta
        finally:
            p.forget(shared_id)  # P's ledger has counted its write: D's KV has arrived (or the step failed)
        (p_out, p_stats, p_ledger), declined = halves.prefill_result
        d_out, d_stats, d_ledger, completion = _finished(stream)
        p_metrics, d_metrics = p_out.metrics, d_out.metrics
        # D waited for the push from its submission: only the wait after P's prefill ended is the transfer's
        pushed_wait = max(0.0, d_metrics.scheduled_ts - p_metrics.first_token_ts) if p_metrics and d_metrics else 0.0
        timings = self._timings(
            request,
            choice,
            ttft_s=(stream.first_token_at or time.perf_counter()) - started,
            kv_wait_s=engine_seconds(p_out)[1] + pushed_wait,
            declined=declined,
            prefill=(p_out, p_stats, p_ledger),
            decode=(d_out, d_stats, d_ledger),
        )
        yield self._done(None, stream, completion, d_out, timings)

    async def _prefill_or_recompute(
        self, p: AsyncLLMRunner, request: StepRequest, *, request_id: str | None = None
    ) -> tuple[tuple[Any, Any, TransferLedger], bool]:
        """P's half of a step: ((output, stats, ledger), whether D's handle was declined).

        A read P declined (D's pin expired or failed) spends the handle: P recomputes, under the same
        ``request_id`` when one is given (a pushed step's: D still waits for a push from that request).
        """
        result = await self._prefill(p, request, request.handle, request_id=request_id)
        declined = result[0] is None and request.handle is not None
        if declined:
            result = await self._prefill(p, request, None, request_id=request_id)
        if result[0] is None:
            raise EngineError("the prefill engine failed the request")
        return result, declined

    async def _step_on_decode(
        self, request: StepRequest, started: float, choice: PlacementChoice
    ) -> AsyncGenerator[StepEvent, None]:
        """The whole step on D: its prefix cache holds the pinned conversation (whole blocks); it computes the
        rest, decodes, and pins the new conversation."""
        _, d = self._engines()
        params = vllm_sampling(request.sampling, kv_transfer_params=ON_DECODE_PARAMS, stream=True)
        stream = self._decode_stream(d, request.prompt_token_ids, params, request, "dl")
        async with contextlib.aclosing(aiter(stream)) as deltas:
            async for delta in deltas:
                yield delta
        d_out, d_stats, d_ledger, completion = _finished(stream)
        prefill_s, d_wait, decode_s = engine_seconds(d_out)
        split = (d_stats.num_local_cached_tokens, 0) if d_stats is not None else None
        timings = StepTimings(
            ttft_s=stream.first_token_at - started if stream.first_token_at else time.perf_counter() - started,
            prefill_s=prefill_s,
            kv_wait_s=d_wait,
            decode_s=decode_s,
            prefill_engine="decode",
            placement_reason=choice.reason,
            **_transfer(d_ledger),
            **prompt_split(len(request.prompt_token_ids), split=split, cached_tokens=d_out.num_cached_tokens),
        )
        handle, handle_error = parse_handle(d_out.kv_transfer_params)
        yield StepDone(
            token_ids=stream.token_ids,
            text=stream.text,
            finish_reason=completion.finish_reason,
            handle=handle,
            handle_error=handle_error,
            timings=timings,
            logprobs=stream.logprobs,
        )

    def _decode_stream(
        self,
        d: AsyncLLMRunner,
        prompt: Sequence[int],
        params: Any,
        request: StepRequest,
        suffix: str,
        *,
        waits_for_push: bool = False,
    ) -> DecodeStream:
        return DecodeStream(
            d,
            prompt,
            params,
            f"{request.request_id}-{suffix}",
            idle_timeout_s=self.config.step_timeout_s,
            cache_salt=request.cache_salt,
            busy_from_first_output=waits_for_push,
        )

    async def _prefill(
        self, p: AsyncLLMRunner, request: StepRequest, handle: KVHandle | None, *, request_id: str | None = None
    ) -> tuple[Any, Any, TransferLedger]:
        """Run P to completion; the output is None when P failed (e.g. declined an expired read).

        ``request_id``: the id P knows the request by (push: the one D registered under, and P's ledger
        goes on counting its write to D until the caller forgets the request); default: its own.
        """
        params = vllm_sampling(
            prefill_sampling(request.sampling), kv_transfer_params=prefill_params(handle), stream=False
        )
        final, stats, ledger = await p.run(
            request.prompt_token_ids,
            params,
            request_id or f"{request.request_id}-p{'h' if handle else ''}",
            timeout_s=self.config.step_timeout_s,
            cache_salt=request.cache_salt,
            hold_ledger=request_id is not None,
        )
        if final is None or final.outputs[0].finish_reason == "error" or final.kv_transfer_params is None:
            return None, stats, ledger
        return final, stats, ledger

    # ----------------------------------------------------------------- pins

    async def _send_release(self, handle: KVHandle) -> None:
        """P's one-token request with ``handle`` and nothing to read (see `PairLayer.release`). It is aborted after
        its first token, so that P does not keep its own block leased for a D that never comes."""
        if self._p is None:
            return
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=_RELEASE_MAX_TOKENS,
            ignore_eos=True,
            temperature=0.0,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": release_params(handle)},
        )
        outputs = self._p.generate([_RELEASE_TOKEN], params, f"agentkv-release-{uuid.uuid4().hex}", in_ledger=False)
        try:
            with anyio.fail_after(self.config.step_timeout_s):
                await anext(outputs)  # P has notified D before its first token
        finally:
            await outputs.aclose()  # aborts the rest

    # ----------------------------------------------------------------- engines

    def _capacity(self) -> tuple[int | None, int]:
        _, d = self._engines()
        return d.num_blocks, d.block_size

    def _requests_in_flight(self) -> tuple[int, int]:
        p, d = self._engines()
        return p.in_flight, d.in_flight

    def _transfer_is_push(self) -> bool:
        return self.config.transfer == "push"

    def _engines(self) -> tuple[AsyncLLMRunner, AsyncLLMRunner]:
        if self._p is None or self._d is None:
            raise SessionClosedError(f"the {type(self).__name__} is not open")
        for engine in (self._p, self._d):
            if engine.errored:
                raise EngineDeadError(f"the {engine.name} engine died")
        return self._p, self._d

    async def _mark_dead(self, exc: BaseException) -> None:
        if self._dead is None:
            logger.error("agentkv: an engine of the pair died; stopping the pair: %s", exc)
            self._dead = exc
            await self.aclose()


def _finished(stream: DecodeStream) -> tuple[Any, Any, TransferLedger, Any]:
    """D's final output, prefill stats, ledger and completion; an output that did not end normally is an error."""
    d_out, d_stats, d_ledger = stream.result()
    completion = d_out.outputs[0]
    if completion.finish_reason not in ("stop", "length"):
        raise EngineError(f"the decode engine ended the step with {completion.finish_reason!r}")
    return d_out, d_stats, d_ledger, completion


_RELEASE_TOKEN = 0
_RELEASE_MAX_TOKENS = 64
"""Far more than P runs before the abort arrives (a finished request would keep its block leased)."""


def _transfer(*ledgers: TransferLedger) -> dict[str, Any]:
    if any(ledger.shared for ledger in ledgers):
        return {"kv_bytes": None, "kv_transfer_s": None}
    return {
        "kv_bytes": sum(ledger.bytes for ledger in ledgers),
        "kv_transfer_s": sum(ledger.seconds for ledger in ledgers),
    }

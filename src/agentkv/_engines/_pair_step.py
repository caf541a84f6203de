"""The embedded pair's step path: one step through P and D, in-process runners of vLLM.

`EmbeddedPair` (``src/agentkv/_engines/_pair.py``) starts and stops the two runners; this
is what it does with them once they run (docs/concepts.md, "Turns, steps, P and D"): P
prefills the prompt with ``max_tokens=1``, pulling the conversation's earlier KV back from
D when given D's pin; D pulls from P what it lacks (or P pushes it, ``transfer="push"``),
decodes, pins its blocks and returns a new pin (D's handle in a `Pin`). A step on D alone and a pin's release
are here too; the pin budget and the placement are every pair's (`PairLayer`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import anyio

from .._errors import EngineDeadError, EngineError, SessionClosedError
from ._base import StepDone, StepEvent, StepRequest, StepTimings, TokenDelta, prompt_split
from ._handle import (
    KVHandle,
    PushSource,
    handle_of,
    parse_handle,
    parse_prefill_result,
    pin_of,
    prefill_params,
    release_params,
)
from ._pair_config import RELEASE_PRIORITY, PairConfig
from ._pair_layer import ON_DECODE_PARAMS, PairLayer
from ._placement import PlacementChoice
from ._push import PushedStep
from ._vllm import AsyncLLMRunner, DecodeStream, EngineRequest
from ._vllm_readouts import TransferLedger, engine_seconds
from ._vllm_sampling import continued_sampling, first_token_of_prefill, prefill_sampling, vllm_sampling

__all__ = ["PairSteps"]

logger = logging.getLogger("agentkv")


class PairSteps(PairLayer):
    """The steps of a pair of in-process runners, P's (``_p``) and D's (``_d``), set by the subclass's start."""

    def __init__(self, config: PairConfig) -> None:
        super().__init__(max_pinned_blocks=config.max_pinned_blocks, slo=config.slo)
        self.config = config
        self._p: AsyncLLMRunner | None = None
        self._d: AsyncLLMRunner | None = None

    # ----------------------------------------------------------------- one step

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        self._check_pin(request)
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
        d_out, d_stats, d_ledger, completion = stream.finished()
        if first is None:
            first_token_at = stream.first_token_at or time.perf_counter()
        _, p_wait, _ = engine_seconds(p_out)
        _, d_wait, _ = engine_seconds(d_out)
        timings = self._timings(
            request,
            choice,
            ttft_s=first_token_at - started,
            kv_wait_s=p_wait + d_wait,
            handoff_wait_s=d_wait if first is not None else 0.0,
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
        handoff_wait_s: float = 0.0,
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
            handoff_wait_s=handoff_wait_s,
            decode_s=decode_s,
            handoff_tokens=d_stats.num_external_cached_tokens if d_stats is not None else 0,
            pin_declined=declined or p_ledger.expired > 0,
            prefill_engine="prefill",
            placement_reason=choice.reason,
            **_transfer(p_ledger, d_ledger),
            **prompt_split(len(request.prompt_token_ids), split=split, cached_tokens=p_out.num_cached_tokens),
        )

    def _done(
        self, first: TokenDelta | None, stream: DecodeStream, completion: Any, d_out: Any, timings: StepTimings
    ) -> StepDone:
        """The step's end: its tokens (P's first, when streamed, then D's) and D's new handle as its pin."""
        handle, pin_error = parse_handle(d_out.kv_transfer_params) if self.config.push_back else (None, None)
        return stream.done(completion, timings, first=first, pin=pin_of(handle), pin_error=pin_error)

    async def _pushed_step(
        self, p: AsyncLLMRunner, d: AsyncLLMRunner, request: StepRequest, started: float, choice: PlacementChoice
    ) -> AsyncGenerator[StepEvent, None]:
        """One step with P pushing (``transfer="push"``): P and D start together under one request id. D
        registers the blocks it lacks with P and waits; P prefills (pulling D's pin back when given one)
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
        d_out, d_stats, d_ledger, completion = stream.finished()
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
        """P's half of a step: ((output, stats, ledger), whether D's pin was declined).

        A read P declined (D's pin expired or failed) spends the handle: P recomputes, under the same
        ``request_id`` when one is given (a pushed step's: D still waits for a push from that request).
        """
        handle = handle_of(request.pin)
        result = await self._prefill(p, request, handle, request_id=request_id)
        declined = result[0] is None and handle is not None
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
        d_out, d_stats, d_ledger, completion = stream.finished()
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
        yield self._done(None, stream, completion, d_out, timings)  # a step on D alone: push-back is on

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
        asked = EngineRequest(prompt, params, f"{request.request_id}-{suffix}", request.cache_salt)
        return DecodeStream(
            d,
            asked,
            idle_timeout_s=self.config.step_timeout_s,
            busy_from_first_output=waits_for_push,
            describe_also=self._describe_stall,
        )

    def _describe_stall(self) -> str:
        """P's scheduler and D's pins as the pair counts them, for the error of a step D did not advance."""
        p = self._p.describe_state() if self._p is not None else "prefill: stopped"
        return f"{p}; {self.describe_pins()}"

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
        own_id = request_id or f"{request.request_id}-p{'h' if handle else ''}"
        asked = EngineRequest(request.prompt_token_ids, params, own_id, request.cache_salt)
        final, stats, ledger = await p.run(
            asked, timeout_s=self.config.step_timeout_s, hold_ledger=request_id is not None
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
        release_id = f"agentkv-release-{uuid.uuid4().hex}"
        release = EngineRequest([_RELEASE_TOKEN], params, release_id, priority=RELEASE_PRIORITY)  # before prefills
        outputs = self._p.generate(release, in_ledger=False)
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

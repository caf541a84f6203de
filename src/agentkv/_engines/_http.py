"""The HTTP pair engine: one step as two ``/v1/completions`` calls, P's then D's.

Shared by `LaunchedPair` (servers agentkv starts) and `RemotePair` (servers someone else
runs). The protocol is the embedded pair's (docs/concepts.md, "Turns, steps, P and D"), over HTTP: P gets the
prompt as token ids with ``max_tokens=1`` and D's handle, D streams the output (token ids
and text) and, at the end, its new handle.

Four parts: the wire (`PairTransport`: clients, retries, request bodies), what the
servers are (`ServerCapabilities`, probed once at open), what a step's replies tell
(`DecodeAnswer`, `NixlBaseline`: ``_http_answer.py``) and this engine, which runs steps
with them. A handle is single use, so a P request that may have reached P is never sent
again with the same handle: the retry goes without it (the step then reports
``miss_reason="declined"``). D is retried only when the request surely never arrived
(connection refused): P's blocks are D's to read once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from .._errors import EngineError, EngineUnavailableError, UserError
from .._model import prepare_model_off_loop
from ._base import (
    EngineInfo,
    Sampling,
    StepDone,
    StepEvent,
    StepRequest,
    StepTimings,
    prompt_split,
)
from ._handle import KVHandle, PushSource, handle_of, parse_prefill_result, prefill_params, release_params
from ._http_answer import NOTHING_MOVED, DecodeAnswer, NixlBaseline, decode_pin, moved_kv
from ._http_capabilities import (
    UNKNOWN_BLOCK_SIZE,
    DecodeCapacity,
    ServerCapabilities,
    ServerKind,
    decode_capacity,
    probe_servers,
)
from ._http_transport import (
    PairTransport,
    ServerReply,
    completion_body,
    never_arrived,
    retrying,
    translated,
)
from ._pair_config import RELEASE_PRIORITY, Transfer
from ._pair_layer import ON_DECODE_PARAMS, PairLayer
from ._placement import PlacementChoice
from ._platforms import Role
from ._push import PushedStep
from ._slo import DEFAULT_SLO, Slo
from ._vllm_sampling import check_sampling

__all__ = ["HTTPPair", "stock_decode_streaming_error"]

logger = logging.getLogger("agentkv")

_RELEASE_MAX_TOKENS = 64
"""Far more than P runs before the client's disconnect aborts the request (a finished one keeps its block leased)."""


def stock_decode_streaming_error(decode_url: str) -> UserError:
    """Why a stock vLLM decode server cannot stream to a session, and what to run instead."""
    return UserError(
        f"the decode server at {decode_url} is a stock vLLM server: its streamed responses carry no "
        "KV handle (vLLM 0.32 returns it only in non-streamed responses), so push-back cannot work, "
        "and with bidirectional_kv_xfer it keeps every step's KV pinned for decoder_kv_blocks_ttl "
        "(480 s) where nothing can free it. Run the decode server with `agentkv engine --role decode` "
        "(streaming and push-back), or pass decode_streaming=False (push-back; each answer arrives whole)."
    )


class HTTPPair(PairLayer):
    """A P/D pair of vLLM OpenAI API servers, driven with the ``openai`` client.

    Subclasses give the servers' URLs: their `_start` calls `_open_servers`. The rest is shared, and the
    pin budget, placement and pin release are every pair's (`PairLayer`): D's size comes from its
    ``/metrics``, and a step goes to D alone only when D's server says it can pin one (agentkv's server).
    """

    _agentkv_servers = False
    """The pair started agentkv's own servers: a decode server that streams no handle then lacks agentkv's
    streamed handle on this vLLM (docs/vllm-patches.md), and the pair takes D's answers whole instead."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None,
        *,
        step_timeout_s: float,
        attempts: int,
        warmup: bool,
        progress: Callable[[str], None] | None,
        push_back: bool = True,
        decode_streaming: bool = True,
        exclusive: bool = False,
        transfer: Transfer = "pull",
        max_pinned_blocks: int | None = None,
        slo: Slo | None = DEFAULT_SLO,
    ) -> None:
        super().__init__(max_pinned_blocks=max_pinned_blocks, slo=slo)
        if attempts < 1:
            raise UserError("attempts must be at least 1")
        self._model = model
        self._warmup = warmup
        self._progress = progress or (lambda line: logger.info("%s", line))
        self._transport = PairTransport(attempts=attempts, step_timeout_s=step_timeout_s)
        self._wants_push_back = push_back
        self._decode_streaming = decode_streaming
        self._exclusive = exclusive
        """The pair is the servers' only client: differences of their NIXL totals are this pair's."""
        self._urls = ("", "")
        self._capabilities: ServerCapabilities | None = None
        self._info: EngineInfo | None = None
        self._baseline = NixlBaseline()
        self._in_flight = 0
        self._started_steps = 0
        self._transfer = transfer
        self._prefill_coordinates: tuple[str, str, int] | None = None
        """P's NIXL engine id, host and side-channel port, which D needs to register for a push."""
        self._retired_engines: set[str] = set()
        """Engine ids of servers that are gone: their handles are dropped, never sent to P."""
        self._decode_capacity = DecodeCapacity(None, UNKNOWN_BLOCK_SIZE)
        self._busy: dict[Role, int] = {"prefill": 0, "decode": 0}
        """This pair's requests in flight on each server (what placement compares)."""
        self._alone_from: dict[str, int | None] = {}
        """Per step in flight: the step count when it started alone (see `step`), for NIXL differences."""

    # ----------------------------------------------------------------- what it is

    @property
    def info(self) -> EngineInfo:
        return self._info_once_started(self._info)

    @property
    def decode_streaming(self) -> bool:
        """Whether D's tokens are streamed (else one non-streamed reply per step: see `RemotePair`)."""
        return self._decode_streaming

    @property
    def urls(self) -> tuple[str, str]:
        """The URLs of P's and D's servers."""
        return self._urls

    @property
    def capabilities(self) -> ServerCapabilities | None:
        """What the servers are, as probed when the pair opened (None before)."""
        return self._capabilities

    @property
    def handle_in_stream(self) -> bool | None:
        """Whether D's streamed responses carry the KV handle (agentkv's server: yes; stock vLLM 0.32: no)."""
        return self._capabilities.handle_in_stream if self._capabilities else None

    @property
    def server_kind(self) -> ServerKind | None:
        """``"agentkv"`` (agentkv's entry point: exact prefill split, NIXL totals) or ``"vllm"``; None before open."""
        return self._capabilities.server_kind if self._capabilities else None

    # ----------------------------------------------------------------- opening

    async def _open_servers(
        self, prefill_url: str, decode_url: str, *, kind: str, model_path: Path | None = None
    ) -> None:
        """Connect to the servers, probe what they are, and decide once what the pair does.

        ``model_path``: the prepared model folder, when the caller already has it.
        """
        if model_path is None:
            model_path = await prepare_model_off_loop(self._model, progress=self._progress)
        self._urls = (prefill_url, decode_url)
        models = await self._transport.connect(self._urls)
        capabilities = await probe_servers(self._transport, models, attempts=self._transport.attempts)
        if self._decode_streaming and not capabilities.handle_in_stream:
            if not self._agentkv_servers:
                raise stock_decode_streaming_error(decode_url)
            logger.warning(
                "agentkv: the decode server at %s streams no KV handle (agentkv's streamed handle is off on this "
                "vLLM: see its log); each answer arrives whole, push-back still works",
                decode_url,
            )
            self._decode_streaming = False
        if not capabilities.exact_split:
            logger.warning(
                "agentkv: the prefill server at %s is a stock vLLM server: it does not report where cached "
                "tokens came from, so they are all reported as local_hit_tokens (`agentkv engine --role prefill` "
                "reports the split)",
                prefill_url,
            )
        self._capabilities = capabilities
        self._decode_capacity = await decode_capacity(decode_url)
        self._placement_off = capabilities.placement_off if self._transfer == "pull" else "a push pair"
        if not self._wants_push_back:
            self._placement_off = "the pair runs without push-back"
        self._info = EngineInfo(
            model_path=model_path,
            max_model_len=capabilities.max_model_len,
            pins=self._wants_push_back,
            disaggregated=True,
            places_steps=self._placement_off is None,
            details={
                "transport": kind,
                "prefill_url": prefill_url,
                "decode_url": decode_url,
                "server_kind": capabilities.server_kind,
                "transfer": self._transfer,
                "decode_kv_blocks": self._decode_capacity.blocks,
            },
        )

    async def _reconnect(self, prefill_url: str, decode_url: str) -> None:
        """Point the clients at new URLs of the same servers (a restart): nothing is probed again."""
        self._urls = (prefill_url, decode_url)
        await self._transport.connect(self._urls)
        self._info = dataclasses.replace(
            self.info, details={**self.info.details, "prefill_url": prefill_url, "decode_url": decode_url}
        )

    async def _warm_up(self) -> None:
        if self._warmup:
            self._progress("agentkv: warming up the servers (kernels, NIXL handshakes)")
            await self._calibrate()

    async def _stop(self) -> None:
        await self._transport.close()

    # ----------------------------------------------------------------- pins

    def _capacity(self) -> tuple[int | None, int]:
        return self._decode_capacity.blocks, self._decode_capacity.block_size

    def _requests_in_flight(self) -> tuple[int, int]:
        return self._busy["prefill"], self._busy["decode"]

    def _transfer_is_push(self) -> bool:
        return self._transfer == "push"

    @contextlib.contextmanager
    def _on(self, role: Role) -> Iterator[None]:
        self._busy[role] += 1
        try:
            yield
        finally:
            self._busy[role] -= 1

    async def _send_release(self, handle: KVHandle) -> None:
        """P's one-token request with ``handle`` (see `PairLayer.release`), streamed and closed after its first
        chunk, which aborts the request on P so that P keeps no block leased for a D that never comes."""
        if handle.remote_engine_id in self._retired_engines:
            return
        assert self._capabilities is not None
        body = completion_body(
            model=self._capabilities.served_model,
            prompt_token_ids=[0],
            max_tokens=_RELEASE_MAX_TOKENS,
            sampling=Sampling(max_tokens=_RELEASE_MAX_TOKENS),
            kv_transfer_params=release_params(handle),
        )
        body["extra_body"] |= {"ignore_eos": True, "priority": RELEASE_PRIORITY}  # before P's queued prefills
        async with contextlib.aclosing(self._transport.stream("prefill", body)) as chunks:
            async for _ in chunks:
                break  # P has notified D before its first token

    # ----------------------------------------------------------------- one step

    async def _before_step(self) -> None:
        """Hook: make sure the servers are there (a launched pair restarts a dead one)."""

    async def _server_gone(self) -> str | None:
        """Hook: which server is gone and why, when that is known (a launched pair checks its processes)."""
        return None

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        self._check_pin(request)
        check_sampling(request.sampling)  # what D would refuse after P's work (P refuses the rest before it)
        await self._before_step()
        self._in_flight += 1
        self._started_steps += 1
        self._alone_from[request.request_id] = self._started_steps if self._in_flight == 1 else None
        try:
            async with contextlib.aclosing(self._pinned_step(request)) as events:
                async for event in events:
                    yield event
        except EngineUnavailableError as exc:
            gone = await self._server_gone()
            if gone is None:
                raise
            raise EngineUnavailableError(f"{gone}; the conversation is kept, and the next step restarts it") from exc
        finally:
            self._in_flight -= 1
            self._alone_from.pop(request.request_id, None)

    async def _step_via_prefill(
        self, request: StepRequest, started: float, choice: PlacementChoice
    ) -> AsyncGenerator[StepEvent, None]:
        pushed: PushedStep[tuple[Any, ServerReply | None], tuple[ServerReply, bool]] | None = None
        if self._transfer == "push":
            pushed = await self._pushed_halves(request)
            outputs: AsyncIterator[tuple[Any, ServerReply | None]] = aiter(pushed)
        else:
            p_reply, declined = await self._prefill(request)
            handoff = parse_prefill_result(p_reply.kv_transfer_params)
            body = self._body(
                request, max_tokens=request.sampling.max_tokens, kv_transfer_params=handoff.as_decode_params()
            )
            outputs = self._decode(body)
        answer = DecodeAnswer(logprobs_count=request.sampling.options.logprobs)
        async for delta in answer.collect(outputs):
            yield delta
        if pushed is not None:
            p_reply, declined = pushed.prefill_result
        yield self._done(request, answer, started, choice, prefill=p_reply, declined=declined)

    async def _step_on_decode(
        self, request: StepRequest, started: float, choice: PlacementChoice
    ) -> AsyncGenerator[StepEvent, None]:
        """The whole step on D's server: its cache holds the pin's whole blocks; it computes the rest and pins."""
        body = self._body(request, max_tokens=request.sampling.max_tokens, kv_transfer_params=ON_DECODE_PARAMS)
        answer = DecodeAnswer(logprobs_count=request.sampling.options.logprobs)
        async for delta in answer.collect(self._decode(body)):
            yield delta
        yield self._done(request, answer, started, choice, prefill=None, declined=False)

    def _done(
        self,
        request: StepRequest,
        answer: DecodeAnswer,
        started: float,
        choice: PlacementChoice,
        *,
        prefill: ServerReply | None,
        declined: bool,
    ) -> StepDone:
        """The step's end from D's reply and P's (``prefill`` None: the step ran on D alone)."""
        if answer.finish_reason not in ("stop", "length"):
            raise EngineError(f"the decode server ended the step with {answer.finish_reason!r}")
        d_reply = answer.reply
        pin, pin_error = decode_pin(d_reply) if self.info.pins else (None, None)
        computed_on = prefill or d_reply  # the reply of the server that prefilled the prompt
        p_moved = self._baseline.advance("prefill", prefill) if prefill is not None else dict(NOTHING_MOVED)
        d_moved = self._baseline.advance("decode", d_reply)
        alone_from = self._alone_from.get(request.request_id)
        alone = alone_from is not None and alone_from == self._started_steps and self._exclusive
        return StepDone(
            token_ids=answer.token_ids,
            text="".join(answer.texts),
            finish_reason=answer.finish_reason,
            pin=pin,
            pin_error=pin_error,
            logprobs=None if answer.logprobs_count is None else answer.logprobs or [],
            stopped_by_string=isinstance(answer.stop_reason, str),
            timings=StepTimings(
                ttft_s=(answer.first_token_at or time.perf_counter()) - started,
                prefill_s=computed_on.seconds("prefill"),
                kv_wait_s=sum(reply.seconds("wait") or 0.0 for reply in (prefill, d_reply) if reply is not None),
                decode_s=d_reply.seconds("decode"),
                handoff_tokens=(d_reply.split() or (0, 0))[1] if prefill is not None else 0,
                pin_declined=declined or bool(alone and p_moved and p_moved["expired"] > 0),
                prefill_engine="prefill" if prefill is not None else "decode",
                placement_reason=choice.reason,
                **moved_kv(p_moved, d_moved, alone=alone),
                # a stock server reports one cached count: local and pulled cannot be told apart (warned at open)
                **prompt_split(
                    len(request.prompt_token_ids), split=computed_on.split(), cached_tokens=computed_on.cached_tokens
                ),
            ),
        )

    async def _pushed_halves(
        self, request: StepRequest
    ) -> PushedStep[tuple[Any, ServerReply | None], tuple[ServerReply, bool]]:
        """A pushed step's P and D under one ``X-Request-Id`` (see `PushedStep`), sent together once P's NIXL
        coordinates are known; the first step of a remote pair sends P first and learns them from its reply."""
        shared = uuid.uuid4().hex
        prefill: Awaitable[tuple[ServerReply, bool]]
        if self._prefill_coordinates is None:
            result = await self._prefill(request, request_id=shared)
            handoff = parse_prefill_result(result[0].kv_transfer_params)
            self._prefill_coordinates = (handoff.remote_engine_id, handoff.remote_host, handoff.remote_port)
            served_id = handoff.remote_request_id
            prefill = _ready(result)
        else:
            served_id = f"cmpl-{shared}-0"  # the id vLLM's server gives the single prompt of X-Request-Id `shared`
            prefill = self._prefill(request, request_id=shared)
        engine_id, host, port = self._prefill_coordinates
        source = PushSource(remote_engine_id=engine_id, remote_host=host, remote_port=port, remote_request_id=served_id)
        body = self._body(
            request,
            max_tokens=request.sampling.max_tokens,
            kv_transfer_params=source.as_decode_params(),
            request_id=shared,
        )

        async def rescue() -> bool:
            await self._prefill(dataclasses.replace(request, pin=None), request_id=shared)  # raises if it failed
            return True

        return PushedStep(prefill, self._decode(body), rescue, timeout_s=self._transport.step_timeout_s)

    async def _prefill(self, request: StepRequest, *, request_id: str | None = None) -> tuple[ServerReply, bool]:
        """P's reply, and whether the handle was dropped (P declined it, or it may have been spent).

        ``request_id``: the ``X-Request-Id`` P gets (a pushed step's, which D waits on), or none.
        """
        handle: KVHandle | None = handle_of(request.pin)
        dropped = False
        if handle is not None and handle.remote_engine_id in self._retired_engines:
            handle, dropped = None, True  # the server that pinned it was restarted: its blocks are gone
        with translated("prefill"):
            async for attempt in retrying(attempts=self._transport.attempts, role="prefill"):
                with attempt:
                    try:
                        with self._on("prefill"):
                            _, reply = await self._transport.complete(
                                "prefill",
                                self._body(
                                    request,
                                    max_tokens=1,
                                    kv_transfer_params=prefill_params(handle),
                                    request_id=request_id,
                                ),
                            )
                    except Exception as exc:
                        if handle is not None and not never_arrived(exc):
                            handle, dropped = None, True  # it may have been read: never send it twice
                        raise
            if reply.kv_transfer_params is None and handle is not None:  # P could not read D's blocks
                dropped = True
                with self._on("prefill"):
                    _, reply = await self._transport.complete(
                        "prefill",
                        self._body(
                            request, max_tokens=1, kv_transfer_params=prefill_params(None), request_id=request_id
                        ),
                    )
        if reply.kv_transfer_params is None:
            raise EngineError("the prefill server returned no kv_transfer_params (is it a kv_producer with NIXL?)")
        return reply, dropped

    async def _decode(self, body: dict[str, Any]) -> AsyncGenerator[tuple[Any, ServerReply | None], None]:
        """D's output: ``(choice, None)`` per chunk, then ``(None, reply)`` with the handle when sent."""
        with self._on("decode"):
            async with contextlib.aclosing(self._decode_replies(body)) as replies:
                async for item in replies:
                    yield item

    async def _decode_replies(self, body: dict[str, Any]) -> AsyncGenerator[tuple[Any, ServerReply | None], None]:
        if self._decode_streaming:
            async with contextlib.aclosing(self._transport.stream("decode", body)) as chunks:
                async for item in chunks:
                    yield item
            return
        with translated("decode"):
            choice, reply = await self._transport.complete("decode", body)
        yield choice, None
        yield None, reply

    def _body(
        self,
        request: StepRequest,
        *,
        max_tokens: int,
        kv_transfer_params: dict[str, Any],
        request_id: str | None = None,
    ) -> dict[str, Any]:
        assert self._capabilities is not None
        body = completion_body(
            model=self._capabilities.served_model,
            prompt_token_ids=request.prompt_token_ids,
            max_tokens=max_tokens,
            sampling=request.sampling,
            kv_transfer_params=kv_transfer_params,
            cache_salt=request.cache_salt,
        )
        if request_id is not None:
            body["extra_headers"] = {"X-Request-Id": request_id}
        return body


async def _ready(value: Any) -> Any:
    return value

"""The HTTP pair engine: one step as two ``/v1/completions`` calls, P's then D's.

Shared by `LaunchedPair` (servers agentkv starts) and `RemotePair` (servers someone else
runs). The protocol is the embedded pair's (docs/concepts.md, "Turns, steps, P and D"), over HTTP: P gets the
prompt as token ids with ``max_tokens=1`` and D's handle, D streams the output (token ids
and text) and, at the end, its new handle.

Five parts: the wire (`PairTransport`: clients, retries, request bodies), what the
servers are (`ServerCapabilities`, probed once at open), what a step's replies tell
(`DecodeAnswer`, `NixlBaseline`: ``_http_answer.py``), the pair's state and its opening
(`HTTPServers`: ``_http_servers.py``) and this engine, which runs steps with them. A handle is single use, so a P request that may have reached P is never sent
again with the same handle: the retry goes without it (the step then reports
``miss_reason="declined"``). D is retried only when the request surely never arrived
(connection refused): P's blocks are D's to read once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator
from typing import Any

from .._errors import EngineError, EngineUnavailableError
from ._base import Sampling, StepDone, StepEvent, StepRequest, StepTimings, prompt_split
from ._handle import KVHandle, PushSource, handle_of, parse_prefill_result, prefill_params, release_params
from ._http_answer import NOTHING_MOVED, DecodeAnswer, decode_pin, moved_kv
from ._http_servers import HTTPServers
from ._http_transport import ServerReply, completion_body, never_arrived, retrying, translated
from ._pair_config import RELEASE_PRIORITY
from ._pair_layer import ON_DECODE_PARAMS
from ._placement import PlacementChoice
from ._platforms import Role
from ._push import PushedStep
from ._vllm_sampling import check_sampling

__all__ = ["HTTPPair"]

_RELEASE_MAX_TOKENS = 64
"""Far more than P runs before the client's disconnect aborts the request (a finished one keeps its block leased)."""


class HTTPPair(HTTPServers):
    """A P/D pair of vLLM OpenAI API servers, driven with the ``openai`` client.

    Subclasses give the servers' URLs: their `_start` calls `_open_servers`. The rest is shared, and the
    pin budget, placement and pin release are every pair's (`PairLayer`): D's size comes from its
    ``/metrics``, and a step goes to D alone only when D's server says it can pin one (agentkv's server).
    """

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

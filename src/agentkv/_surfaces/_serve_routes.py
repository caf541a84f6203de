"""The front door's routes: what each of ``POST /v1/chat/completions``, ``POST /v1/responses``, ``GET`` and
``DELETE /v1/responses/{id}``, ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` does, over the door's
pool, response store, steps in flight, admission and metrics (`DoorRoutes`), and the settings it enforces
(`ServeSettings`). The app and the server around them: src/agentkv/_surfaces/_serve.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .._engines import EngineGroup, EngineState
from .._session._pool import SessionPool
from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from .._session._session_store import PostgresSessionStore
from ._in_flight import InFlight
from ._limits import Admission, check_items, check_positive, read_body
from ._logprobs import logprob_writer
from ._metrics import ServeMetrics
from ._openai_chat import ChatRequest, CompletionIds, StreamedCalls, chunk, completion, read_request
from ._openai_responses import (
    PreviousResponseNotFoundError,
    ResponseNotFoundError,
    ResponseTurn,
    deleted_response,
    read_responses_request,
    refuse_retrieve_options,
)
from ._response_events import ResponseEvents
from ._response_store import ResponseStore, StoredResponse
from ._serve_errors import authorize, failure

__all__ = ["DoorRoutes", "ServeSettings"]

_Item = TypeVar("_Item")


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """What the front door enforces besides the pool's own limits."""

    model_name: str
    """The model id clients name (and ``GET /v1/models`` lists)."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every ``/v1`` and ``/metrics`` request needs ``Authorization: Bearer <key>`` (compared in
    constant time; never logged, nor shown in the settings' repr)."""
    max_request_bytes: int = 4 * 1024 * 1024
    """The largest request body (413 above it; counted as it arrives, before it is parsed)."""
    max_header_bytes: int = 16 * 1024
    """The most bytes of request headers, names and values (431 above it)."""
    max_messages: int = 2048
    """The most messages (Responses: input items) one request may carry (400 above it)."""
    max_in_flight: int = 64
    """The most steps running at once; one more is refused at once with 429 and ``Retry-After``, never queued."""
    timeout_s: float = 300.0
    """The most one request may take (the step is cancelled after it: nothing is kept)."""

    def __post_init__(self) -> None:
        limits = ("max_request_bytes", "max_header_bytes", "max_messages", "max_in_flight")
        check_positive({name: getattr(self, name) for name in limits})


@dataclass(frozen=True, kw_only=True)
class DoorRoutes:
    """The door's request handlers over what they share. Its steps run in ``steps`` (its ``stop`` ends them); each
    is cancelled when its client goes away."""

    pool: SessionPool
    settings: ServeSettings
    store: ResponseStore
    """Keeps responses for ``previous_response_id`` and ``GET``."""
    steps: InFlight
    admission: Admission
    metrics: ServeMetrics

    @classmethod
    def over(cls, pool: SessionPool, settings: ServeSettings, store: ResponseStore, steps: InFlight) -> DoorRoutes:
        """The routes of a door over ``pool``, its admission and metrics new."""
        admission = Admission(settings.max_in_flight)
        metrics = ServeMetrics(gauges=lambda: _gauges(pool) | {"steps_in_flight": admission.in_flight})
        return cls(pool=pool, settings=settings, store=store, steps=steps, admission=admission, metrics=metrics)

    def table(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_page, methods=["GET"]),
        ]

    def refuse(self, exc: Exception) -> JSONResponse:
        """The error response for ``exc`` (counted in the metrics)."""
        return failure(exc, self.metrics)

    async def chat(self, request: Request) -> Response:
        settings = self.settings
        try:
            authorize(request, settings.api_key)
            parsed = read_request(await read_body(request, settings.max_request_bytes))
            check_items("messages", len(parsed.messages), settings.max_messages)
            conversation_id = request.headers.get("x-session-id") or parsed.session_id or parsed.user
            headers = {"x-session-id": conversation_id} if conversation_id else {}
            if parsed.stream:
                return await self.admission.stream(lambda: self._stream_chat(parsed, conversation_id, headers, request))
            writer = await logprob_writer(self.pool, parsed.top(), as_token_ids=parsed.return_tokens_as_token_ids)
            reply = await self._step(
                request,
                lambda: self.pool.step(parsed.messages, conversation_id=conversation_id, **parsed.step_options()),
            )
        except Exception as exc:
            return self.refuse(exc)
        self.metrics.step(reply.stats)
        reply = parsed.choice_reply(reply)
        ids = CompletionIds.new(settings.model_name, parsed.request_id)
        return JSONResponse(
            completion(reply, ids, logprobs=None if writer is None else writer.rest(reply)), headers=headers
        )

    async def responses(self, request: Request) -> Response:
        settings = self.settings
        try:
            authorize(request, settings.api_key)
            parsed = read_responses_request(await read_body(request, settings.max_request_bytes))
            check_items("input", 1 if isinstance(parsed.input, str) else len(parsed.input), settings.max_messages)
            previous = await self._previous_response(parsed.previous_response_id)
            turn = ResponseTurn.begin(
                parsed, previous, session_header=request.headers.get("x-session-id"), model=settings.model_name
            )
            headers = {"x-session-id": turn.conversation_id} if turn.conversation_id else {}
            if parsed.stream:
                return await self.admission.stream(lambda: self._stream_response(turn, headers, request))
            reply = await self._step(
                request,
                lambda: self.pool.step(turn.messages(), conversation_id=turn.conversation_id, **parsed.step_options()),
            )
            answer = turn.response(reply)
            await self._keep(turn, reply, answer)
        except Exception as exc:
            return self.refuse(exc)
        self.metrics.step(reply.stats)
        return JSONResponse(answer, headers=headers)

    async def stored_response(self, request: Request) -> Response:
        """``GET``: a kept response as it was returned; ``DELETE``: forget it (it can no longer be continued)."""
        try:
            authorize(request, self.settings.api_key)
            response_id = request.path_params["response_id"]
            if request.method == "DELETE":
                if not await anyio.to_thread.run_sync(self.store.delete, response_id):
                    raise ResponseNotFoundError(response_id)
                return JSONResponse(deleted_response(response_id))
            refuse_retrieve_options(request.query_params)
            kept = await anyio.to_thread.run_sync(self.store.get, response_id)
            if kept is None:
                raise ResponseNotFoundError(response_id)
        except Exception as exc:
            return self.refuse(exc)
        return JSONResponse(kept.response)

    async def models(self, request: Request) -> Response:
        model = {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "agentkv"}
        return self._authorized(request) or JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        """``{"status": "ok"}`` with what the door holds (`_held`), or a 503 while its engine is not serving."""
        engine = self.pool.engine if self.pool.is_open else None
        if engine is None or engine.state is not EngineState.OPEN or engine.is_dead:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        if isinstance(engine, EngineGroup):  # serving while one pair lives; the others may be restarting
            return JSONResponse(
                {"status": "ok", "engines": len(engine.engines), "live": engine.live} | _held(self.pool)
            )
        return JSONResponse({"status": "ok"} | _held(self.pool))

    async def metrics_page(self, request: Request) -> Response:
        return self._authorized(request) or PlainTextResponse(
            self.metrics.text(), media_type="text/plain; version=0.0.4"
        )

    def _authorized(self, request: Request) -> Response | None:
        """None when ``request`` may be answered, else its refusal."""
        try:
            authorize(request, self.settings.api_key)
        except Exception as exc:
            return self.refuse(exc)
        return None

    async def _step(self, request: Request, step: Callable[[], Awaitable[StepReply]]) -> StepReply:
        """A plain (not streamed) step, admitted, within the timeout, cancelled if the client goes away."""
        with anyio.fail_after(self.settings.timeout_s), self.admission.admit():
            return await self.steps.call(request, step)

    async def _first(self, request: Request, items: AsyncIterator[_Item]) -> _Item:
        """A stream's first item, awaited before answering, so that a request refused at once (bad input, a busy
        conversation, a prompt over the context) gets its HTTP status."""
        with anyio.fail_after(self.settings.timeout_s):
            return await self.steps.call(request, lambda: anext(items))

    async def _stream_chat(
        self, parsed: ChatRequest, conversation_id: str | None, headers: dict[str, str], request: Request
    ) -> Response:
        """Server-sent chunks (see `_first`). The step runs in ``steps``: a stop of the door ends the stream with
        an error chunk."""
        pool, metrics = self.pool, self.metrics
        items = pool.stream(
            parsed.messages, conversation_id=conversation_id, first_token=True, deltas=True, **parsed.step_options()
        )
        first = await self._first(request, items)
        ids = CompletionIds.new(self.settings.model_name, parsed.request_id)
        writer = await logprob_writer(pool, parsed.top(), as_token_ids=parsed.return_tokens_as_token_ids)
        include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            streamed = ""
            calls = StreamedCalls()
            try:
                yield _sse(chunk("role", ids))
                with anyio.fail_after(self.settings.timeout_s):
                    item: str | ToolCallDelta | ReasoningDelta | StepReply = first
                    while not isinstance(item, StepReply):
                        if isinstance(item, ToolCallDelta):
                            calls.add(item)
                            yield _sse(chunk("tool_call", ids, call=item))
                        elif isinstance(item, ReasoningDelta):
                            yield _sse(chunk("reasoning", ids, text=item.text))
                        elif item:  # the first item, at the first token, is empty: the role chunk went out for it
                            streamed += item
                            yield _sse(
                                chunk("text", ids, text=item, logprobs=None if writer is None else writer.piece(item))
                            )
                        item = await self.steps.next(items)
                reply = parsed.choice_reply(item)
                if not reply.tool_calls and reply.text != streamed and reply.text.startswith(streamed):
                    yield _sse(chunk("text", ids, text=reply.text[len(streamed) :]))  # what was not streamed (raw)
                yield _sse(
                    chunk(
                        "end", ids, reply=reply, streamed=calls, logprobs=None if writer is None else writer.rest(reply)
                    )
                )
                if include_usage:
                    yield _sse(chunk("usage", ids, reply=reply))
                metrics.step(reply.stats)
                yield "data: [DONE]\n\n"
            except Exception as exc:  # after the status line: the error goes in the stream
                yield f"data: {bytes(self.refuse(exc).body).decode()}\n\n"
            finally:
                await items.aclose()  # a client that went away cancels the step (the session keeps nothing of it)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def _stream_response(self, turn: ResponseTurn, headers: dict[str, str], request: Request) -> Response:
        """Responses stream events. As for chat, the first item is awaited before answering (`_first`); a failure
        after that (a stop of the door too) is an ``error`` event."""
        items = self.pool.stream(
            turn.messages(),
            conversation_id=turn.conversation_id,
            first_token=True,
            deltas=True,
            **turn.request.step_options(),
        )
        first = await self._first(request, items)
        stream = ResponseEvents(turn)

        async def events() -> AsyncIterator[str]:
            try:
                for event in stream.opening():
                    yield _event_sse(event)
                with anyio.fail_after(self.settings.timeout_s):
                    item: str | ToolCallDelta | ReasoningDelta | StepReply = first
                    while not isinstance(item, StepReply):
                        for event in stream.piece(item):  # the first, empty item marks the first token: no event
                            yield _event_sse(event)
                        item = await self.steps.next(items)
                    closing = stream.closing(item)
                    await self._keep(turn, item, closing[-1]["response"])
                for event in closing:
                    yield _event_sse(event)
                self.metrics.step(item.stats)
            except Exception as exc:  # after the status line: the error goes in the stream
                refusal = json.loads(bytes(self.refuse(exc).body))
                yield _event_sse(stream.error(refusal["error"]))
            finally:
                await items.aclose()  # a client that went away cancels the step (the session keeps nothing of it)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def _previous_response(self, response_id: str | None) -> StoredResponse | None:
        if response_id is None:
            return None
        previous = await anyio.to_thread.run_sync(self.store.get, response_id)
        if previous is None:
            raise PreviousResponseNotFoundError(f"previous response with id {response_id!r} not found")
        return previous

    async def _keep(self, turn: ResponseTurn, reply: StepReply, answer: dict[str, Any]) -> None:
        if turn.request.keeps:
            await anyio.to_thread.run_sync(self.store.put, turn.stored(reply, answer))


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _event_sse(event: dict[str, Any]) -> str:
    """A Responses stream event, named as OpenAI names them (``event:`` is its type)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


_HEALTH_IDS = 1000
"""The most conversation ids ``GET /health`` lists (its count is always whole)."""


def _held(pool: SessionPool) -> dict[str, Any]:
    """What ``GET /health`` says the door holds: the named conversations live in its pool (their count, and their
    ids, the most recently used first, at most `_HEALTH_IDS` of them), and, when the doors share a PostgreSQL store,
    this door's owner id in its leases (``agentkv_leases.owner``): which door a router sent a conversation to."""
    named = pool.conversations if pool.is_open else []
    held: dict[str, Any] = {"conversations": len(named), "conversation_ids": named[::-1][:_HEALTH_IDS]}
    if isinstance(pool.store, PostgresSessionStore):
        held["owner"] = pool.store.owner
    return held


def _gauges(pool: SessionPool) -> dict[str, int]:
    sessions = pool.sessions if pool.is_open else []
    gauges = {"sessions": len(sessions), "pins": sum(1 for s in sessions if s.pinned_tokens)}
    engine = pool.engine if pool.is_open else None
    if isinstance(engine, EngineGroup):
        gauges["engines_live"] = engine.live
    return gauges

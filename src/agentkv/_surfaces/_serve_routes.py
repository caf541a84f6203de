"""The front door's model routes: what each of ``POST /v1/chat/completions``, ``POST /v1/responses``, ``GET`` and
``DELETE /v1/responses/{id}`` does, over the door's pool, response store, steps in flight, admission and metrics
(`DoorRoutes`), and the settings it enforces (`ServeSettings`). The other routes (health, readiness, models,
metrics, a tenant's sessions): src/agentkv/_surfaces/_serve_admin.py. The app and the server around them:
src/agentkv/_surfaces/_serve.py.

Every model route does the same first: the caller's tenant (src/agentkv/_surfaces/_tenants.py), the body read
within its limits and parsed (in a worker thread when large), its fields' bounds (src/agentkv/_surfaces/_bounds.py),
the conversation key (src/agentkv/_surfaces/_conversation_keys.py: `conversation_key`, the one place), and the step
on the tenant's own conversations, cache salt and quotas (`DoorRoutes.step_options`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .._session._pool import SessionPool
from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from ._bounds import check_cache_salt, is_id
from ._conversation_keys import SESSION_HEADER, conversation_key
from ._in_flight import InFlight
from ._limits import TRIM_BYTES, Admission, check_items, check_positive, give_back_memory, read_body
from ._logprobs import logprob_writer
from ._metrics import ServeMetrics
from ._openai_chat import ChatRequest, CompletionIds, StreamedCalls, chunk, completion, read_request
from ._openai_completions import serve_completion
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
from ._serve_errors import ModelNotFoundError, failure
from ._tenants import Tenants

__all__ = ["OFF_LOOP_BYTES", "DoorRoutes", "ServeSettings"]

_Item = TypeVar("_Item")
_Parsed = TypeVar("_Parsed")

OFF_LOOP_BYTES = 64 * 1024
"""A request body this large or larger is parsed and checked in a worker thread, off the HTTP server's loop."""


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """What the front door enforces besides the pool's own limits."""

    model_name: str
    """The model id replies name (the first of ``served_names``)."""
    served_names: tuple[str, ...] = ()
    """Every model id a request may name, as ``vllm serve --served-model-name`` takes them (``GET /v1/models`` lists
    them); another is vLLM's 404. None given: ``model_name`` is listed and a request may name any model (agentkv's
    clients before these names; vLLM would take its ``--model`` only)."""
    tenants: Tenants = field(default_factory=Tenants)
    """The API keys, each with its tenant (none: no key needed, one tenant), and the gateway's tenant header; keys
    are compared in constant time, never logged, nor shown in the settings' repr."""
    max_request_bytes: int = 4 * 1024 * 1024
    """The largest request body (413 above it; counted as it arrives, before it is parsed)."""
    max_header_bytes: int = 16 * 1024
    """The most bytes of request headers, names and values (431 above it)."""
    max_messages: int = 2048
    """The most messages (Responses: input items) one request may carry (400 above it)."""
    max_in_flight: int = 64
    """The most steps running at once; one more is refused at once with 429 and ``Retry-After``, never queued."""
    tenant_max_in_flight: int | None = None
    """The most steps of one tenant running at once (None: ``max_in_flight``); one more is a 429 as above."""
    timeout_s: float = 300.0
    """The most one request may take (the step is cancelled after it: nothing is kept)."""
    write_timeout_s: float | None = 30.0
    """The most one write of a stream waits for a client that does not read (then the connection is dropped)."""
    keep_responses: bool = True
    """Whether ``POST /v1/responses`` keeps responses (``store``); False: none is (as vLLM's default)."""

    @property
    def names(self) -> tuple[str, ...]:
        """The model ids served: ``served_names``, else ``model_name``."""
        return self.served_names or (self.model_name,)

    def check_model(self, name: str | None) -> None:
        """Refuse a request naming a model not among ``served_names`` (when given), with vLLM's 404 (none named, or
        an empty name: the first)."""
        if name and self.served_names and name not in self.served_names:
            raise ModelNotFoundError(name, self.served_names)

    def __post_init__(self) -> None:
        limits = ("max_request_bytes", "max_header_bytes", "max_messages", "max_in_flight")
        check_positive({name: getattr(self, name) for name in limits})
        if self.tenant_max_in_flight is not None:
            check_positive({"tenant_max_in_flight": self.tenant_max_in_flight})


@dataclass(frozen=True, kw_only=True)
class DoorRoutes:
    """The door's model routes over what they share. Its steps run in ``steps`` (its ``stop`` ends them); each
    is cancelled when its client goes away."""

    pool: SessionPool
    settings: ServeSettings
    store: ResponseStore
    """Keeps responses for ``previous_response_id`` and ``GET``, each its tenant's."""
    steps: InFlight
    admission: Admission
    metrics: ServeMetrics

    @classmethod
    def over(
        cls,
        pool: SessionPool,
        settings: ServeSettings,
        store: ResponseStore,
        steps: InFlight,
        gauges: Callable[[], dict[str, int]],
    ) -> DoorRoutes:
        """The routes of a door over ``pool``, its admission and metrics new (``gauges``: the pool's)."""
        admission = Admission(
            settings.max_in_flight, per_tenant=settings.tenant_max_in_flight, write_timeout_s=settings.write_timeout_s
        )
        metrics = ServeMetrics(gauges=lambda: gauges() | {"steps_in_flight": admission.in_flight})
        return cls(pool=pool, settings=settings, store=store, steps=steps, admission=admission, metrics=metrics)

    def table(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id:path}", self.stored_response, methods=["GET", "DELETE"]),
        ]

    def refuse(self, exc: BaseException) -> JSONResponse:
        """The error response for ``exc`` (counted in the metrics)."""
        return failure(exc, self.metrics)

    async def parsed(self, request: Request, parse: Callable[[bytes], _Parsed]) -> _Parsed:
        """The request's body, read within its limit and parsed by ``parse`` (its fields' bounds checked: a
        `UserError` when it fails), in a worker thread when the body is `OFF_LOOP_BYTES` or more."""
        body = await read_body(request, self.settings.max_request_bytes)
        if len(body) >= TRIM_BYTES:  # the last large request's memory given back first (`give_back_memory`)
            await anyio.to_thread.run_sync(give_back_memory)
        if len(body) >= OFF_LOOP_BYTES:
            return await anyio.to_thread.run_sync(parse, body)
        return parse(body)

    def step_options(self, tenant: str | None, key: str | None, body: Any) -> dict[str, Any]:
        """The pool's step arguments of a request besides its messages and sampling: its conversation (``key``),
        its tenant, and its own ``cache_salt`` (over the tenant's)."""
        salt = check_cache_salt(getattr(body, "cache_salt", None))
        return {"conversation_id": key, "tenant": tenant, "cache_salt": salt}

    @staticmethod
    def echoed(key: str | None, request_id: str | None) -> dict[str, str]:
        """The answer's headers: the conversation's key, and the client's ``request_id`` (checked ids)."""
        headers = {SESSION_HEADER: key} if key else {}
        return headers | ({"x-request-id": request_id} if request_id else {})

    async def chat(self, request: Request) -> Response:
        settings = self.settings
        try:
            tenant = settings.tenants.tenant_of(request.headers)
            parsed = await self.parsed(request, read_request)
            settings.check_model(parsed.model)
            check_items("messages", len(parsed.messages), settings.max_messages)
            key = conversation_key(request.headers, parsed)
            options: dict[str, Any] = {**self.step_options(tenant, key, parsed), **parsed.step_options()}
            headers = self.echoed(key, parsed.request_id)
            if parsed.stream:
                return await self.admission.stream(lambda: self._stream_chat(parsed, options, headers, request), tenant)
            writer = await logprob_writer(self.pool, parsed.top(), as_token_ids=parsed.return_tokens_as_token_ids)
            reply = await self._step(request, tenant, lambda: self.pool.step(parsed.messages, **options))
        except Exception as exc:
            return self.refuse(exc)
        self.metrics.step(reply.stats)
        reply = parsed.choice_reply(reply)
        ids = CompletionIds.new(settings.model_name, parsed.request_id)
        return JSONResponse(
            completion(reply, ids, logprobs=None if writer is None else writer.rest(reply)), headers=headers
        )

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``: src/agentkv/_surfaces/_openai_completions.py."""
        return await serve_completion(self, request)

    async def responses(self, request: Request) -> Response:
        settings = self.settings
        try:
            tenant = settings.tenants.tenant_of(request.headers)
            parsed = await self.parsed(request, read_responses_request)
            settings.check_model(parsed.model)
            if not settings.keep_responses:  # as vLLM without its store: taken as store false
                parsed = parsed.model_copy(update={"store": False})
            check_items("input", 1 if isinstance(parsed.input, str) else len(parsed.input), settings.max_messages)
            previous = await self._previous_response(parsed.previous_response_id, tenant)
            key = conversation_key(request.headers, parsed)
            turn = ResponseTurn.begin(parsed, previous, conversation_id=key, model=settings.model_name)
            options: dict[str, Any] = {
                **self.step_options(tenant, turn.conversation_id, parsed),
                **parsed.step_options(),
            }
            headers = self.echoed(turn.conversation_id, parsed.request_id)
            if parsed.stream:
                return await self.admission.stream(
                    lambda: self._stream_response(turn, tenant, options, headers, request), tenant
                )
            reply = await self._step(request, tenant, lambda: self.pool.step(turn.messages(), **options))
            answer = turn.response(reply)
            await self._keep(turn, tenant, reply, answer)
        except Exception as exc:
            return self.refuse(exc)
        self.metrics.step(reply.stats)
        return JSONResponse(answer, headers=headers)

    async def stored_response(self, request: Request) -> Response:
        """``GET``: a kept response of the caller's tenant as it was returned; ``DELETE``: forget it (it can no
        longer be continued). Another tenant's id answers exactly as one never kept: a 404."""
        try:
            tenant = self.settings.tenants.tenant_of(request.headers)
            response_id = request.path_params["response_id"]
            if not is_id(response_id):  # no response has such an id: not looked up
                raise ResponseNotFoundError(response_id[:256])
            if request.method == "DELETE":
                deleted = await anyio.to_thread.run_sync(lambda: self.store.delete(response_id, tenant=tenant))
                if not deleted:
                    raise ResponseNotFoundError(response_id)
                return JSONResponse(deleted_response(response_id))
            refuse_retrieve_options(request.query_params)
            kept = await anyio.to_thread.run_sync(lambda: self.store.get(response_id, tenant=tenant))
            if kept is None:
                raise ResponseNotFoundError(response_id)
        except Exception as exc:
            return self.refuse(exc)
        return JSONResponse(kept.response)

    async def _step(self, request: Request, tenant: str | None, step: Callable[[], Awaitable[_Item]]) -> _Item:
        """A plain (not streamed) step, admitted, within the timeout, cancelled if the client goes away."""
        with anyio.fail_after(self.settings.timeout_s), self.admission.admit(tenant):
            return await self.steps.call(request, step)

    async def _first(self, request: Request, items: AsyncIterator[_Item]) -> _Item:
        """A stream's first item, awaited before answering, so that a request refused at once (bad input, a busy
        conversation, a prompt over the context) gets its HTTP status."""
        with anyio.fail_after(self.settings.timeout_s):
            return await self.steps.call(request, lambda: anext(items))

    async def _next(self, items: AsyncIterator[_Item], deadline: float) -> _Item:
        """A stream's next item, by ``deadline`` (the request's time-out, a `TimeoutError` past it). The cancel scope
        is this call's alone: none is held across a stream's yields, where it would fire in the writing task."""
        with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
            return await self.steps.next(items)

    async def _stream_chat(
        self, parsed: ChatRequest, options: dict[str, Any], headers: dict[str, str], request: Request
    ) -> Response:
        """Server-sent chunks (see `_first`). The step runs in ``steps``: a stop of the door ends the stream with
        an error chunk."""
        pool, metrics = self.pool, self.metrics
        deadline = anyio.current_time() + self.settings.timeout_s
        items = pool.stream(parsed.messages, first_token=True, deltas=True, **options)
        first = await self._first(request, items)
        ids = CompletionIds.new(self.settings.model_name, parsed.request_id)
        writer = await logprob_writer(pool, parsed.top(), as_token_ids=parsed.return_tokens_as_token_ids)
        include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            streamed = ""
            calls = StreamedCalls()
            try:
                yield _sse(chunk("role", ids))
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
                    item = await self._next(items, deadline)
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

    async def _stream_response(
        self,
        turn: ResponseTurn,
        tenant: str | None,
        options: dict[str, Any],
        headers: dict[str, str],
        request: Request,
    ) -> Response:
        """Responses stream events. As for chat, the first item is awaited before answering (`_first`); a failure
        after that (a stop of the door too) is an ``error`` event."""
        deadline = anyio.current_time() + self.settings.timeout_s
        items = self.pool.stream(turn.messages(), first_token=True, deltas=True, **options)
        first = await self._first(request, items)
        stream = ResponseEvents(turn)

        async def events() -> AsyncIterator[str]:
            try:
                for event in stream.opening():
                    yield _event_sse(event)
                item: str | ToolCallDelta | ReasoningDelta | StepReply = first
                while not isinstance(item, StepReply):
                    for event in stream.piece(item):  # the first, empty item marks the first token: no event
                        yield _event_sse(event)
                    item = await self._next(items, deadline)
                closing = stream.closing(item)
                with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                    await self._keep(turn, tenant, item, closing[-1]["response"])
                for event in closing:
                    yield _event_sse(event)
                self.metrics.step(item.stats)
            except Exception as exc:  # after the status line: the error goes in the stream
                refusal = json.loads(bytes(self.refuse(exc).body))
                yield _event_sse(stream.error(refusal["error"]))
            finally:
                await items.aclose()  # a client that went away cancels the step (the session keeps nothing of it)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def _previous_response(self, response_id: str | None, tenant: str | None) -> StoredResponse | None:
        """The caller's tenant's kept response ``response_id`` continues; one it has not (never kept, deleted,
        another tenant's, not even an id) is a 404, the same for each."""
        if response_id is None:
            return None
        previous = None
        if is_id(response_id):
            previous = await anyio.to_thread.run_sync(lambda: self.store.get(response_id, tenant=tenant))
        if previous is None:
            raise PreviousResponseNotFoundError(f"Response with id {response_id[:256]!r} not found.")
        return previous

    async def _keep(self, turn: ResponseTurn, tenant: str | None, reply: StepReply, answer: dict[str, Any]) -> None:
        if turn.request.keeps:
            stored = turn.stored(reply, answer)
            await anyio.to_thread.run_sync(lambda: self.store.put(stored, tenant=tenant))


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _event_sse(event: dict[str, Any]) -> str:
    """A Responses stream event, named as OpenAI names them (``event:`` is its type)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

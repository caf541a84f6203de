"""``agentkv serve``: the front door. OpenAI's chat-completions and Responses APIs over a `SessionPool`.

Every request carries the whole conversation; the pool sends it to the session that holds its
KV (named by the ``x-session-id`` header, else the body's ``session_id`` or ``user``, else the
session whose history it extends exactly), so turns 2+ of a conversation push D's KV back.
Responses-API requests may send only their new input and chain by ``previous_response_id``:
the door keeps each response (its conversation, and the object returned) in a `ResponseStore`.
The pool runs on its own event loop thread; the HTTP server (uvicorn) on another.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .._engines import EngineGroup, EngineState
from .._errors import (
    AgentKVError,
    ContextLengthError,
    EngineError,
    EngineStartError,
    EngineUnavailableError,
    SessionBusyError,
    SessionClosedError,
    StoreUnavailableError,
    UserError,
)
from .._model import model_name as served_name
from .._session._pool import SessionPool
from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from ._in_flight import ClientGoneError, InFlight, ServerStoppingError
from ._limits import (
    Admission,
    HeaderLimit,
    HeadersTooLargeError,
    OverloadedError,
    RequestTooLargeError,
    check_items,
    check_positive,
    parser_bound,
    read_body,
)
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
from ._response_store import MemoryResponseStore, ResponseStore, StoredResponse
from ._signals import StopSignals

__all__ = ["FrontDoor", "ServeSettings", "create_app"]

logger = logging.getLogger("agentkv")


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


def create_app(
    pool: SessionPool,
    settings: ServeSettings,
    store: ResponseStore | None = None,
    *,
    in_flight: InFlight | None = None,
) -> Starlette:
    """The ASGI app: ``POST /v1/chat/completions``, ``POST /v1/responses``, ``GET`` and ``DELETE
    /v1/responses/{id}``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``. ``store`` keeps responses for
    ``previous_response_id`` and ``GET`` (default: in memory). Its steps run in ``in_flight`` (its ``stop`` ends
    them); each is cancelled when its client goes away."""
    steps = in_flight if in_flight is not None else InFlight()
    admission = Admission(settings.max_in_flight)
    metrics = ServeMetrics(gauges=lambda: _gauges(pool) | {"steps_in_flight": admission.in_flight})
    responses_store = store if store is not None else MemoryResponseStore()

    async def chat(request: Request) -> Response:
        try:
            _authorize(request, settings)
            parsed = read_request(await read_body(request, settings.max_request_bytes))
            check_items("messages", len(parsed.messages), settings.max_messages)
            conversation_id = request.headers.get("x-session-id") or parsed.session_id or parsed.user
            headers = {"x-session-id": conversation_id} if conversation_id else {}
            if parsed.stream:
                return await admission.stream(
                    lambda: _stream(pool, parsed, conversation_id, settings, metrics, headers, request, steps)
                )
            writer = await logprob_writer(pool, parsed.top(), as_token_ids=parsed.return_tokens_as_token_ids)
            with anyio.fail_after(settings.timeout_s), admission.admit():
                reply = await steps.call(
                    request,
                    lambda: pool.step(parsed.messages, conversation_id=conversation_id, **parsed.step_options()),
                )
        except Exception as exc:
            return _failure(exc, metrics)
        metrics.step(reply.stats)
        reply = parsed.choice_reply(reply)
        ids = CompletionIds.new(settings.model_name, parsed.request_id)
        return JSONResponse(
            completion(reply, ids, logprobs=None if writer is None else writer.rest(reply)), headers=headers
        )

    async def responses(request: Request) -> Response:
        try:
            _authorize(request, settings)
            parsed = read_responses_request(await read_body(request, settings.max_request_bytes))
            check_items("input", 1 if isinstance(parsed.input, str) else len(parsed.input), settings.max_messages)
            previous = await _previous_response(responses_store, parsed.previous_response_id)
            turn = ResponseTurn.begin(
                parsed, previous, session_header=request.headers.get("x-session-id"), model=settings.model_name
            )
            headers = {"x-session-id": turn.conversation_id} if turn.conversation_id else {}
            if parsed.stream:
                return await admission.stream(
                    lambda: _stream_response(pool, responses_store, turn, settings, metrics, headers, request, steps)
                )
            with anyio.fail_after(settings.timeout_s), admission.admit():
                reply = await steps.call(
                    request,
                    lambda: pool.step(turn.messages(), conversation_id=turn.conversation_id, **parsed.step_options()),
                )
            answer = turn.response(reply)
            await _keep(responses_store, turn, reply, answer)
        except Exception as exc:
            return _failure(exc, metrics)
        metrics.step(reply.stats)
        return JSONResponse(answer, headers=headers)

    async def stored_response(request: Request) -> Response:
        """``GET``: a kept response as it was returned; ``DELETE``: forget it (it can no longer be continued)."""
        try:
            _authorize(request, settings)
            response_id = request.path_params["response_id"]
            if request.method == "DELETE":
                if not await anyio.to_thread.run_sync(responses_store.delete, response_id):
                    raise ResponseNotFoundError(response_id)
                return JSONResponse(deleted_response(response_id))
            refuse_retrieve_options(request.query_params)
            kept = await anyio.to_thread.run_sync(responses_store.get, response_id)
            if kept is None:
                raise ResponseNotFoundError(response_id)
        except Exception as exc:
            return _failure(exc, metrics)
        return JSONResponse(kept.response)

    async def models(request: Request) -> Response:
        try:
            _authorize(request, settings)
        except Exception as exc:
            return _failure(exc, metrics)
        model = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "agentkv"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(request: Request) -> Response:
        engine = pool.engine if pool.is_open else None
        if engine is None or engine.state is not EngineState.OPEN or engine.is_dead:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        if isinstance(engine, EngineGroup):  # serving while one pair lives; the others may be restarting
            return JSONResponse({"status": "ok", "engines": len(engine.engines), "live": engine.live})
        return JSONResponse({"status": "ok"})

    async def metrics_page(request: Request) -> Response:
        try:
            _authorize(request, settings)
        except Exception as exc:
            return _failure(exc, metrics)
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_page, methods=["GET"]),
        ],
        middleware=[
            Middleware(HeaderLimit, max_bytes=settings.max_header_bytes, refuse=lambda exc: _failure(exc, metrics))
        ],
    )


async def _stream(
    pool: SessionPool,
    parsed: ChatRequest,
    conversation_id: str | None,
    settings: ServeSettings,
    metrics: ServeMetrics,
    headers: dict[str, str],
    request: Request,
    steps: InFlight,
) -> Response:
    """Server-sent chunks. The first item is awaited before answering, so that a request refused
    at once (bad input, a busy conversation, a prompt over the context) gets its HTTP status. The
    step runs in ``steps``: a stop of the door ends the stream with an error chunk."""
    items = pool.stream(
        parsed.messages, conversation_id=conversation_id, first_token=True, deltas=True, **parsed.step_options()
    )
    with anyio.fail_after(settings.timeout_s):
        first = await steps.call(request, lambda: anext(items))
    ids = CompletionIds.new(settings.model_name, parsed.request_id)
    writer = await logprob_writer(pool, parsed.top(), as_token_ids=parsed.return_tokens_as_token_ids)
    include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage

    async def events() -> AsyncIterator[str]:
        streamed = ""
        calls = StreamedCalls()
        try:
            yield _sse(chunk("role", ids))
            with anyio.fail_after(settings.timeout_s):
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
                    item = await steps.next(items)
            reply = parsed.choice_reply(item)
            if not reply.tool_calls and reply.text != streamed and reply.text.startswith(streamed):
                yield _sse(chunk("text", ids, text=reply.text[len(streamed) :]))  # what was not streamed (raw output)
            yield _sse(
                chunk("end", ids, reply=reply, streamed=calls, logprobs=None if writer is None else writer.rest(reply))
            )
            if include_usage:
                yield _sse(chunk("usage", ids, reply=reply))
            metrics.step(reply.stats)
            yield "data: [DONE]\n\n"
        except Exception as exc:  # after the status line: the error goes in the stream
            failure = _failure(exc, metrics)
            yield f"data: {bytes(failure.body).decode()}\n\n"
        finally:
            await items.aclose()  # a client that went away cancels the step (the session keeps nothing of it)

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _previous_response(store: ResponseStore, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    previous = await anyio.to_thread.run_sync(store.get, response_id)
    if previous is None:
        raise PreviousResponseNotFoundError(f"previous response with id {response_id!r} not found")
    return previous


async def _keep(store: ResponseStore, turn: ResponseTurn, reply: StepReply, answer: dict[str, Any]) -> None:
    if turn.request.keeps:
        await anyio.to_thread.run_sync(store.put, turn.stored(reply, answer))


async def _stream_response(
    pool: SessionPool,
    store: ResponseStore,
    turn: ResponseTurn,
    settings: ServeSettings,
    metrics: ServeMetrics,
    headers: dict[str, str],
    request: Request,
    steps: InFlight,
) -> Response:
    """Responses stream events. As for chat, the first item is awaited before answering (a refused
    request gets its HTTP status); a failure after that (a stop of the door too) is an ``error`` event."""
    items = pool.stream(
        turn.messages(),
        conversation_id=turn.conversation_id,
        first_token=True,
        deltas=True,
        **turn.request.step_options(),
    )
    with anyio.fail_after(settings.timeout_s):
        first = await steps.call(request, lambda: anext(items))
    stream = ResponseEvents(turn)

    async def events() -> AsyncIterator[str]:
        try:
            for event in stream.opening():
                yield _event_sse(event)
            with anyio.fail_after(settings.timeout_s):
                item: str | ToolCallDelta | ReasoningDelta | StepReply = first
                while not isinstance(item, StepReply):
                    for event in stream.piece(item):  # the first, empty item marks the first token: no event
                        yield _event_sse(event)
                    item = await steps.next(items)
                closing = stream.closing(item)
                await _keep(store, turn, item, closing[-1]["response"])
            for event in closing:
                yield _event_sse(event)
            metrics.step(item.stats)
        except Exception as exc:  # after the status line: the error goes in the stream
            failure = json.loads(bytes(_failure(exc, metrics).body))
            yield _event_sse(stream.error(failure["error"]))
        finally:
            await items.aclose()  # a client that went away cancels the step (the session keeps nothing of it)

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _event_sse(event: dict[str, Any]) -> str:
    """A Responses stream event, named as OpenAI names them (``event:`` is its type)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def _authorize(request: Request, settings: ServeSettings) -> None:
    if settings.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
        raise _Unauthorized


class _Unauthorized(Exception):
    pass


_STATUS: list[tuple[type[BaseException], int, str]] = [
    (_Unauthorized, 401, "authentication_error"),
    (RequestTooLargeError, 413, "invalid_request_error"),
    (HeadersTooLargeError, 431, "invalid_request_error"),
    (OverloadedError, 429, "rate_limit_error"),
    (SessionBusyError, 409, "conflict_error"),
    (ResponseNotFoundError, 404, "invalid_request_error"),
    (ContextLengthError, 400, "invalid_request_error"),
    (UserError, 400, "invalid_request_error"),
    (TimeoutError, 504, "timeout_error"),
    (SessionClosedError, 503, "service_unavailable"),
    (ServerStoppingError, 503, "service_unavailable"),
    (ClientGoneError, 499, "client_closed_request"),
    (EngineStartError, 503, "service_unavailable"),
    (EngineUnavailableError, 503, "service_unavailable"),
    (EngineError, 503, "service_unavailable"),
    (StoreUnavailableError, 503, "service_unavailable"),
    (AgentKVError, 500, "server_error"),
]


def _failure(exc: Exception, metrics: ServeMetrics) -> JSONResponse:
    """The OpenAI error body and status for ``exc``; unexpected errors are logged, never their payload."""
    if isinstance(exc, ClientDisconnect):  # the client left while its body was read: nothing to log
        exc = ClientGoneError()
    status, kind = next(((s, k) for cls, s, k in _STATUS if isinstance(exc, cls)), (500, "server_error"))
    if status == 500:
        logger.exception("agentkv serve: a request failed")
    message = {
        _Unauthorized: "a valid API key is required (Authorization: Bearer ...)",
        TimeoutError: "the request took longer than the server's timeout; nothing of it was kept",
    }.get(type(exc), str(exc) or type(exc).__name__)
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else type(exc).__name__
    code = getattr(exc, "openai_code", code)
    param = getattr(exc, "openai_param", None)
    metrics.error(code)
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = getattr(exc, "http_headers", None)
    if isinstance(exc, StoreUnavailableError):  # the store is checked again by the next call
        headers = {"retry-after": str(exc.retry_after_s)}
    return JSONResponse(body, status_code=status, headers=headers)


def _gauges(pool: SessionPool) -> dict[str, int]:
    sessions = pool.sessions if pool.is_open else []
    gauges = {"sessions": len(sessions), "pins": sum(1 for s in sessions if s.pinned_tokens)}
    engine = pool.engine if pool.is_open else None
    if isinstance(engine, EngineGroup):
        gauges["engines_live"] = engine.live
    return gauges


class FrontDoor:
    """``agentkv serve`` from Python: OpenAI's chat-completions and Responses APIs over a `SessionPool`.

    ``agentkv serve`` runs one in the foreground; in your own process (a test, a notebook, an
    app that also uses the pool directly) start it in a thread::

        with SessionPool() as pool, FrontDoor(pool, port=8000) as door:
            client = openai.OpenAI(base_url=door.url + "/v1", api_key="none")

    Args:
        pool: the open pool every request goes to (the door never closes it).
        model_name: the model id clients name and ``GET /v1/models`` lists (default: the model folder's name,
            or the Hugging Face id, ``org/name``, of a model from the HF cache).
        api_key: when set, ``/v1`` and ``/metrics`` need ``Authorization: Bearer <key>`` (401 without it).
        max_request_bytes: the largest request body (413 above it).
        max_header_bytes: the most bytes of request headers (431 above it; uvicorn's parser cuts off a head
            past twice it with a plain 400).
        max_messages: the most messages (Responses: input items) in one request (400 above it).
        max_in_flight: the most steps running at once (429 with ``Retry-After`` above it, at once: never queued).
            Default: the pool's ``max_sessions`` (a running step holds a session: more would grow the pool past it).
        timeout_s: the most one request may take (504 after it; the step is cancelled and nothing is kept).
        host: the address to listen on (default ``127.0.0.1``: this host only).
        port: the port to listen on.
        store: where ``POST /v1/responses`` keeps responses for ``previous_response_id`` (default: a
            `MemoryResponseStore`; a `SqliteResponseStore` survives restarts). The caller closes a store it passes.
    """

    def __init__(
        self,
        pool: SessionPool,
        *,
        model_name: str | None = None,
        api_key: str | None = None,
        max_request_bytes: int = 4 * 1024 * 1024,
        max_header_bytes: int = 16 * 1024,
        max_messages: int = 2048,
        max_in_flight: int | None = None,
        timeout_s: float = 300.0,
        host: str = "127.0.0.1",
        port: int = 8000,
        store: ResponseStore | None = None,
    ) -> None:
        if not pool.is_open:
            raise UserError("open the pool first: FrontDoor(pool) serves an open SessionPool")
        settings = ServeSettings(
            model_name=model_name or served_name(pool.engine.info.model_path),
            api_key=api_key,
            max_request_bytes=max_request_bytes,
            max_header_bytes=max_header_bytes,
            max_messages=max_messages,
            max_in_flight=pool.max_sessions if max_in_flight is None else max_in_flight,
            timeout_s=timeout_s,
        )
        self.settings = settings
        self._in_flight = InFlight()
        config = uvicorn.Config(
            create_app(pool, settings, store, in_flight=self._in_flight),
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            http="h11",  # its parser bounds a request head (httptools' holds any size)
            h11_max_incomplete_event_size=parser_bound(settings.max_header_bytes),
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.url = f"http://{host}:{port}"
        """The server's address (the OpenAI base URL is this plus ``/v1``)."""

    def run(self, until: threading.Event | None = None) -> None:
        """Serve until ``until`` is set (default: until SIGINT, a terminal's Ctrl-C, or SIGTERM, when called from
        the main thread), then `stop`. Also returns when `stop` is called from another thread."""
        if until is None:
            with StopSignals("agentkv serve") as signals:
                signals.serving()
                self.run(signals.requested)
            return
        self.start()
        try:
            while not until.wait(0.25) and self._thread is not None and self._thread.is_alive():
                pass
        finally:
            self.stop()

    def start(self) -> FrontDoor:
        """Serve in a thread of its own; return once it listens."""
        self._thread = threading.Thread(target=self._server.run, name="agentkv-serve", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise OSError(f"agentkv serve could not listen on {self.url}")
            threading.Event().wait(0.02)
        return self

    def stop(self) -> None:
        """Stop serving and wait for the server's thread: the steps in flight are cancelled and their requests
        answered (a plain one with a 503, a stream with an error event), new ones refused; no step is left
        running on the pool. Safe to call twice."""
        self._in_flight.stop()
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():  # a client that reads nothing holds its connection open: stop waiting for it
                self._server.force_exit = True
                self._thread.join(timeout=20)
            self._thread = None

    def __enter__(self) -> FrontDoor:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

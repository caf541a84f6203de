"""The front door's refusals: the API key check and the OpenAI error body and status of every failure a request
can meet (`failure`), counted in the door's metrics. Used by the routes (src/agentkv/_surfaces/_serve_routes.py)
and the header limit of the app (src/agentkv/_surfaces/_serve.py)."""

from __future__ import annotations

import logging
import secrets

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

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
from ._in_flight import ClientGoneError, ServerStoppingError
from ._limits import HeadersTooLargeError, OverloadedError, RequestTooLargeError
from ._metrics import ServeMetrics
from ._openai_responses import ResponseNotFoundError

__all__ = ["authorize", "failure"]

logger = logging.getLogger("agentkv")


def authorize(request: Request, api_key: str | None) -> None:
    """Refuse ``request`` (401) unless it carries ``Authorization: Bearer <api_key>`` (compared in constant time);
    no key: every request passes."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
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


def failure(exc: Exception, metrics: ServeMetrics) -> JSONResponse:
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

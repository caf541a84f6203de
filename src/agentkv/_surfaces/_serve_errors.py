"""The front door's refusals: the OpenAI error body and status of every failure a request can meet (`failure`),
counted in the door's metrics. Used by the routes (src/agentkv/_surfaces/_serve_routes.py,
src/agentkv/_surfaces/_serve_admin.py) and the header limit of the app (src/agentkv/_surfaces/_serve.py).

No body names where the door keeps its data: a store's fault is said by its kind (locked, full, unreachable...),
never its file or its server's address, which go to the log only."""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect
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
from ._openai_responses import PreviousResponseNotFoundError, ResponseNotFoundError
from ._serve_admin import MethodNotAllowedError, NotFoundError
from ._tenants import UnauthorizedError

__all__ = ["ModelNotFoundError", "failure"]

logger = logging.getLogger("agentkv")


class ModelNotFoundError(UserError):
    """A request naming a model the door does not serve: vLLM's 404, its body as vLLM writes it (type
    ``NotFoundError``, param ``model``, code 404)."""

    openai_code = 404
    openai_param = "model"

    def __init__(self, name: str, served: tuple[str, ...]) -> None:
        super().__init__(f"The model `{name[:256]}` does not exist. Valid aliases: {', '.join(served)}.")


_STATUS: list[tuple[type[BaseException], int, str]] = [
    (UnauthorizedError, 401, "authentication_error"),
    (RequestTooLargeError, 413, "invalid_request_error"),
    (HeadersTooLargeError, 431, "invalid_request_error"),
    (OverloadedError, 429, "rate_limit_error"),
    (SessionBusyError, 409, "conflict_error"),
    (ModelNotFoundError, 404, "NotFoundError"),
    (ResponseNotFoundError, 404, "invalid_request_error"),
    (PreviousResponseNotFoundError, 404, "invalid_request_error"),
    (NotFoundError, 404, "invalid_request_error"),
    (MethodNotAllowedError, 405, "invalid_request_error"),
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


def failure(exc: BaseException, metrics: ServeMetrics) -> JSONResponse:
    """The OpenAI error body and status for ``exc``; unexpected errors are logged, never their payload."""
    if isinstance(exc, ClientDisconnect):  # the client left while its body was read: nothing to log
        exc = ClientGoneError()
    status, kind = next(((s, k) for cls, s, k in _STATUS if isinstance(exc, cls)), (500, "server_error"))
    if status == 500:
        logger.exception("agentkv serve: a request failed")
    said: dict[type[BaseException], str] = {
        UnauthorizedError: "a valid API key is required (Authorization: Bearer ...)",
        TimeoutError: "the request took longer than the server's timeout; nothing of it was kept",
    }
    message = said.get(type(exc), str(exc) or type(exc).__name__)
    if isinstance(exc, StoreUnavailableError):  # its message names the file or the server: the log has it
        message = exc.public
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else type(exc).__name__
    code = getattr(exc, "openai_code", code)
    param = getattr(exc, "openai_param", None)
    metrics.error(code if isinstance(code, str) else type(exc).__name__)
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = getattr(exc, "http_headers", None)
    if isinstance(exc, StoreUnavailableError):  # the store is checked again by the next call
        headers = {"retry-after": str(exc.retry_after_s)}
    return JSONResponse(body, status_code=status, headers=headers)

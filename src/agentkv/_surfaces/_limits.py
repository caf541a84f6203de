"""The front door's limits (docs/serve.md, "Limits"): what one request may send, and how many steps run at once.

* the request head (headers, names and values): `HeaderLimit`, 431 above ``max_header_bytes``; the HTTP parser
  (uvicorn's h11, bounded by `parser_bound`) cuts off a head far past it with a plain 400 before holding it whole;
* the body: `read_body`, 413 above ``max_request_bytes``, counted as it arrives (a declared ``Content-Length``
  is refused before any of the body is read; a chunked body, once it passes the limit), before it is parsed;
* the messages of one request (chat ``messages``, Responses ``input`` items): `check_items`, 400 above ``max_messages``;
* steps at once: `Admission`. A step past ``max_in_flight`` is refused at once with 429 and ``Retry-After``,
  never queued: the engines queue the admitted ones, and a burst cannot grow a queue in the door.

Each refusal is an error of agentkv's tree carrying its OpenAI ``code`` (and ``param``); ``_serve.py`` writes it
in OpenAI's error shape with its status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._errors import AgentKVError, UserError

__all__ = [
    "RETRY_AFTER_S",
    "Admission",
    "HeaderLimit",
    "HeadersTooLargeError",
    "OverloadedError",
    "RequestTooLargeError",
    "Ticket",
    "TooManyItemsError",
    "check_items",
    "check_positive",
    "parser_bound",
    "read_body",
]

RETRY_AFTER_S = 1
"""The ``Retry-After`` of a step refused for want of room (the `openai` client waits that long, then retries)."""


class RequestTooLargeError(UserError):
    """The request body is over ``max_request_bytes`` (a 413)."""

    openai_code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request body is over this server's limit of {_size(limit)} (agentkv serve --max-request-mb): "
            "send a shorter conversation, or raise the limit"
        )


class HeadersTooLargeError(UserError):
    """The request's headers are over ``max_header_bytes`` (a 431)."""

    openai_code = "request_header_fields_too_large"

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"the request's headers are {_size(size)}, over this server's limit of {_size(limit)} "
            "(agentkv serve --max-header-kb): send fewer or shorter headers"
        )


class TooManyItemsError(UserError):
    """A request with more messages (Responses: input items) than ``max_messages`` (a 400, OpenAI's code)."""

    openai_code = "array_above_max_length"

    def __init__(self, param: str, count: int, limit: int) -> None:
        super().__init__(
            f"Invalid '{param}': array too long. Expected an array with maximum length {limit}, but got an array "
            f"with length {count} instead (agentkv serve --max-messages): send a shorter conversation"
        )
        self.openai_param = param


class OverloadedError(AgentKVError):
    """The door runs ``max_in_flight`` steps already (a 429 with ``Retry-After``): the request was not queued."""

    openai_code = "rate_limit_exceeded"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"this server is running its limit of {limit} steps at once (agentkv serve --max-in-flight); "
            f"nothing of the request was run or kept: retry after {RETRY_AFTER_S} s"
        )
        self.http_headers = {"retry-after": str(RETRY_AFTER_S)}


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused with `RequestTooLargeError` as soon as it is known to pass ``limit`` bytes:
    at once when its ``Content-Length`` says so, else (chunked) when what has arrived passes it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise RequestTooLargeError(limit)
        parts.append(part)
    return b"".join(parts)


def check_items(param: str, count: int, limit: int) -> None:
    """Refuse a request whose ``param`` (``messages``, or Responses' ``input``) has more than ``limit`` items."""
    if count > limit:
        raise TooManyItemsError(param, count, limit)


def check_positive(limits: dict[str, object]) -> None:
    """Refuse a limit that is not a positive int, naming it."""
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive int, not {value!r}")


def parser_bound(max_header_bytes: int) -> int:
    """What uvicorn's h11 parser may buffer of an unfinished request head (``h11_max_incomplete_event_size``).

    Twice the door's limit: a head a little over the limit reaches `HeaderLimit` whole and gets its 431 in
    OpenAI's shape, whichever way the network cut it; one far over it is cut off by the parser (a plain 400)
    before it is held whole."""
    return 2 * max_header_bytes


class HeaderLimit:
    """ASGI middleware: a request whose headers (names and values) pass ``max_bytes`` gets ``refuse``'s answer
    to a `HeadersTooLargeError` (431) and never reaches the routes."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, refuse: Callable[[Exception], Response]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) for name, value in scope["headers"])
            if size > self.max_bytes:
                await self.refuse(HeadersTooLargeError(size, self.max_bytes))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Admission:
    """The steps the door runs at once, at most ``limit``: one more is refused at once (`OverloadedError`).

    Counted on the HTTP server's event loop (one thread), so a check and its count happen together.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        """Steps admitted and not yet over (streamed ones: until their last chunk is sent, or the client went)."""

    def admit(self) -> Ticket:
        """A place for one step, given back when the ticket is left (``with``), or refused now."""
        if self.in_flight >= self.limit:
            raise OverloadedError(self.limit)
        self.in_flight += 1
        return Ticket(self)

    async def stream(self, opening: Callable[[], Awaitable[Response]]) -> Response:
        """Admit a streamed step: ``opening()`` starts it and returns its response; the place is held until that
        response has been sent (or its client has gone), and given back at once if ``opening`` fails."""
        with self.admit() as ticket:
            return ticket.until_sent(await opening())


class Ticket:
    """One admitted step's place (`Admission.admit`); giving it back twice gives it back once."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission
        self._handed_over = False

    def release(self) -> None:
        """Give the place back (once: later calls do nothing)."""
        if self._admission is not None:
            self._admission.in_flight -= 1
            self._admission = None

    def until_sent(self, response: Response) -> Response:
        """``response``, which gives the place back once sent: the ``with`` block no longer does."""
        self._handed_over = True
        return _ReleasedWhenSent(response, self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._handed_over:
            self.release()


class _ReleasedWhenSent(Response):
    """Sends a response, then gives its ticket back: before the last body message (the step is over, and a client
    may send its next request as soon as it reads it), or when sending ends otherwise (an error, a client gone)."""

    def __init__(self, response: Response, ticket: Ticket) -> None:  # only sent, never read: no Response fields
        self._response = response
        self._ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._ticket.release()
            await send(message)

        try:
            await self._response(scope, receive, sending)
        finally:
            self._ticket.release()


def _size(size: int) -> str:
    """Bytes for a message: ``4 MiB``, ``16 KiB``, ``900 bytes``."""
    for unit, scale in (("MiB", 1024 * 1024), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size} bytes"

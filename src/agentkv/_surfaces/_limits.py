"""The front door's limits (docs/serve.md, "Limits"): what one request may send, and how many steps run at once.

* the request head (headers, names and values): `HeaderLimit`, 431 above ``max_header_bytes``; the HTTP parser
  (uvicorn's h11, bounded by `parser_bound`) cuts off a head far past it with a plain 400 before holding it whole;
* the body: `read_body`, 413 above ``max_request_bytes``, counted as it arrives (a declared ``Content-Length``
  is refused before any of the body is read; a chunked body, once it passes the limit), before it is parsed;
* the messages of one request (chat ``messages``, Responses ``input`` items): `check_items`, 400 above ``max_messages``;
* steps at once: `Admission`. A step past ``max_in_flight`` (or past its tenant's ``tenant_max_in_flight``) is
  refused at once with 429 and ``Retry-After``, never queued: the engines queue the admitted ones, and a burst
  cannot grow a queue in the door;
* a client that stops reading its stream: each write to it may wait ``write_timeout_s`` for the client to make room
  (back-pressure), in the task that writes; past it the connection is dropped and the step's place given back
  (`Ticket.until_sent`), so a reader that never reads holds nothing for long.

Each refusal is an error of agentkv's tree carrying its OpenAI ``code`` (and ``param``); ``_serve.py`` writes it
in OpenAI's error shape with its status.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import logging
from collections.abc import Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._errors import AgentKVError, UserError

__all__ = [
    "RETRY_AFTER_S",
    "TRIM_BYTES",
    "Admission",
    "HeaderLimit",
    "HeadersTooLargeError",
    "OverloadedError",
    "QuietDrops",
    "RequestTooLargeError",
    "Ticket",
    "TooManyItemsError",
    "check_items",
    "check_positive",
    "give_back_memory",
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
    """The door runs ``max_in_flight`` steps already, or the request's tenant its ``tenant_max_in_flight`` (a 429
    with ``Retry-After``): the request was not queued."""

    openai_code = "rate_limit_exceeded"

    def __init__(self, limit: int, *, tenant: bool = False) -> None:
        whose = (
            "your requests are running their limit of {} steps at once (agentkv serve --tenant-max-in-flight)"
            if tenant
            else "this server is running its limit of {} steps at once (agentkv serve --max-in-flight)"
        )
        super().__init__(
            f"{whose.format(limit)}; nothing of the request was run or kept: retry after {RETRY_AFTER_S} s"
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


TRIM_BYTES = 1024 * 1024
"""A body this large or larger has the memory freed since the last one given back to the system first."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    return trim


def give_back_memory() -> None:
    """Return the heap memory freed so far to the system (glibc; elsewhere nothing).

    A request of megabytes (a body of 4 MiB, its parsed strings) leaves its memory free in the C heap once
    answered, and glibc keeps what it freed there (its mmap threshold rises to the largest block freed), so each
    refused request of that size raised the door's resident memory until it plateaued some 50 to 100 MiB up.
    Called before a large body is parsed (in a worker thread: it walks the heap), it gives back the last one's."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


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
    """The steps the door runs at once, at most ``limit`` in all and ``per_tenant`` of one tenant: one more is
    refused at once (`OverloadedError`). A streamed step's writes each wait at most ``write_timeout_s`` for its
    client (None: as long as it takes).

    Counted on the HTTP server's event loop (one thread), so a check and its count happen together.
    """

    def __init__(self, limit: int, *, per_tenant: int | None = None, write_timeout_s: float | None = None) -> None:
        self.limit = limit
        self.per_tenant = per_tenant
        self.write_timeout_s = write_timeout_s
        self.in_flight = 0
        """Steps admitted and not yet over (streamed ones: until their last chunk is sent, or the client went)."""
        self.tenants: dict[str | None, int] = {}
        """The steps in flight of each tenant that has any."""

    def admit(self, tenant: str | None = None) -> Ticket:
        """A place for one of ``tenant``'s steps, given back when the ticket is left (``with``), or refused now."""
        if self.in_flight >= self.limit:
            raise OverloadedError(self.limit)
        if self.per_tenant is not None and self.tenants.get(tenant, 0) >= self.per_tenant:
            raise OverloadedError(self.per_tenant, tenant=True)
        self.in_flight += 1
        self.tenants[tenant] = self.tenants.get(tenant, 0) + 1
        return Ticket(self, tenant)

    def _release(self, tenant: str | None) -> None:
        self.in_flight -= 1
        left = self.tenants.pop(tenant, 1) - 1
        if left:
            self.tenants[tenant] = left

    async def stream(self, opening: Callable[[], Awaitable[Response]], tenant: str | None = None) -> Response:
        """Admit a streamed step: ``opening()`` starts it and returns its response; the place is held until that
        response has been sent (or its client has gone, or a write waited past ``write_timeout_s``), and given
        back at once if ``opening`` fails."""
        with self.admit(tenant) as ticket:
            return ticket.until_sent(await opening(), self.write_timeout_s)


class Ticket:
    """One admitted step's place (`Admission.admit`); giving it back twice gives it back once."""

    def __init__(self, admission: Admission, tenant: str | None = None) -> None:
        self._admission: Admission | None = admission
        self._tenant = tenant
        self._handed_over = False

    def release(self) -> None:
        """Give the place back (once: later calls do nothing)."""
        if self._admission is not None:
            self._admission._release(self._tenant)
            self._admission = None

    def until_sent(self, response: Response, write_timeout_s: float | None = None) -> Response:
        """``response``, which gives the place back once sent: the ``with`` block no longer does. Each of its writes
        waits at most ``write_timeout_s`` for the client to take what was written before (None: no bound)."""
        self._handed_over = True
        return _ReleasedWhenSent(response, self, write_timeout_s)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._handed_over:
            self.release()


class _ReleasedWhenSent(Response):
    """Sends a response, then gives its ticket back: before the last body message (the step is over, and a client
    may send its next request as soon as it reads it), or when sending ends otherwise (an error, a client gone, a
    write that waited past ``write_timeout_s`` on a client that does not read: the connection is then dropped).

    The write time-out is a cancel scope around each write, in the task that writes (never one held across the
    stream's yields, which would fire in whichever task iterates it next)."""

    def __init__(self, response: Response, ticket: Ticket, write_timeout_s: float | None) -> None:  # sent, not read
        self._response = response
        self._ticket = ticket
        self._write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._ticket.release()
            if self._write_timeout_s is None:
                await send(message)
                return
            with anyio.move_on_after(self._write_timeout_s) as waited:
                await send(message)
            if waited.cancelled_caught:
                raise _WriteTimedOut

        try:
            await self._response(scope, receive, sending)
        except _WriteTimedOut:
            _DROPPED.set(True)  # the server's log of an unfinished response is ours: `QuietDrops` drops it
        except BaseExceptionGroup as group:  # (a task group around the writes may wrap it)
            if group.subgroup(_WriteTimedOut) is None or group.subgroup(lambda e: not isinstance(e, _WriteTimedOut)):
                raise
            _DROPPED.set(True)
        finally:
            self._ticket.release()
            stream = getattr(self._response, "body_iterator", None)
            if stream is not None and hasattr(stream, "aclose"):  # its step ends now, not when it is collected
                with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError):  # (running: it is ending)
                    await stream.aclose()


class _WriteTimedOut(Exception):
    """A write to a client waited past the write time-out."""


_DROPPED: contextvars.ContextVar[bool] = contextvars.ContextVar("agentkv_dropped_slow_reader", default=False)
"""Set in a request's context when its stream was dropped for a client that did not read."""


class QuietDrops(logging.Filter):
    """Drops the HTTP server's error line about a response left unfinished when the door dropped it on purpose
    (a client that did not read within the write time-out): that is the door working, not a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_DROPPED.get() and "without completing response" in record.getMessage())


def _size(size: int) -> str:
    """Bytes for a message: ``4 MiB``, ``16 KiB``, ``900 bytes``."""
    for unit, scale in (("MiB", 1024 * 1024), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size} bytes"

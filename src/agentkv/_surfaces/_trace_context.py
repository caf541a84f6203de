"""The front door's requests as OpenTelemetry spans that continue their caller's trace.

`TraceContext` is an ASGI middleware: each HTTP request runs in a ``SERVER`` span whose parent is the context the
request carries (W3C ``traceparent``/``tracestate``, read by the propagators the application configured; the API's
default is W3C trace context and baggage). The span is current while the request is handled, so the model steps it
runs (``chat`` spans, src/agentkv/_session/_tracing.py) hang under it, on whichever thread the door's pool runs
(anyio's portals carry the context there). Through ``opentelemetry-api`` only: without an SDK it costs a header
parse and a no-op span. It sits inside the door's header bound (`agentkv._surfaces._limits.HeaderLimit`), so the
headers it reads are bounded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["TraceContext"]

_tracer = trace.get_tracer("agentkv")


class TraceContext:
    """Each HTTP request in a span continuing the caller's trace, named ``METHOD route`` (``routes``: the app's)."""

    def __init__(self, app: ASGIApp, *, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        parent = propagate.extract(carrier)
        method = scope["method"]
        with _tracer.start_as_current_span(method, context=parent, kind=SpanKind.SERVER) as span:
            if span.is_recording():  # the route is looked up only for a span that records
                attributes: dict[str, Any] = {"http.request.method": method, "url.path": scope["path"]}
                route = self._route(scope)
                if route is not None:
                    attributes["http.route"] = route
                    span.update_name(f"{method} {route}")
                span.set_attributes(attributes)

            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start" and span.is_recording():
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_status)

    def _route(self, scope: Scope) -> str | None:
        """The template of the route the request goes to (``/v1/responses/{response_id}``), None: none."""
        for route in self._routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return str(getattr(route, "path", "")) or None
        return None

"""The front door's routes besides the model's: liveness and readiness for routers, the model list, the metrics,
and a tenant's own conversations (listed, forgotten); and the door's answer to a path or method it does not serve.

What needs no key says nothing of any conversation: ``GET /health`` (liveness: 200 while the engine serves, 503
when it is down or dead) and ``GET /ready`` (readiness: the same, and 503 once the door is stopping). Everything
else needs a key and shows the caller's own: ``GET /v1/sessions`` lists the named conversations of the caller's
tenant live in the pool, ``DELETE /v1/sessions/{id}`` forgets one (its session closed, its pin released, its saved
snapshot deleted), ``GET /metrics`` counts the door's steps and errors (no ids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .._engines import EngineGroup, EngineState
from .._errors import UserError
from .._session._pool import SessionPool
from ._bounds import is_id
from ._in_flight import InFlight
from ._metrics import ServeMetrics
from ._tenants import Tenants

__all__ = ["SESSIONS_LISTED", "AdminRoutes", "MethodNotAllowedError", "NotFoundError", "gauges"]

SESSIONS_LISTED = 1000
"""The most conversation ids ``GET /v1/sessions`` lists (its ``total`` is always whole)."""


class NotFoundError(UserError):
    """A path the door does not serve, or a conversation the caller has not (a 404)."""

    openai_code = "not_found"


class MethodNotAllowedError(UserError):
    """A method the path does not take (a 405)."""

    openai_code = "method_not_allowed"


@dataclass(frozen=True)
class AdminRoutes:
    """``/health``, ``/ready``, ``/v1/models``, ``/metrics``, ``/v1/sessions``; `refuse` writes every refusal."""

    pool: SessionPool
    tenants: Tenants
    model_names: tuple[str, ...]
    """The model ids served (the first is the one replies name)."""
    steps: InFlight
    metrics: ServeMetrics
    refuse: Callable[[BaseException], Response]

    def table(self) -> list[Route]:
        return [
            Route("/v1/sessions", self.sessions, methods=["GET"]),
            Route("/v1/sessions/{session_id:path}", self.forget, methods=["DELETE"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics_page, methods=["GET"]),
        ]

    def serving(self) -> bool:
        """Whether the engine is open and alive (one pair of a group is enough)."""
        engine = self.pool.engine if self.pool.is_open else None
        return engine is not None and engine.state is EngineState.OPEN and not engine.is_dead

    async def health(self, request: Request) -> Response:
        """Liveness: ``{"status": "ok"}`` while the engine serves, else a 503."""
        if not self.serving():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """Readiness, bare: 200 while the door takes steps, 503 when its engine is down or it is stopping."""
        return Response(status_code=200 if self.serving() and not self.steps.stopping else 503)

    async def models(self, request: Request) -> Response:
        try:
            self.tenants.tenant_of(request.headers)
        except Exception as exc:
            return self.refuse(exc)
        length = self.pool.engine.info.max_model_len if self.pool.is_open else None
        models = [
            {"id": name, "object": "model", "created": 0, "owned_by": "agentkv", "max_model_len": length}
            for name in self.model_names
        ]
        return JSONResponse({"object": "list", "data": models})

    async def metrics_page(self, request: Request) -> Response:
        try:
            self.tenants.tenant_of(request.headers)
        except Exception as exc:
            return self.refuse(exc)
        return PlainTextResponse(self.metrics.text(), media_type="text/plain; version=0.0.4")

    async def sessions(self, request: Request) -> Response:
        """The caller's tenant's named conversations live in the pool: the most recently used first, at most
        `SESSIONS_LISTED` ids (``total`` counts them all)."""
        try:
            tenant = self.tenants.tenant_of(request.headers)
        except Exception as exc:
            return self.refuse(exc)
        named = self.pool.conversations_of(tenant) if self.pool.is_open else []
        data = [{"id": name, "object": "session"} for name in named[::-1][:SESSIONS_LISTED]]
        return JSONResponse({"object": "list", "data": data, "total": len(named)})

    async def forget(self, request: Request) -> Response:
        """Forget one of the caller's conversations: ``{"id", "object": "session", "deleted": true}``; one it does
        not have (never named, already forgotten, another tenant's) is a 404."""
        try:
            tenant = self.tenants.tenant_of(request.headers)
            name = request.path_params["session_id"]
            if not is_id(name) or not await self.steps.call(request, lambda: self.pool.forget(name, tenant=tenant)):
                raise NotFoundError(f"Session with id {name!r} not found.")
        except Exception as exc:
            return self.refuse(exc)
        return JSONResponse({"id": name, "object": "session", "deleted": True})

    async def not_found(self, request: Request, exc: Exception) -> Response:
        """The answer to a path the door does not serve (404) or a method it does not take there (405), in OpenAI's
        error shape."""
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        if status == 405:
            refusal = self.refuse(MethodNotAllowedError(f"{request.method} is not allowed on {request.url.path[:200]}"))
            if isinstance(exc, HTTPException) and exc.headers:
                refusal.headers.update(exc.headers)
            return refusal
        path = request.url.path
        return self.refuse(NotFoundError(f"{path[:200]}{'...' if len(path) > 200 else ''} is not served here"))


def gauges(pool: SessionPool) -> dict[str, Any]:
    """The pool's gauges for ``/metrics``: sessions held, those pinning on D, the live pairs of a group."""
    sessions = pool.sessions if pool.is_open else []
    found = {"sessions": len(sessions), "pins": sum(1 for s in sessions if s.pinned_tokens)}
    engine = pool.engine if pool.is_open else None
    if isinstance(engine, EngineGroup):
        found["engines"] = len(engine.engines)
        found["engines_live"] = engine.live
    return found

"""``agentkv serve``: the front door. OpenAI's chat-completions and Responses APIs over a `SessionPool`.

Every request carries the whole conversation; the pool sends it to the session that holds its
KV (named by the ``x-session-id`` header, else the body's ``session_id``, ``conversation_id`` or
``prompt_cache_key``, else the session whose history it extends exactly), so turns 2+ of a conversation push D's
KV back. Each API key is a tenant, and nothing crosses tenants (src/agentkv/_surfaces/_tenants.py).
Responses-API requests may send only their new input and chain by ``previous_response_id``:
the door keeps each response (its conversation, and the object returned) in a `ResponseStore`.
The pool runs on its own event loop thread; the HTTP server (uvicorn) on another.
The app is assembled here (`create_app`) around the door's routes (src/agentkv/_surfaces/_serve_routes.py,
src/agentkv/_surfaces/_serve_admin.py) and its error replies (src/agentkv/_surfaces/_serve_errors.py); `FrontDoor`
runs it in uvicorn.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware

from .._errors import UserError
from .._model import model_name as served_name
from .._session._pool import SessionPool
from ._in_flight import InFlight
from ._limits import HeaderLimit, QuietDrops, parser_bound
from ._response_store import MemoryResponseStore, ResponseStore
from ._serve_admin import AdminRoutes, gauges
from ._serve_routes import DoorRoutes, ServeSettings
from ._signals import StopSignals
from ._tenants import Tenants
from ._tokenize_routes import TokenizeRoutes
from ._trace_context import TraceContext

__all__ = ["FrontDoor", "ServeSettings", "create_app"]


def create_app(
    pool: SessionPool,
    settings: ServeSettings,
    store: ResponseStore | None = None,
    *,
    in_flight: InFlight | None = None,
) -> Starlette:
    """The ASGI app: ``POST /v1/chat/completions``, ``POST /v1/responses``, ``GET`` and ``DELETE
    /v1/responses/{id}``, ``POST /tokenize``, ``POST /detokenize``, ``GET /v1/sessions``, ``DELETE /v1/sessions/{id}``, ``GET /v1/models``, ``GET /health``,
    ``GET /ready``, ``GET /metrics``; any other path or method a 404 or 405 in OpenAI's error shape. ``store``
    keeps responses for ``previous_response_id`` and ``GET`` (default: in memory). Its steps run in ``in_flight``
    (its ``stop`` ends them); each is cancelled when its client goes away."""
    steps = in_flight if in_flight is not None else InFlight()
    routes = DoorRoutes.over(
        pool, settings, store if store is not None else MemoryResponseStore(), steps, lambda: gauges(pool)
    )
    admin = AdminRoutes(pool, settings.tenants, settings.names, steps, routes.metrics, routes.refuse)
    tokens = TokenizeRoutes(pool, settings, routes.refuse)
    table = [*routes.table(), *admin.table(), *tokens.table()]
    return Starlette(
        routes=table,
        middleware=[
            Middleware(HeaderLimit, max_bytes=settings.max_header_bytes, refuse=routes.refuse),
            Middleware(TraceContext, routes=table),  # each request a span continuing its caller's trace
        ],
        exception_handlers={404: admin.not_found, 405: admin.not_found},
    )


class FrontDoor:
    """``agentkv serve`` from Python: OpenAI's chat-completions and Responses APIs over a `SessionPool`.

    ``agentkv serve`` runs one in the foreground; in your own process (a test, a notebook, an
    app that also uses the pool directly) start it in a thread::

        with SessionPool() as pool, FrontDoor(pool, port=8000) as door:
            client = openai.OpenAI(base_url=door.url + "/v1", api_key="none")

    Args:
        pool: the open pool every request goes to (the door never closes it).
        model_name: the model id clients name and ``GET /v1/models`` lists (default: the model folder's name,
            or the Hugging Face id, ``org/name``, of a model from the HF cache); several names, as ``vllm serve
            --served-model-name`` takes them: a request may name any, the replies name the first, another name
            is vLLM's 404.
        api_key: when set, ``/v1`` and ``/metrics`` need ``Authorization: Bearer <key>`` (401 without it): one key
            or several, each a tenant of its own (named ``key-<digest>``; docs/serve.md, "Serving many users").
        api_keys: keys with the tenant each names (key -> tenant; a tenant may have several keys), besides
            ``api_key``'s.
        tenant_header: a header a trusted gateway names each request's tenant in (under its key's tenant);
            None (the default): not read.
        max_request_bytes: the largest request body (413 above it).
        max_header_bytes: the most bytes of request headers (431 above it; uvicorn's parser cuts off a head
            past twice it with a plain 400).
        max_messages: the most messages (Responses: input items) in one request (400 above it).
        max_in_flight: the most steps running at once (429 with ``Retry-After`` above it, at once: never queued).
            Default: the pool's ``max_sessions`` (a running step holds a session: more would grow the pool past it).
        tenant_max_in_flight: the most steps of one tenant running at once (429 above it; None: no bound of its own).
        timeout_s: the most one request may take (504 after it; the step is cancelled and nothing is kept).
        write_timeout_s: the most one write of a stream waits for a client that does not read; past it the
            connection is dropped and the step's place given back (None: as long as it takes).
        keep_responses: whether ``POST /v1/responses`` keeps responses for ``previous_response_id`` and ``GET``
            (False: ``store`` is taken as false, as vLLM does without its store).
        host: the address to listen on (default ``127.0.0.1``: this host only).
        port: the port to listen on.
        store: where ``POST /v1/responses`` keeps responses for ``previous_response_id`` (default: a
            `MemoryResponseStore`; a `SqliteResponseStore` survives restarts). The caller closes a store it passes.
    """

    def __init__(
        self,
        pool: SessionPool,
        *,
        model_name: str | Sequence[str] | None = None,
        api_key: str | Sequence[str] | None = None,
        api_keys: Mapping[str, str] | None = None,
        tenant_header: str | None = None,
        max_request_bytes: int = 4 * 1024 * 1024,
        max_header_bytes: int = 16 * 1024,
        max_messages: int = 2048,
        max_in_flight: int | None = None,
        tenant_max_in_flight: int | None = None,
        timeout_s: float = 300.0,
        write_timeout_s: float | None = 30.0,
        keep_responses: bool = True,
        host: str = "127.0.0.1",
        port: int = 8000,
        store: ResponseStore | None = None,
    ) -> None:
        if not pool.is_open:
            raise UserError("open the pool first: FrontDoor(pool) serves an open SessionPool")
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        names = (model_name,) if isinstance(model_name, str) else tuple(model_name or ())
        if not all(names) or len(set(names)) != len(names):
            raise UserError(f"model_name takes distinct non-empty names, not {model_name!r}")
        settings = ServeSettings(
            model_name=names[0] if names else served_name(pool.engine.info.model_path),
            served_names=names,
            tenants=Tenants.of(keys, named=api_keys, header=tenant_header),
            max_request_bytes=max_request_bytes,
            max_header_bytes=max_header_bytes,
            max_messages=max_messages,
            max_in_flight=pool.max_sessions if max_in_flight is None else max_in_flight,
            tenant_max_in_flight=tenant_max_in_flight,
            timeout_s=timeout_s,
            write_timeout_s=write_timeout_s,
            keep_responses=keep_responses,
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
        quiet = logging.getLogger("uvicorn.error")
        if not any(isinstance(found, QuietDrops) for found in quiet.filters):
            quiet.addFilter(QuietDrops())
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

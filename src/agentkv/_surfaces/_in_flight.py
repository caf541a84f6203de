"""The front door's steps in flight, each ended early when its client goes away or the door stops.

A step runs on the engines for seconds to minutes. Two things end it before its answer:

* **its client goes away.** A streamed response notices: the HTTP server cancels the stream when the
  connection drops. A plain (non-streamed) request does not: nothing reads the connection while the step
  runs, so a vanished client's step used to run to its end, holding its conversation (a retry got 409)
  and the engines' cores. `InFlight.call` watches the connection beside the step and cancels the step when
  it drops (`ClientGoneError`).
* **the door stops** (`FrontDoor.stop`, ``agentkv serve`` on SIGINT or SIGTERM). Every step in flight is
  cancelled at once (`InFlight.stop`), and new ones are refused: a plain request gets a 503, a stream ends
  with an error event its client can read (`ServerStoppingError`), not a cut connection.

A cancelled step changes nothing in its conversation, and the pool waits for it to unwind (its requests
aborted on both engines) before the door answers: the conversation's next request finds it idle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

import anyio
from starlette.requests import Request

from .._errors import AgentKVError

__all__ = ["ClientGoneError", "InFlight", "ServerStoppingError"]

T = TypeVar("T")


class ServerStoppingError(AgentKVError):
    """The door is stopping: the step was cancelled, or not started (a 503); nothing of it was kept."""

    openai_code = "server_stopping"

    def __init__(self) -> None:
        super().__init__(
            "the server is stopping: this step was cancelled and nothing of it was kept; "
            "send the request again once the server is back"
        )


class ClientGoneError(AgentKVError):
    """The client closed its connection before its answer: the step was cancelled (nothing of it kept)."""

    openai_code = "client_closed_request"

    def __init__(self) -> None:
        super().__init__("the client closed the connection; the step was cancelled and nothing of it was kept")


class InFlight:
    """The door's steps in flight, on the HTTP server's event loop: each in a cancel scope that `stop` cancels."""

    def __init__(self) -> None:
        self.stopping = False
        """Set by `stop`: steps in flight are cancelled, new ones refused."""
        self._scopes: set[anyio.CancelScope] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def call(self, request: Request, step: Callable[[], Awaitable[T]]) -> T:
        """``await step()``, cancelled when ``request``'s client disconnects (`ClientGoneError`) or the door stops
        (`ServerStoppingError`). Call it once the request's body was read: the connection's next message is then
        its end (ASGI's ``http.disconnect``)."""
        self._refuse_when_stopping()
        done: list[T] = []
        failed: list[Exception] = []
        gone = False
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                nonlocal gone
                while (await request.receive())["type"] != "http.disconnect":
                    pass  # the rest of a body nobody reads
                gone = True
                group.cancel_scope.cancel()

            group.start_soon(watch)
            with self._cancelled_on_stop(group.cancel_scope):
                try:
                    done.append(await step())
                except Exception as exc:  # raised as it is, not in the task group's ExceptionGroup
                    failed.append(exc)
                finally:
                    group.cancel_scope.cancel()  # the watch ends with the step
        if failed:
            raise failed[0]
        if done:
            return done[0]
        raise ClientGoneError() if gone else ServerStoppingError()

    async def next(self, items: AsyncIterator[T]) -> T:
        """The next item of a streamed step; `ServerStoppingError` when the door stops first. (A stream's client
        going away is the HTTP server's to see: it cancels the response.)"""
        self._refuse_when_stopping()
        with anyio.CancelScope() as scope, self._cancelled_on_stop(scope):
            return await anext(items)
        raise ServerStoppingError()

    def stop(self) -> None:
        """Cancel every step in flight and refuse new ones (from any thread)."""
        self.stopping = True
        loop = self._loop
        if loop is None:
            return

        def cancel_all() -> None:
            for scope in list(self._scopes):
                scope.cancel()

        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing is in flight
            loop.call_soon_threadsafe(cancel_all)

    def _refuse_when_stopping(self) -> None:
        if self.stopping:
            raise ServerStoppingError()

    @contextlib.contextmanager
    def _cancelled_on_stop(self, scope: anyio.CancelScope) -> Iterator[None]:
        self._loop = asyncio.get_running_loop()
        self._scopes.add(scope)
        try:
            yield
        finally:
            self._scopes.discard(scope)

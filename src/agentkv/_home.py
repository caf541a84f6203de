"""The event loop that engines and sessions live on.

vLLM's ``AsyncLLM`` binds to the asyncio loop it first runs on. Opened with ``async with``,
an engine lives on the caller's loop. Opened with plain ``with`` (scripts, notebooks), it
gets a loop of its own in a portal thread, so blocking calls work even where the calling
thread already runs a loop (Jupyter). Ctrl-C during a blocking call cancels the task on the
portal and waits for it to unwind before re-raising, so nothing keeps running behind the user.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio.from_thread
from anyio.from_thread import BlockingPortal

from ._errors import UserError

__all__ = ["LoopHome"]

T = TypeVar("T")

_CANCEL_GRACE_S = 60.0


class LoopHome:
    """An asyncio loop, and the portal thread that runs it when it is agentkv's own."""

    def __init__(self, loop: asyncio.AbstractEventLoop, portal: BlockingPortal | None = None,
                 portal_cm: contextlib.AbstractContextManager[BlockingPortal] | None = None) -> None:
        self.loop = loop
        self._portal = portal
        self._portal_cm = portal_cm

    @classmethod
    def current(cls) -> LoopHome:
        """The running loop of the calling task."""
        return cls(asyncio.get_running_loop())

    @classmethod
    def start_thread(cls) -> LoopHome:
        """A new loop in a daemon portal thread."""
        portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        portal = portal_cm.__enter__()
        loop = portal.call(_running_loop)
        return cls(loop, portal, portal_cm)

    @property
    def owns_thread(self) -> bool:
        """Whether this home runs its own portal thread."""
        return self._portal is not None

    def is_current(self) -> bool:
        """Whether the caller runs on this loop."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on this loop and block until it is done (from any other thread)."""
        if self._portal is None:
            raise UserError(
                "this object was opened with `async with` and lives on that event loop: "
                "use `await` on it instead of the blocking call"
            )
        if self.is_current():
            raise UserError("a blocking agentkv call was made from inside agentkv's own event loop")
        future: concurrent.futures.Future[T] = self._portal.start_task_soon(fn, *args)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            with contextlib.suppress(BaseException):
                future.result(timeout=_CANCEL_GRACE_S)
            raise

    async def call_async(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await ``fn(*args)`` on this loop from a task on another loop."""
        if self.is_current():
            return await fn(*args)
        if self._portal is None:
            raise UserError("this object lives on another event loop; call it from that loop")
        portal = self._portal
        future: concurrent.futures.Future[T] = portal.start_task_soon(fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise

    def stop(self) -> None:
        """Stop the portal thread (no-op for a borrowed loop)."""
        if self._portal_cm is not None:
            cm, self._portal_cm, self._portal = self._portal_cm, None, None
            cm.__exit__(None, None, None)


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()

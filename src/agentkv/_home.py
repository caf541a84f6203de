"""The event loop that engines and sessions live on.

vLLM's ``AsyncLLM`` binds to the asyncio loop it first runs on. Opened with ``async with``,
an engine lives on the caller's loop (other threads reach it while that loop runs; the loop's own thread awaits). Opened with plain ``with`` (scripts, notebooks), it
gets a loop of its own in a portal thread, so blocking calls work even where the calling
thread already runs a loop (Jupyter). Ctrl-C during a blocking call cancels the task on the
portal and waits for it to unwind before re-raising, so nothing keeps running behind the user.
An async generator that runs on a home is read from synchronous code through it as well (`EventLoopHome.iterate`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ._errors import SessionClosedError, UserError

__all__ = ["Background", "EventLoopHome", "start_background"]

T = TypeVar("T")

_CANCEL_GRACE_S = 60.0


class EventLoopHome:
    """The asyncio event loop an engine or a session lives on, and the thread that runs it when it is agentkv's own.

    ``EventLoopHome.current()`` is the caller's running loop (``async with``);
    ``EventLoopHome.start_thread()`` starts a loop in a thread of its own (``with``, ``start()``).
    Pass one to ``open(home=...)`` to open an engine or a session on it; read it back from ``.home``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        portal: BlockingPortal | None = None,
        thread: threading.Thread | None = None,
    ) -> None:
        self.loop = loop
        self._portal = portal
        self._thread = thread
        self._spawned: set[asyncio.Task[Any]] = set()

    @classmethod
    def current(cls) -> EventLoopHome:
        """The running loop of the calling task."""
        return cls(asyncio.get_running_loop())

    @classmethod
    def start_thread(cls) -> EventLoopHome:
        """A new loop in a daemon thread, reached through a blocking portal.

        A daemon thread, unlike anyio's ``start_blocking_portal``: Python joins non-daemon
        threads before ``atexit`` handlers run, so a loop nobody stopped would hang the
        interpreter's exit instead of letting agentkv's exit handler stop the engines.
        """
        ready = threading.Event()
        found: dict[str, Any] = {}

        async def serve() -> None:
            async with BlockingPortal() as portal:
                found["portal"], found["loop"] = portal, asyncio.get_running_loop()
                ready.set()
                await portal.sleep_until_stopped()

        thread = threading.Thread(target=anyio.run, args=(serve,), name="agentkv-loop", daemon=True)
        thread.start()
        ready.wait()
        return cls(found["loop"], found["portal"], thread)

    @property
    def owns_thread(self) -> bool:
        """Whether this home runs its own loop thread."""
        return self._thread is not None

    def is_current(self) -> bool:
        """Whether the caller runs on this loop."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Start ``fn(*args)`` on this loop from any thread; its future (cancelling it cancels the task).

        Through the portal of a loop thread of agentkv's own, else (a loop borrowed from ``async with``) through
        asyncio's ``run_coroutine_threadsafe``, while that loop runs."""
        if self._portal is not None:
            return self._portal.start_task_soon(_awaited, fn, *args)
        if self.loop.is_closed() or not self.loop.is_running():
            raise SessionClosedError(
                "the event loop this object was opened on (with `async with`) has ended; open a new one"
            )
        return asyncio.run_coroutine_threadsafe(_awaited(fn, *args), self.loop)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on this loop and block until it is done (from any other thread)."""
        if self.is_current():
            if self._portal is None:
                raise UserError(
                    "this object was opened with `async with` and lives on this event loop: "
                    "use `await` on it instead of the blocking call (which would block the loop it runs on)"
                )
            raise UserError("a blocking agentkv call was made from inside agentkv's own event loop")
        finished = threading.Event()

        async def call_and_signal() -> T:
            try:
                return await fn(*args)
            finally:
                finished.set()

        future = self.submit(call_and_signal)
        try:
            # short waits, so an interrupt is seen however it is delivered; waited on, not `result(timeout=...)`: its
            # TimeoutError is the builtin one, which a call that raised TimeoutError itself must not be taken for
            while not concurrent.futures.wait([future], timeout=0.25).done:
                pass
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            finished.wait(timeout=_CANCEL_GRACE_S)  # the task has unwound (turn rolled back)
            raise

    def call_or_stop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`call`, and stop this home's thread if the call fails (an open that did not happen)."""
        try:
            return self.call(fn, *args)
        except BaseException:
            self.stop()
            raise

    async def call_async(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await ``fn(*args)`` on this loop from a task on another loop.

        Cancelled, it cancels ``fn`` and waits for it to unwind before it re-raises, as `call` does: a
        cancelled step has rolled back (and its engine requests are aborted) when the caller goes on.
        """
        if self.is_current():
            return await fn(*args)
        caller = asyncio.get_running_loop()
        unwound = asyncio.Event()

        async def call_and_signal() -> T:
            try:
                return await fn(*args)
            finally:
                with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
                    caller.call_soon_threadsafe(unwound.set)

        future = self.submit(call_and_signal)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCEL_GRACE_S):
                await unwound.wait()
            raise

    def iterate(self, items: AsyncGenerator[T, None]) -> Iterator[T]:
        """Read ``items``, an async generator that runs on this loop, from synchronous code in another thread:
        each item is fetched with `call` (Ctrl-C cancels the fetch, which unwinds first), and ``items`` is closed
        on this loop when the reading stops early."""
        while True:
            try:
                item = self.call(items.__anext__)
            except StopAsyncIteration:
                return
            try:
                yield item
            except BaseException:
                if not self.is_current():  # else finalized on this loop, whose own finalizer closes ``items``
                    self.call(items.aclose)
                raise

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start ``fn(*args)`` on this loop and return at once, from any thread (fire and forget).

        For best-effort background work (releasing a pin): ``fn`` handles its own errors. Does
        nothing once the loop is closed.
        """

        def create() -> None:
            task = self.loop.create_task(_awaited(fn, *args))
            self._spawned.add(task)
            task.add_done_callback(self._spawned.discard)

        if self.is_current():
            create()
        elif not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                self.loop.call_soon_threadsafe(create)

    def stop(self) -> None:
        """Stop the loop thread (no-op for a borrowed loop)."""
        if self._portal is not None and self._thread is not None:
            portal, thread, self._portal, self._thread = self._portal, self._thread, None, None
            portal.call(portal.stop)
            thread.join(timeout=_CANCEL_GRACE_S)


def start_background(home: EventLoopHome, fn: Callable[..., Awaitable[Any]], *args: Any) -> Background:
    """Start ``fn(*args)`` on ``home``'s loop, from a task on it, as work that outlives the call that started it (a
    dead engine's replacement, a reaper): `Background.stop` cancels it and waits for its end, from any task."""
    work = Background()
    home.spawn(work.run, fn, *args)
    return work


class Background:
    """Work started by `start_background`: its cancel scope, and an event set when it has ended."""

    def __init__(self) -> None:
        self._scope = anyio.CancelScope()
        self._ended = anyio.Event()

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        try:
            with self._scope:
                await fn(*args)
        finally:
            self._ended.set()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    async def stop(self) -> None:
        """Cancel the work and wait until it has unwound."""
        self._scope.cancel()
        await self._ended.wait()


async def _awaited(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    return await fn(*args)

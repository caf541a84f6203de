"""What every framework adapter shares: the pool its model calls go to, and who closes it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from .._conversation._conversation import Message
from .._engines import Engine
from .._errors import UserError
from .._session._pool import SessionPool
from .._session._results import StepReply
from .._stats._stats import StepStats

__all__ = ["PooledModel"]


class PooledModel:
    """The engine side of an adapter: a `SessionPool`, started at the first model call.

    Args:
        engine: an agentkv engine (`EmbeddedPair`, `LaunchedPair`, `RemotePair`, `Colocated`),
            open or not. The adapter never closes an engine it was given open; one it was given
            unopened, or the embedded pair it starts when given none, it closes in `close`.
        pool: a `SessionPool` to share between adapters (its owner closes it); not with ``engine``.
        session_options: keyword arguments of each `Session` (``max_tokens``, ``temperature``, ...).
    """

    def __init__(self, *, engine: Engine | None = None, pool: SessionPool | None = None, **session_options: Any):
        if pool is not None and (engine is not None or session_options):
            raise UserError("pool= comes with its engine and session options; give either pool= or those")
        self._pool = pool
        self._owns_pool = pool is None
        self._pool_arguments: dict[str, Any] = {"engine": engine, **session_options}
        if self._owns_pool:
            SessionPool(**self._pool_arguments)  # check the options now, not at the first call
        self._lock = threading.Lock()
        self.last_reply: StepReply | None = None
        """The last model call's reply (its `StepReply.stats` say where each prompt token's KV came from)."""

    @property
    def pool(self) -> SessionPool:
        """The pool the model calls go to (started on first use)."""
        with self._lock:
            if self._pool is None:
                pool = SessionPool(**self._pool_arguments)
                pool.__enter__()  # on an event loop thread of its own: frameworks run (and end) their own loops
                self._pool = pool
            return self._pool

    @property
    def stats(self) -> list[StepStats]:
        """Every model call's stats, over the pool's live sessions."""
        return [step for session in self.pool.sessions for turn in session.stats.turns for step in turn.steps]

    async def call(
        self, messages: Sequence[Message | Mapping[str, Any]], *, conversation_id: str | None = None, **options: Any
    ) -> StepReply:
        """One model call on the conversation's session (see `SessionPool.step`)."""
        reply = await self.pool.step(messages, conversation_id=conversation_id, **options)
        self.last_reply = reply
        return reply

    async def stream(
        self, messages: Sequence[Message | Mapping[str, Any]], *, conversation_id: str | None = None, **options: Any
    ) -> AsyncIterator[str | StepReply]:
        """`call`, as the answer's text pieces while they are generated, then the `StepReply`.

        Works from any asyncio loop (the pool runs on its own). Stopping early cancels the step,
        which then changes nothing in the session.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | StepReply | BaseException] = asyncio.Queue()

        def on_text(text: str) -> None:  # called on the pool's loop thread
            loop.call_soon_threadsafe(queue.put_nowait, text)

        async def run() -> None:
            try:
                queue.put_nowait(await self.call(messages, conversation_id=conversation_id, on_text=on_text, **options))
            except BaseException as exc:  # handed to the consumer, who raises it
                queue.put_nowait(exc)

        task = asyncio.ensure_future(run())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, StepReply):
                    return
        finally:
            task.cancel()

    def call_sync(
        self, messages: Sequence[Message | Mapping[str, Any]], *, conversation_id: str | None = None, **options: Any
    ) -> StepReply:
        """Blocking `call`."""
        reply = self.pool.step_sync(messages, conversation_id=conversation_id, **options)
        self.last_reply = reply
        return reply

    def close(self) -> None:
        """Close the pool if this adapter started it (and with it an engine it started)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._owns_pool:
            pool.close()

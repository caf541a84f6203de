"""What every framework adapter shares: the pool its model calls go to, and who closes it."""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from .._conversation._conversation import Message
from .._engines import Engine
from .._engines._sampling import SamplingOptions
from .._errors import SessionClosedError, UserError
from .._session._pool import SessionPool
from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from .._stats._stats import StepStats

__all__ = ["SAMPLING_NAMES", "PooledAccess", "PooledModel", "joined_text", "sampling_of"]

SAMPLING_NAMES = frozenset(SamplingOptions.model_fields)
"""The settings adapters pass on under vLLM's names (`SamplingOptions`' fields)."""


def sampling_of(values: Mapping[str, Any]) -> dict[str, Any]:
    """The `SamplingOptions` fields among a framework's settings that are set (not None), for ``sampling=``; the
    pool checks them (a bad value is a `UserError` naming ``sampling.<field>``)."""
    return {name: value for name, value in values.items() if name in SAMPLING_NAMES and value is not None}


def joined_text(content: str | Sequence[Any], text_of: Callable[[Any], str | None], *, sep: str = "") -> str:
    """A framework message's content as one text: a str as it is; in a list of parts, each str part and what
    ``text_of`` gives for the others, joined by ``sep`` (``text_of`` gives None for a part to skip and raises the
    framework's error for one agentkv cannot take)."""
    if isinstance(content, str):
        return content
    pieces = (part if isinstance(part, str) else text_of(part) for part in content)
    return sep.join(piece for piece in pieces if piece is not None)


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
        self._owns_pool = pool is None
        self._arguments: dict[str, Any] = {"engine": engine, **session_options}
        self._pool: SessionPool | None = pool if pool is not None else SessionPool(**self._arguments)
        """The pool; one the adapter makes (its options checked now, by `SessionPool`) opens at the first call."""
        self._started = not self._owns_pool
        self._lock = threading.Lock()
        self._closed = False
        self.last_reply: StepReply | None = None
        """The last model call's reply (its `StepReply.stats` say where each prompt token's KV came from)."""

    @property
    def pool(self) -> SessionPool:
        """The pool the model calls go to (started on first use)."""
        with self._lock:
            if self._closed or self._pool is None:
                raise SessionClosedError("this model was closed; make a new one")
            if not self._started:
                try:  # on an event loop thread of its own: frameworks run (and end) their own loops
                    self._pool.__enter__()
                except BaseException:
                    self._pool = SessionPool(**self._arguments)  # an open that failed closed it: the next call retries
                    raise
                self._started = True
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
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        conversation_id: str | None = None,
        deltas: bool = False,
        **options: Any,
    ) -> AsyncGenerator[str | ToolCallDelta | ReasoningDelta | StepReply]:
        """`call`, as the answer's text pieces while they are generated, then the `StepReply`
        (see `SessionPool.stream`; ``deltas``: tool-call and reasoning pieces too); closing it early cancels the step."""
        stream = self.pool.stream(messages, conversation_id=conversation_id, deltas=deltas, **options)  # type: ignore[call-overload]
        async with aclosing(stream) as items:
            async for item in items:
                if isinstance(item, StepReply):
                    self.last_reply = item
                yield item

    def call_sync(
        self, messages: Sequence[Message | Mapping[str, Any]], *, conversation_id: str | None = None, **options: Any
    ) -> StepReply:
        """Blocking `call`."""
        reply = self.pool.step_sync(messages, conversation_id=conversation_id, **options)
        self.last_reply = reply
        return reply

    async def aclose(self) -> None:
        """`close`, from async code (the pool closes on its own loop; this loop keeps running)."""
        await anyio.to_thread.run_sync(self.close)

    def close(self) -> None:
        """Close the pool if this adapter started it (and with it an engine it started); later calls raise
        `SessionClosedError`."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
            started, self._started = self._started, False
        if pool is not None and self._owns_pool and started:
            pool.close()


class PooledAccess:
    """What every adapter shows of agentkv: its pool, every call's stats and the last reply
    (mixed into the framework's model class, over the adapter's `PooledModel`)."""

    if TYPE_CHECKING:
        _pooled: PooledModel

    @property
    def pool(self) -> SessionPool:
        """The `SessionPool` the model calls go to (started at the first call)."""
        return self._pooled.pool

    @property
    def stats(self) -> list[StepStats]:
        """Every model call's stats, over the pool's live sessions."""
        return self._pooled.stats

    @property
    def last_reply(self) -> StepReply | None:
        """The last model call's `agentkv.StepReply` (its ``stats`` say where each prompt token's KV came from)."""
        return self._pooled.last_reply

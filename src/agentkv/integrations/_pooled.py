"""What every framework adapter shares: the pool its model calls go to, and who closes it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from .._conversation._conversation import Message
from .._engines import Engine, EngineState
from .._engines._pair_config import PairConfig
from .._engines._sampling import SamplingOptions
from .._errors import EngineUnavailableError, SessionClosedError, UserError
from .._model import model_name
from .._session._pool import SessionPool
from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from .._session._session_config import SESSION_OPTIONS, SessionConfig
from .._stats._stats import StepStats

__all__ = ["POOL_OPTIONS", "SAMPLING_NAMES", "CallLimits", "PooledAccess", "PooledModel", "joined_text", "sampling_of"]

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


DEFAULT_PIN_TTL_S = PairConfig().pin_ttl_s
RENEWS_BY_DEFAULT = bool(SessionConfig.model_fields["renew_pins"].default)
RENEWS_FOR_S = float(SessionConfig.model_fields["renew_pins_for_s"].default)

POOL_OPTIONS = frozenset({"max_sessions", "idle_ttl_s", "store"})
"""`SessionPool`'s own keyword arguments besides ``engine`` (an adapter passes them on with the session options)."""


@dataclass(frozen=True)
class CallLimits:
    """A framework's standard limits of one model call: ``timeout_s`` (the call is cancelled past it, changing
    nothing in its session, and raises `TimeoutError`) and ``max_retries`` (a call that failed because a server of a
    launched or remote pair could not be reached, `EngineUnavailableError`, which changed nothing, is made again,
    with exponential back-off). In-process engines fail in no way a retry mends: nothing else is retried."""

    timeout_s: float | None = None
    max_retries: int = 0

    def attempts(self) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            retry=retry_if_exception_type(EngineUnavailableError),
            wait=wait_exponential(multiplier=0.5, max=8.0),
            reraise=True,
        )

    @contextlib.contextmanager
    def deadline(self) -> Iterator[None]:
        if self.timeout_s is None:
            yield
            return
        try:
            with anyio.fail_after(self.timeout_s):
                yield
        except TimeoutError:
            raise TimeoutError(
                f"the model call took longer than its timeout ({self.timeout_s} s) and was cancelled"
            ) from None


class PooledModel:
    """The engine side of an adapter: a `SessionPool`, started at the first model call.

    Args:
        engine: an agentkv engine (`EmbeddedPair`, `LaunchedPair`, `RemotePair`, `Colocated`),
            open or not, opened any way (``with``, ``async with``, ``.start()``). The adapter never closes an
            engine it was given open; one it was given unopened, or the embedded pair it starts when given none,
            it closes in `close`.
        pool: a `SessionPool` to share between adapters (its owner closes it); not with ``engine``.
        session_options: keyword arguments of each `Session` (``max_tokens``, ``temperature``, ...).

    The pool opens on the loop of an engine given open (the caller's loop, for one opened with ``async with``;
    a blocking call from that loop's own thread is refused, an ``await`` works), else on a loop thread of its own
    that it starts the engine on (frameworks run their own loops, and end them: ``run_sync``).
    """

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        pool: SessionPool | None = None,
        owner: str = "SessionPool",
        **session_options: Any,
    ):
        unknown = sorted(set(session_options) - SESSION_OPTIONS - POOL_OPTIONS)
        if unknown:  # named as the adapter's own call (its user never called SessionPool)
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
        if pool is not None and (engine is not None or session_options):
            raise UserError("pool= comes with its engine and session options; give either pool= or those")
        self._owns_pool = pool is None
        self._engine = engine
        self._arguments: dict[str, Any] = {"engine": engine, **session_options}
        self._pool: SessionPool | None = pool if pool is not None else SessionPool(**self._arguments)
        """The pool; one the adapter makes (its options checked now, by `SessionPool`) opens at the first call."""
        self._started = not self._owns_pool
        self._opening: concurrent.futures.Future[None] | None = None
        """The pool's open on an open engine's loop, while it runs (the calls that come meanwhile wait for it)."""
        self._running: set[str] = set()
        """Named conversations with a call of this model running (`claimed`)."""
        self._lock = threading.RLock()
        """Reentrant: an open that finished at once runs its done-callback (`_opened`) in the thread that holds it."""
        self._closed = False
        self.last_reply: StepReply | None = None
        """The last model call's reply (its `StepReply.stats` say where each prompt token's KV came from)."""

    def _usable(self) -> SessionPool:
        """The pool, opened or not (under ``_lock``); `SessionClosedError` once the adapter is closed."""
        if self._closed or self._pool is None:
            raise SessionClosedError("this model was closed; make a new one")
        return self._pool

    def _open_on_engine(self, pool: SessionPool) -> concurrent.futures.Future[None] | None:
        """Under ``_lock``: the pool's open on the loop of the open engine it was given (started once), or None when
        the pool opens its own engine on a loop thread of its own."""
        engine = self._engine
        if engine is None or engine.state is not EngineState.OPEN or engine.home is None:
            return None
        opening = self._opening
        if opening is None:
            home = engine.home
            opening = self._opening = home.submit(functools.partial(pool.open, home=home))
            opening.add_done_callback(self._opened)  # may run now, here (an open that finished at once)
        return opening

    def _opened(self, opening: concurrent.futures.Future[None]) -> None:
        with self._lock:
            if self._opening is not opening:
                return
            self._opening = None
            if not opening.cancelled() and opening.exception() is None:
                self._started = True
            elif not self._closed:  # an open that failed closed the pool: the next call retries with a new one
                self._pool = SessionPool(**self._arguments)

    def _state(self) -> tuple[SessionPool, bool, concurrent.futures.Future[None] | None]:
        """The pool, whether it is open, and its open on an open engine's loop (started now if need be; None when
        the pool opens an engine of its own)."""
        with self._lock:
            pool = self._usable()
            if self._started:
                return pool, True, None
            return pool, False, self._open_on_engine(pool)

    def _open_own_engine(self) -> SessionPool:
        """Open the pool, and the engine it starts, on an event loop thread of its own: frameworks run (and end)
        their own loops."""
        with self._lock:
            pool = self._usable()
            if not self._started:
                try:
                    pool.__enter__()
                except BaseException:
                    self._pool = SessionPool(**self._arguments)  # an open that failed closed it: the next call retries
                    raise
                self._started = True
            return pool

    @property
    def pool(self) -> SessionPool:
        """The pool the model calls go to (started on first use; a blocking call: from async code, `opened_pool`)."""
        pool, started, opening = self._state()
        if started:
            return pool
        if opening is None:
            return self._open_own_engine()
        engine_home = self._engine.home if self._engine is not None else None
        if engine_home is not None and engine_home.is_current():
            raise UserError(
                "this model's engine was opened with `async with` on this thread's event loop: call the model "
                "with `await` (its async methods) here"
            )
        opening.result()
        return pool

    async def opened_pool(self) -> SessionPool:
        """`pool`, from async code: on an open engine's loop (the caller's, for one opened with ``async with``)
        without blocking it; else opened in a worker thread (it starts its engine on a loop thread of its own)."""
        pool, started, opening = self._state()
        if started:
            return pool
        if opening is None:
            return await anyio.to_thread.run_sync(self._open_own_engine)
        await asyncio.wrap_future(opening)
        return pool

    @contextlib.contextmanager
    def claimed(self, conversation_id: str | None) -> Iterator[str | None]:
        """``conversation_id`` for a call, while no other call of this model runs on it; else None, and the call is
        matched by its messages instead (a framework's parallel branches of one thread, two runs of one group)."""
        with self._lock:
            if conversation_id is not None and conversation_id in self._running:
                conversation_id = None
            elif conversation_id is not None:
                self._running.add(conversation_id)
        try:
            yield conversation_id
        finally:
            if conversation_id is not None:
                with self._lock:
                    self._running.discard(conversation_id)

    def cache_retention_s(self) -> float:
        """How long a conversation's KV is expected to stay on D after its last call: the pin's TTL (the engine's
        ``pin_ttl_s``; a pair's default, 480 s, until the engine is open and says), after the renewals that keep it
        while the session is idle (``renew_pins``, for ``renew_pins_for_s``; on by default)."""
        engine = self._engine
        ttl = DEFAULT_PIN_TTL_S
        if engine is not None and engine.state is EngineState.OPEN:
            ttl = float(engine.info.details.get("pin_ttl_s", ttl))
        if not self._arguments.get("renew_pins", RENEWS_BY_DEFAULT):
            return ttl
        return ttl + float(self._arguments.get("renew_pins_for_s", RENEWS_FOR_S))

    def model_name(self) -> str | None:
        """The name of the model the pool serves (its engine's model folder), once its engine is open; else None."""
        with self._lock:
            pool = self._pool
            started = self._started
        engine = self._engine if self._engine is not None else (pool.engine if pool is not None and started else None)
        if engine is None or engine.state is not EngineState.OPEN:
            return None
        return model_name(engine.info.model_path)

    @property
    def stats(self) -> list[StepStats]:
        """Every model call's stats, over the pool's live sessions."""
        with self._lock:
            pool = self._usable()
        return [step for session in pool.sessions for turn in session.stats.turns for step in turn.steps]

    async def call(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        conversation_id: str | None = None,
        limits: CallLimits | None = None,
        **options: Any,
    ) -> StepReply:
        """One model call on the conversation's session (see `SessionPool.step`), within ``limits``."""
        limits = limits or CallLimits()
        pool = await self.opened_pool()
        async for attempt in limits.attempts():
            with attempt:
                with limits.deadline():
                    reply = await pool.step(messages, conversation_id=conversation_id, **options)
        self.last_reply = reply
        return reply

    async def stream(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        conversation_id: str | None = None,
        deltas: bool = False,
        limits: CallLimits | None = None,
        **options: Any,
    ) -> AsyncGenerator[str | ToolCallDelta | ReasoningDelta | StepReply]:
        """`call`, as the answer's text pieces while they are generated, then the `StepReply`
        (see `SessionPool.stream`; ``deltas``: tool-call and reasoning pieces too); closing it early cancels the step.
        ``limits``: the timeout bounds the wait for each piece; a retry happens only before the first."""
        limits = limits or CallLimits()
        pool = await self.opened_pool()
        first: Any = None
        stream: AsyncGenerator[Any] | None = None
        async for attempt in limits.attempts():
            with attempt:
                stream = pool.stream(messages, conversation_id=conversation_id, deltas=deltas, **options)  # type: ignore[call-overload]
                try:
                    with limits.deadline():
                        first = await anext(stream)
                except BaseException:
                    await stream.aclose()
                    raise
        assert stream is not None
        async with aclosing(stream) as items:
            item = first
            while True:
                if isinstance(item, StepReply):
                    self.last_reply = item
                yield item
                if isinstance(item, StepReply):
                    return
                with limits.deadline():
                    item = await anext(items)

    def call_sync(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        conversation_id: str | None = None,
        limits: CallLimits | None = None,
        **options: Any,
    ) -> StepReply:
        """Blocking `call` (on the pool's loop)."""
        pool = self.pool
        assert pool.home is not None  # set when the pool opened
        call = functools.partial(self.call, messages, conversation_id=conversation_id, limits=limits, **options)
        return pool.home.call(call)

    async def aclose(self) -> None:
        """`close`, from async code: on the pool's loop when that is the caller's (an engine opened with ``async
        with``), else in a worker thread (the pool closes on its own loop; this loop keeps running)."""
        with self._lock:
            pool = self._pool
            home = pool.home if pool is not None and self._started else None
        if home is not None and home.is_current():
            with self._lock:
                pool, self._pool, self._closed, self._started = self._pool, None, True, False
            if pool is not None and self._owns_pool:
                await pool.aclose()
            return
        await anyio.to_thread.run_sync(self.close)

    def close(self) -> None:
        """Close the pool if this adapter started it (and with it an engine it started); later calls raise
        `SessionClosedError`. A pool on a loop that has ended (an engine's ``async with`` left) has nothing left to
        close."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
            started, self._started = self._started, False
        if pool is not None and self._owns_pool and started:
            home = pool.home
            if home is not None and not home.owns_thread and (home.loop.is_closed() or not home.loop.is_running()):
                return
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

"""The turn API of `Session`: ``run``/``run_sync``/``stream``, the SDK's tool loop over a user message.

A turn works on a copy of the conversation (`SessionCore._claim`) and is kept only when it ended
well (and, with ``run(on_event=...)``, once the callback took the `TurnEnd`); its steps are
`agentkv._session._turn`'s (model step, tool round, finish).
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from .._conversation._conversation import Message
from .._errors import SessionBusyError, UserError
from ._results import Event, TurnEnd, TurnResult
from ._session_config import check_message
from ._session_core import SessionCore
from ._tracing import TurnSpan
from ._turn import Turn, turn_events

__all__ = ["TurnAPI"]


class TurnAPI(SessionCore):
    """``run``/``stream``: the session runs the tools and the model steps until the answer."""

    async def run(self, message: str, *, on_event: Callable[[Event], None] | None = None) -> TurnResult:
        """Send a user message; return the answer and every step's stats.

        If anything fails (bad input, an engine error, cancellation, ``on_event`` raising) the
        conversation and the stats are left as they were before the call.
        """
        home = self._require_home()
        if not home.is_current():
            return await home.call_async(self._run, message, on_event)
        return await self._run(message, on_event)

    def run_sync(self, message: str, *, on_event: Callable[[Event], None] | None = None) -> TurnResult:
        """Blocking `run`, for a session opened with ``with``. Ctrl-C cancels the turn cleanly."""
        return self._require_home().call(self._run, message, on_event)

    def stream(self, message: str) -> AsyncIterator[Event]:
        """`run`, as events: text deltas and step ends as they happen, then the turn end.

        The turn is kept once the `TurnEnd` was yielded. A consumer that stops before (``break``,
        an exception) abandons the turn: it is dropped, and the next turn or edit may start at
        once. ``async with contextlib.aclosing(s.stream(...))`` also stops the engine's step then.
        """
        consumer: list[weakref.ref[Any]] = []
        events = self._stream(message, consumer)
        consumer.append(weakref.ref(events))
        return events

    async def _run(self, message: str, on_event: Callable[[Event], None] | None) -> TurnResult:
        span = TurnSpan.start(self._trace, turn=len(self._turns) + 1, mode=self.mode)
        try:
            turn = await self._begin_turn(message, span=span)
            try:
                async with aclosing(turn_events(turn, self._step_context())) as events:
                    async for event in events:
                        if on_event is not None:
                            on_event(event)  # may raise, also at TurnEnd: then the turn is not kept
                assert turn.result is not None
                self._commit(turn)
            finally:
                self._end_turn(turn)
        except BaseException as exc:
            span.end(error=exc)
            raise
        span.end(turn.result)
        return turn.result

    async def _stream(self, message: str, consumer: list[weakref.ref[Any]]) -> AsyncGenerator[Event]:
        if not self._require_home().is_current():
            raise UserError("stream() runs on the session's own event loop; use run(on_event=...) here")
        span = TurnSpan.start(self._trace, turn=len(self._turns) + 1, mode=self.mode)
        try:
            turn = await self._begin_turn(message, consumer=consumer[0] if consumer else None, span=span)
            try:
                async with aclosing(turn_events(turn, self._step_context())) as events:
                    async for event in events:
                        if isinstance(event, TurnEnd):
                            self._commit(turn)
                            span.end(event.result)  # before the last yield: a consumer may stop at it
                        yield event
            finally:
                self._end_turn(turn)
        except BaseException as exc:
            span.end(error=exc)
            raise

    async def _begin_turn(self, message: str, *, span: TurnSpan, consumer: weakref.ref[Any] | None = None) -> Turn:
        """Prepare a turn: claim the session, copy the conversation, append the user message."""
        check_message(message)
        with self._lock:
            self._require_idle(
                "a turn is already running in this session; sessions take one turn at a time", SessionBusyError
            )
            self._take_new_tools()
            turn = self._claim(len(self._turns) + 1, consumer)
            turn.trace_context = span.context
        await self._prepare(turn, lambda turn: turn.conversation.add_messages([Message(role="user", content=message)]))
        return turn

    def _commit(self, turn: Turn) -> None:
        """Make a finished turn part of the session: its conversation, its pin, its stats."""
        with self._lock:
            if turn.result is None:
                raise UserError("this turn was abandoned and cannot be kept")
            self._take(turn)
            self._transcript = None
            self._turns.append(turn.result.stats)

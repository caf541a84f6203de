"""One lifecycle for sessions and engines: unopened -> open -> closed, on an event-loop home.

Modelled on httpx's ``ClientState`` and anyio's ``AsyncResource``: ``await x.open(home=...)`` /
``await x.aclose()`` or ``async with x``, and for synchronous code ``with x`` / ``x.start()`` /
``x.close()``, which run the async calls on an event loop of the object's own (a `EventLoopHome`
thread). An object opens once; using it before it opens or after it closes raises
`SessionClosedError`. Cleanup (a failed open's and ``aclose``'s) is shielded from
cancellation, so Ctrl-C or a timeout around ``async with`` still stops what was started.
"""

from __future__ import annotations

import enum
import functools
from types import TracebackType
from typing import Self

import anyio

from ._errors import SessionClosedError, UserError
from ._home import EventLoopHome
from ._notebook import replace_previous_from_this_cell

__all__ = ["Lifecycle", "LifecycleState"]


class LifecycleState(enum.Enum):
    """Where an engine or a session is in its life."""

    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class Lifecycle:
    """Open once, close once. Subclasses implement `_open_resources` and `_close_resources`."""

    def __init__(self) -> None:
        self._state = LifecycleState.UNOPENED
        self._opening = False
        self._home: EventLoopHome | None = None
        self._started_home = False
        """Whether this object started its home's loop thread (``with``/``start()``); then ``close`` stops it."""

    # ----------------------------------------------------------------- hooks

    async def _open_resources(self) -> None:
        """Acquire what the object needs; the state is still unopened. On failure `_close_resources` runs."""

    async def _when_open(self) -> None:
        """Runs once the state is open, still inside `open` (e.g. a warm-up that needs an open engine)."""

    async def _close_resources(self) -> None:
        """Release everything `_open_resources` acquired (also after a partial open); must not raise."""

    def _blocking_home(self) -> tuple[EventLoopHome, bool]:
        """The loop a blocking open (``with``) runs on, and whether it was started for this object."""
        return EventLoopHome.start_thread(), True

    # ----------------------------------------------------------------- state

    @property
    def state(self) -> LifecycleState:
        """Unopened, open or closed."""
        return self._state

    @property
    def is_open(self) -> bool:
        """Whether it is open (and not closed)."""
        return self._state is LifecycleState.OPEN

    @property
    def home(self) -> EventLoopHome | None:
        """The event loop it lives on (set by `open`)."""
        return self._home

    def _require_open(self) -> None:
        """Raise `SessionClosedError` unless open."""
        if self._state is not LifecycleState.OPEN:
            hint = "open it with `with` or `async with`" if self._state is LifecycleState.UNOPENED else "make a new one"
            raise SessionClosedError(f"the {type(self).__name__} is {self._state.value}, not open; {hint}")

    def _check_openable(self) -> None:
        if self._state is LifecycleState.CLOSED:
            raise SessionClosedError(f"the {type(self).__name__} was closed and cannot be opened again; make a new one")
        if self._state is LifecycleState.OPEN or self._opening:
            raise UserError(f"the {type(self).__name__} is already open")

    # ----------------------------------------------------------------- async

    async def open(self, *, home: EventLoopHome | None = None) -> None:
        """Open on ``home`` (default: the running event loop). Prefer ``async with``."""
        self._check_openable()
        self._opening = True
        self._home = home if home is not None else EventLoopHome.current()
        try:
            await self._open_resources()
            self._state = LifecycleState.OPEN
            await self._when_open()
        except BaseException:
            self._state = LifecycleState.CLOSED
            with anyio.CancelScope(shield=True):  # Ctrl-C or a timeout during open must not skip the cleanup
                await self._close_resources()
            raise
        finally:
            self._opening = False

    async def aclose(self) -> None:
        """Close and release everything it started. Safe to call twice; runs even when cancelled."""
        if self._state is LifecycleState.CLOSED:
            return
        self._state = LifecycleState.CLOSED
        with anyio.CancelScope(shield=True):
            await self._close_resources()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ----------------------------------------------------------------- blocking

    def __enter__(self) -> Self:
        """Open on an event loop of its own (for scripts and notebooks)."""
        self._check_openable()
        home, started = self._blocking_home()
        try:
            home.call(functools.partial(self.open, home=home))
        except BaseException:
            if started:
                home.stop()
            raise
        self._started_home = started
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> Self:
        """Open on an event loop thread of its own, as ``with`` does; end it with ``close()``.

        For notebook cells, where a ``with`` block cannot span the object's life. In a
        notebook, re-running the cell closes what the cell's previous run started.
        """
        self.__enter__()
        replace_previous_from_this_cell(self)
        return self

    def close(self) -> None:
        """Blocking `aclose`, for what was opened with ``with`` or ``start()``. Safe to call twice."""
        home = self._home
        if home is None:  # never opened: nothing to release
            self._state = LifecycleState.CLOSED
            return
        if self._state is not LifecycleState.CLOSED:
            home.call(self.aclose)  # raises UserError on a loop borrowed from `async with`
        if self._started_home:
            self._started_home = False
            home.stop()

"""`EngineUser`: a lifecycle object that runs on one engine, and the rule for who closes it.

An engine given open is shared: the object runs on the engine's event loop and leaves the
engine to whoever opened it. An engine given unopened, or made by `_make_engine` when none
was given, is opened by the object and closes with it. `Session` and `SessionPool` are both.
"""

from __future__ import annotations

from .._engines import Engine, EngineState
from .._errors import SessionClosedError, UserError
from .._home import EventLoopHome
from .._lifecycle import Lifecycle

__all__ = ["EngineUser"]


class EngineUser(Lifecycle):
    """Holds the engine; subclasses say how to make their own (`_make_engine`)."""

    def _use_engine(self, engine: Engine | None) -> None:
        """Call from ``__init__``: the engine given (or None: one is made at open)."""
        if engine is not None and not isinstance(engine, Engine):
            raise UserError(f"engine must be an agentkv Engine, not {type(engine).__name__}")
        self._given_engine = engine
        self._engine: Engine | None = engine
        self._owns_engine = False
        """Whether this object opened its engine (and so closes it); decided by `open`."""

    def _make_engine(self) -> Engine:
        """The engine to start when none was given."""
        raise NotImplementedError

    @property
    def engine(self) -> Engine:
        """The engine this runs on."""
        if self._engine is None:
            raise SessionClosedError(f"the {type(self).__name__} is not open")
        return self._engine

    def _blocking_home(self) -> tuple[EventLoopHome, bool]:
        engine = self._given_engine
        if engine is not None and engine.state is EngineState.OPEN and engine.home is not None:
            if engine.home.is_current():  # a blocking open would block the loop the engine runs on
                name = type(self).__name__
                raise UserError(
                    f"this engine was opened with `async with` on this thread's event loop: "
                    f"use `async with {name}(...)` (or `await ....open()`) here too"
                )
            return engine.home, False  # a shared engine's loop (its own thread, or one borrowed from `async with`)
        return super()._blocking_home()

    async def _open_engine(self) -> Engine:
        """Open the engine (the object's own) or join it (a shared one: run on its loop)."""
        engine = self._given_engine if self._given_engine is not None else self._make_engine()
        self._engine = engine
        if engine.state is EngineState.UNOPENED:
            self._owns_engine = True
            await engine.open(home=self.home)
        elif engine.state is EngineState.OPEN:
            self._home = engine.home
        else:
            raise SessionClosedError(
                f"the engine given to this {type(self).__name__} is {engine.state.value}; give an open or a new one"
            )
        return engine

    async def _close_engine(self) -> None:
        """Close the engine if this object opened it."""
        if self._owns_engine and self._engine is not None:
            await self._engine.aclose()

"""`Session`: a conversation pinned to its KV on an engine, run turn by turn.

A turn works on a copy of the conversation and is committed only when it ended well (and,
with ``run(on_event=...)``, once the callback took the `TurnEnd`); a turn that fails, is
cancelled or abandoned never shows in `messages` or `stats`. The session prepares a turn
(`_begin_turn`), runs its steps (`agentkv._session._turn`: model step, tool round, finish) and
commits it (`_commit`) or drops it (`_end_turn`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import anyio.to_thread

from .._conversation._conversation import ChatRenderer, Conversation, Message
from .._conversation._tools import Tool, ToolChoice, ToolFormat, template_tools
from .._engines import Colocated, EmbeddedPair, Engine, EngineState, KVHandle
from .._errors import SessionClosedError, UserError
from .._home import EventLoopHome
from .._lifecycle import Lifecycle, LifecycleState
from .._stats._stats import SessionStats, TurnStats
from ._pinning import Pin
from ._results import Event, TurnEnd, TurnResult
from ._session_config import Mode, SessionConfig, check_count, check_message
from ._turn import StepContext, Turn, turn_events

__all__ = ["Mode", "Session"]

logger = logging.getLogger("agentkv")


class Session(Lifecycle):
    """A multi-turn conversation on an engine, with its KV pinned between steps.

    Use it as a context manager: ``async with Session() as s`` on your event loop, or
    ``with Session() as s`` from synchronous code and notebooks (the engine then runs on an
    event loop of its own, and both ``s.run_sync(...)`` and ``await s.run(...)`` work).

    Args:
        engine: the engine to run on. Whether the session owns it is decided when the session
            opens: an engine that is open then is shared (other sessions may use it; whoever
            opened it closes it); an unopened one (``Session(engine=LaunchedPair())``) is opened
            by the session and becomes its own: it closes with the session.
            Default: the session starts its own engine for ``mode`` and closes it on exit.
        model: the model of the session's own engine: a bundled name or an HF folder.
        mode: ``"bidirectional"`` (default: D's KV pushed back every step), ``"disaggregated"``
            (standard P/D, no push-back) or ``"colocated"`` (one engine, prefix caching).
            With ``engine=`` the default is what that engine supports.
        system: the system message.
        tools: functions the model may call (`@tool`-decorated or plain typed functions).
        tool_choice: ``"auto"``, ``"required"`` (the first step of each turn must call a tool),
            ``"none"`` or a tool's name (the first step must call it).
        tool_format: ``"schema"`` (default; calls forced to JSON, works with any model) or
            ``"native"`` (the model's chat template renders the tools; Hermes-style calls parsed).
        max_steps: the most model calls per turn; the last one is made to answer.
        max_tokens: the most tokens one model call may generate.
        temperature: sampling temperature (0: greedy; not negative).
        seed: sampling seed.
        expiry_margin_s: a pin that expires within this many seconds is not pushed back (not negative).
        cache_salt: keep this session's cached KV apart: blocks cached under one salt never
            serve a request with another (vLLM ``cache_salt``), on P, D or a colocated engine.
            For tenants that must not share KV, and for measurements that must not help
            each other. Default: none (sessions with equal prefixes share blocks).
        engine_options: keyword arguments for the session's own engine (e.g. ``max_model_len``).

    Mistakes in these arguments raise `UserError` (`InvalidMessageError` for the system text).
    """

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        model: str | None = None,
        mode: Mode | None = None,
        system: str | None = None,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        tool_choice: ToolChoice = "auto",
        tool_format: ToolFormat = "schema",
        max_steps: int = 8,
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        expiry_margin_s: float = 10.0,
        cache_salt: str | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        if engine is not None and not isinstance(engine, Engine):
            raise UserError(f"engine must be an agentkv Engine, not {type(engine).__name__}")
        if engine is not None and (model is not None or engine_options):
            raise UserError("model= and engine_options= configure the session's own engine; not with engine=")
        config = SessionConfig.build(
            model=model,
            mode=mode,
            system=system,
            tools=tools,
            tool_choice=tool_choice,
            tool_format=tool_format,
            max_steps=max_steps,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            expiry_margin_s=expiry_margin_s,
            cache_salt=cache_salt,
            engine_options=engine_options,
        )
        self._setup(config, engine)

    def _setup(self, config: SessionConfig, engine: Engine | None) -> None:
        super().__init__()
        self._config = config
        self._given_engine = engine
        self._engine: Engine | None = engine
        self._owns_engine = False
        """Whether this session opened its engine (and so closes it); decided by `open`."""
        self._conversation: Conversation | None = None
        self._pin: Pin | None = None
        self._turns: list[TurnStats] = []
        """One per turn of the conversation, in order (kept aligned through rewinds and forks)."""
        self._active: Turn | None = None
        self._lock = threading.RLock()
        """Guards the committed state (conversation, pin, stats, active turn) against other threads."""
        self._releases: list[KVHandle] = []
        self._forks: weakref.WeakSet[Session] = weakref.WeakSet()
        """Forks (and forks of forks) that run on this session's own engine: they close with it."""
        self._engine_owner: Session | None = None
        """For a fork: the session whose own engine it runs on (None: a shared engine)."""
        self.mode: Mode = config.mode or "bidirectional"

    # ----------------------------------------------------------------- lifecycle

    def _blocking_home(self) -> tuple[EventLoopHome, bool]:
        engine = self._given_engine
        if engine is not None and engine.state is EngineState.OPEN:
            if engine.home is None or not engine.home.owns_thread:
                raise UserError("this engine was opened with `async with`: use `async with Session(...)` too")
            return engine.home, False  # a shared engine's loop, which its owner stops
        return super()._blocking_home()

    async def _open_resources(self) -> None:
        engine = self._given_engine if self._given_engine is not None else self._make_engine()
        self._engine = engine
        if engine.state is EngineState.UNOPENED:
            self._owns_engine = True
            await engine.open(home=self.home)
        elif engine.state is EngineState.OPEN:
            self._home = engine.home  # a shared engine: the session runs its turns on the engine's loop
        else:
            raise SessionClosedError(
                f"the engine given to this session is {engine.state.value}; give an open or a new one"
            )
        self.mode = self._resolve_mode(engine)
        tokenizer = await anyio.to_thread.run_sync(load_tokenizer, str(engine.info.model_path))
        config = self._config
        native_tools = template_tools(config.tools) if config.tools and config.format == "native" else None
        text = config.system_text(config.system)
        system = Message(role="system", content=text) if text is not None else None
        renderer = ChatRenderer(tokenizer, system=system, tools=native_tools)
        self._conversation = Conversation(renderer, system=system)

    async def _close_resources(self) -> None:
        if self._owns_engine:  # the forks run on this session's engine, which closes now
            for fork in list(self._forks):
                await fork.aclose()
        with self._lock:
            if self._pin is not None:
                self._releases.append(self._pin.handle)
                self._pin = None
        await self._release_pins()
        if self._owns_engine and self._engine is not None:
            await self._engine.aclose()

    def _make_engine(self) -> Engine:
        mode = self._config.mode or "bidirectional"
        options = dict(self._config.engine_options)
        if mode == "colocated":
            return Colocated(self._config.model, **options)
        options.setdefault("bidirectional", mode in ("bidirectional", "auto"))
        return EmbeddedPair(self._config.model, **options)

    def _resolve_mode(self, engine: Engine) -> Mode:
        info = engine.info
        wanted = self._config.mode or info.natural_mode
        if wanted in ("bidirectional", "auto") and not info.push_back:
            raise UserError(f"mode={wanted!r} needs an engine with push-back; this one is {info.natural_mode}")
        if wanted not in info.modes:
            raise UserError(f"mode={wanted!r} does not fit this engine (it serves {', '.join(sorted(info.modes))})")
        return wanted

    # ----------------------------------------------------------------- reading

    @property
    def engine(self) -> Engine:
        """The engine this session runs on."""
        if self._engine is None:
            raise SessionClosedError("the session is not open")
        return self._engine

    @property
    def messages(self) -> list[Message]:
        """The conversation so far: finished turns only (readable after close too)."""
        return self._readable_conversation().messages

    @property
    def token_ids(self) -> list[int]:
        """The conversation as the model sees it (a copy; finished turns only; readable after close too)."""
        return list(self._readable_conversation().tokens)

    @property
    def stats(self) -> SessionStats:
        """Statistics of every turn of the conversation."""
        return SessionStats(mode=self.mode, turns=list(self._turns))

    # ----------------------------------------------------------------- running

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
        turn = await self._begin_turn(message)
        try:
            async with aclosing(turn_events(turn, self._step_context())) as events:
                async for event in events:
                    if on_event is not None:
                        on_event(event)  # may raise, also at TurnEnd: then the turn is not kept
            assert turn.result is not None
            self._commit(turn)
            return turn.result
        finally:
            self._end_turn(turn)

    async def _stream(self, message: str, consumer: list[weakref.ref[Any]]) -> AsyncGenerator[Event]:
        if not self._require_home().is_current():
            raise UserError("stream() runs on the session's own event loop; use run(on_event=...) here")
        turn = await self._begin_turn(message, consumer=consumer[0] if consumer else None)
        try:
            async with aclosing(turn_events(turn, self._step_context())) as events:
                async for event in events:
                    if isinstance(event, TurnEnd):
                        self._commit(turn)
                    yield event
        finally:
            self._end_turn(turn)

    async def _begin_turn(self, message: str, *, consumer: weakref.ref[Any] | None = None) -> Turn:
        """Prepare a turn: claim the session, copy the conversation, append the user message."""
        check_message(message)
        with self._lock:
            conversation = self._require_conversation()
            self._drop_abandoned_turn()
            if self._active is not None:
                raise UserError("a turn is already running in this session; sessions take one turn at a time")
            turn = Turn(len(self._turns) + 1, conversation.copy(), self._pin, self._pin, consumer)
            self._pin, self._active = None, turn
        try:
            await self._release_pins()
            await self._ensure_engine(turn)
            turn.conversation.add_messages([Message(role="user", content=message)])
        except BaseException:
            self._end_turn(turn)
            raise
        return turn

    def _step_context(self) -> StepContext:
        return StepContext(
            self.engine,
            self._config,
            self.mode in ("bidirectional", "auto"),
            self._discard_pin,
            placement="auto" if self.mode == "auto" else "prefill",
        )

    def _commit(self, turn: Turn) -> None:
        """Make a finished turn part of the session: its conversation, its pin, its stats."""
        with self._lock:
            if turn.ended or self._active is not turn or turn.result is None:
                raise UserError("this turn was abandoned and cannot be kept")
            self._conversation = turn.conversation
            self._pin, turn.pin = turn.pin, None
            self._turns.append(turn.result.stats)
            turn.ended = True
            self._active = None

    def _end_turn(self, turn: Turn) -> None:
        """Drop a turn that was not committed (failed, cancelled, abandoned). Safe to call twice."""
        with self._lock:
            if turn.ended:
                return
            turn.ended = True
            if self._active is turn:
                self._active = None
            pin, turn.pin = turn.pin, None
            if pin is not None and pin is turn.taken_pin and self._pin is None:
                self._pin = pin  # never forwarded, and the conversation is unchanged: still good
            elif pin is not None:
                self._discard_pin(pin)

    def _drop_abandoned_turn(self) -> None:
        """End the running turn if its `stream` consumer is gone (called with the lock held)."""
        if self._active is not None and self._active.abandoned():
            logger.debug("agentkv: dropping turn %d, whose stream was abandoned", self._active.number)
            self._end_turn(self._active)

    async def _ensure_engine(self, turn: Turn) -> None:
        """Replace the session's own engine if it died; a shared or given engine is the caller's to replace."""
        engine = self.engine
        if not engine.is_dead:
            return
        if not self._owns_engine or self._given_engine is not None:  # only an engine the session made is remade
            engine.check_open()
        logger.warning("agentkv: the session's engine died; starting a new one (the conversation is kept)")
        turn.pin = turn.taken_pin = None
        await engine.aclose()
        replacement = self._make_engine()
        await replacement.open(home=self.home)
        self._engine = replacement

    # ----------------------------------------------------------------- pins

    def _discard_pin(self, pin: Pin) -> None:
        """Give a pin up: D is asked (soon, on the session's loop) to drop its blocks."""
        with self._lock:
            self._releases.append(pin.handle)
        if self.home is not None:
            self.home.spawn(self._release_pins)

    async def _release_pins(self) -> None:
        """Ask the engine to drop the pins given up so far (on the engine's loop; best effort)."""
        home = self.home
        if home is not None and not home.is_current():  # e.g. `await s.aclose()` from another loop
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await home.call_async(self._release_pins)
            return
        with self._lock:
            handles, self._releases = self._releases, []
        engine = self._engine
        if not handles or engine is None or not engine.is_open or engine.is_dead:
            return
        with anyio.CancelScope(shield=True):
            for handle in handles:
                try:
                    await engine.release(handle)
                except Exception:  # best effort: an unreleased pin expires on D
                    logger.debug("agentkv: releasing a pin failed", exc_info=True)

    # ----------------------------------------------------------------- editing

    def rewind(self, turns: int = 1) -> None:
        """Drop the last ``turns`` turns from the conversation (and their stats)."""
        check_count(turns, "turns")
        with self._lock:
            conversation = self._require_idle()
            conversation.rewind(turns)
            del self._turns[len(conversation.turn_starts()) :]
            self._drop_pin()

    def replace_message(self, index: int, content: str) -> None:
        """Replace the content of message ``index`` of `messages`; later messages are kept.

        The tokens after the edit are re-rendered, so the next step's prompt no longer
        extends D's pin: the pin is released. Replacing the system message keeps the
        instructions that schema-format tools append to it.
        """
        check_count(index, "index")
        check_message(content)
        with self._lock:
            conversation = self._require_idle()
            if index == 0 and conversation.system is not None:
                content = self._config.system_text(content) or content
            conversation.replace(index, content)
            self._drop_pin()

    def fork(self) -> Session:
        """A new open session on the same engine with a copy of this conversation (and its stats).

        The fork has the same configuration and no pin (handles are single-use); its first
        step reuses the engine's prefix cache. Closing the fork leaves the engine running;
        closing this session closes the fork too when this session's engine closes with it.
        """
        with self._lock:
            conversation = self._require_idle()
            twin = Session.__new__(Session)
            twin._setup(self._config, self._engine)
            twin.mode = self.mode
            twin._home = self._home
            twin._conversation = conversation.copy()
            twin._turns = list(self._turns)
            twin._state = LifecycleState.OPEN
            twin._engine_owner = self if self._owns_engine else self._engine_owner
            if twin._engine_owner is not None:
                twin._engine_owner._forks.add(twin)
        return twin

    def _drop_pin(self) -> None:
        """Release the session's pin (called with the lock held, after an edit)."""
        if self._pin is not None:
            pin, self._pin = self._pin, None
            self._discard_pin(pin)

    # ----------------------------------------------------------------- guards

    def _require_conversation(self) -> Conversation:
        self._require_open()
        assert self._conversation is not None
        return self._conversation

    def _readable_conversation(self) -> Conversation:
        if self._conversation is None:
            raise SessionClosedError("the session was never opened: it has no conversation")
        return self._conversation

    def _require_idle(self) -> Conversation:
        """The conversation, for an edit (called with the lock held): no turn may be running."""
        conversation = self._require_conversation()
        self._drop_abandoned_turn()
        if self._active is not None:
            raise UserError("the conversation cannot change while a turn runs; rewind, edit or fork once it ended")
        return conversation

    def _require_home(self) -> EventLoopHome:
        self._require_conversation()
        assert self._home is not None
        return self._home


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_path: str) -> Any:
    """The model's Hugging Face tokenizer, loaded once per process (sessions only read it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)

"""`SessionCore`: one conversation pinned to its KV on an engine, and everything done to it between steps.

It owns the conversation, the pin, the engine and the stats: opening and closing (the engine the
session made closes with it), replacing a dead engine, giving pins up. The edits between turns (rewind,
replace_message, snapshot/restore, fork) are `SessionEdits`'s (src/agentkv/_session/_session_edits.py).
The two APIs over it add the model calls: the SDK's
tool loop (`agentkv._session._turn_api`: ``run``/``stream``) and the caller-run step
(`agentkv._session._step_api`: ``step``/``extends``). Both run a `Turn` on a copy of the
conversation: `_claim` starts it, `_prepare` makes its conversation, `_take` keeps it and `_end_turn`
drops it (a turn that fails, is cancelled or abandoned never shows in `messages` or `stats`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any, Self

import anyio.to_thread

from .._conversation._conversation import ChatRenderer, Conversation, Message
from .._conversation._light_tokenizer import LightTokenizer, is_light
from .._conversation._parsers import OutputParsers
from .._conversation._tools import template_tools
from .._conversation._transcript import Transcript, TranscriptKey
from .._engines import Colocated, EmbeddedPair, Engine
from .._engines._base import Pin, SavedPin
from .._engines._pinning import HeldPin
from .._errors import SessionClosedError, UserError
from .._home import EventLoopHome
from .._model import model_name
from .._stats._stats import SessionStats, TurnStats
from ._engine_user import EngineUser
from ._modes import Mode, modes_of, natural_mode, off_reason, pushes_back
from ._pin_upkeep import PinOffers, PinUpkeep
from ._session_config import SessionConfig
from ._tool_sources import ToolSources
from ._tracing import TraceInfo
from ._turn import StepContext, Turn

__all__ = ["SessionCore", "load_tokenizer", "make_engine"]

logger = logging.getLogger("agentkv")


class SessionCore(EngineUser):
    """A conversation on an engine with its pin and stats; `Session` adds the turn and the step APIs."""

    @classmethod
    def _of_config(cls, config: SessionConfig, engine: Engine | None, *, conversation_id: str | None = None) -> Self:
        """A session made from a configuration already checked (a pool's sessions, a fork)."""
        session = cls.__new__(cls)
        session._setup(config, engine, conversation_id=conversation_id)
        return session

    def _setup(self, config: SessionConfig, engine: Engine | None, *, conversation_id: str | None = None) -> None:
        super().__init__()
        self._config = config
        self._conversation_id = conversation_id or uuid.uuid4().hex
        """The conversation's id in the session's spans (``gen_ai.conversation.id``): a pool's name for it, else
        one of the session's own."""
        self._trace: TraceInfo | None = None
        """What the session's spans name (set when it opens: the model is the engine's)."""
        self._sources = ToolSources()
        """The MCP servers among its tools: those it opened close with it (`_take_new_tools`)."""
        self._use_engine(engine)
        self._conversation: Conversation | None = None
        self._pin: HeldPin | None = None
        self._turns: list[TurnStats] = []
        """One per turn of the conversation, in order (kept aligned through rewinds and forks)."""
        self._active: Turn | None = None
        self._lock = threading.RLock()
        """Guards the committed state (conversation, pin, stats, active turn, transcript) against other threads.

        The event-loop home alone does not: with ``with Session()`` the steps run on the home's thread while
        the caller's thread calls the synchronous methods (`rewind`, `replace_message`, `snapshot`, `restore`,
        `fork`, `extends`, the properties), and a pin is given up (`_discard_pin`) from either. Each of them
        checks and changes the state in one go (no turn running, then the edit; no turn running, then the
        claim), which the lock makes atomic. Reentrant: an edit holding it gives its pin up (`_drop_pin`)."""
        self._releases: list[Pin] = []
        self._forks: weakref.WeakSet[SessionCore] = weakref.WeakSet()
        """Forks (and forks of forks) that run on this session's own engine: they close with it."""
        self._engine_owner: SessionCore | None = None
        """For a fork: the session whose own engine it runs on (None: a shared engine)."""
        self._tokenizer: Any = None
        self._parsers = OutputParsers()
        """The vLLM output parsers the session reads its model's output with (bound to the tokenizer at open)."""
        self._transcript: Transcript | None = None
        """What `step` last answered, as the caller sees it (None after `run` or an edit)."""
        self._renderer: tuple[TranscriptKey, ChatRenderer] | None = None
        """The renderer made last for caller-kept messages, for its key (a session's key rarely changes)."""
        self._resumed = False
        """Restored from a snapshot, and no step since (its first step's miss reason is ``resumed``)."""
        self.mode: Mode = config.mode or "bidirectional"
        self._pin_offers: PinOffers | None = None
        """Where a pool offers the session's pin to other doors (`agentkv._session._pool`; None: nowhere)."""
        self._upkeep = PinUpkeep(self)
        """The pin's renewal, repin and prefetch while the session is idle (`agentkv._session._pin_upkeep`)."""

    # ----------------------------------------------------------------- lifecycle

    def _make_engine(self) -> Engine:
        return make_engine(self._config)

    async def _open_resources(self) -> None:
        engine = await self._open_engine()
        self.mode = self._resolve_mode(engine)
        self._trace = TraceInfo(conversation_id=self._conversation_id, model=model_name(engine.info.model_path))
        tokenizer = await anyio.to_thread.run_sync(load_tokenizer, str(engine.info.model_path))
        assert self.home is not None
        config = self._config = await self._sources.open(self._config, self.home)  # listed once: `_take_new_tools`
        self._tokenizer = tokenizer
        system, renderer = self._rendering(config)
        self._parsers = OutputParsers(tokenizer, config.tool_call_parser, config.reasoning_parser)
        self._parsers.reasoning()  # a reasoning parser that does not fit the model's tokenizer is refused at open
        if config.format == "native":  # and so is a tool parser
            self._parsers.tools(config.tool_specs)
        self._conversation = Conversation(renderer, system=system)

    def _rendering(self, config: SessionConfig) -> tuple[Message | None, ChatRenderer]:
        """The system message and the renderer of the session's conversation under ``config`` (its tools)."""
        native_tools = template_tools(config.tool_specs) if config.tools and config.format == "native" else None
        text = config.system_text(config.system)
        system = Message(role="system", content=text) if text is not None else None
        return system, ChatRenderer(self._tokenizer, system=system, tools=native_tools)

    def _take_new_tools(self) -> None:
        """At the start of a turn or a step (the lock held, none running): if one of the session's MCP servers
        announced a changed tool list since the session took it, take the new one. The tools are rendered at the
        head of the prompt (the system message, or the template's tools), so the whole conversation is rendered
        again (each output kept as generated) and the next step computes all of it: its pin does not extend the new
        prompt (``prefix_mismatch``)."""
        if self._active is not None or self._conversation is None:
            return
        try:
            config = self._sources.newer(self._config)
        except (UserError, SessionClosedError) as exc:  # the tools the session has stay
            logger.warning("agentkv: an MCP server's new tools cannot be taken (%s); keeping the old ones", exc)
            return
        if config is None:
            return
        self._config = config
        system, renderer = self._rendering(config)
        self._conversation = self._conversation.rerendered(renderer, system)

    async def _close_resources(self) -> None:
        if self._owns_engine:  # the forks run on this session's engine, which closes now
            for fork in list(self._forks):
                await fork.aclose()
        await self._upkeep.close()
        with self._lock:
            if self._pin is not None:
                self._releases.append(self._pin.pin)
                self._pin = None
        await self._release_pins()
        await self._sources.close()
        await self._close_engine()

    def _resolve_mode(self, engine: Engine) -> Mode:
        info = engine.info
        served = modes_of(info)
        wanted = self._config.mode or natural_mode(info)
        if pushes_back(wanted) and "bidirectional" not in served:
            raise UserError(f"mode={wanted!r} needs an engine with push-back; this one is {natural_mode(info)}")
        if wanted not in served:
            why = off_reason(info, wanted)  # a feature the installed vLLM cannot serve
            raise UserError(
                f"mode={wanted!r} does not fit this engine (it serves {', '.join(sorted(served))})"
                + (f": {why}" if why else "")
            )
        return wanted

    # ----------------------------------------------------------------- reading

    @property
    def messages(self) -> list[Message]:
        """The conversation so far: finished turns only (readable after close too)."""
        return self._readable_conversation().messages

    @property
    def token_ids(self) -> list[int]:
        """The conversation as the model sees it (a copy; finished turns only; readable after close too)."""
        return list(self._readable_conversation().tokens)

    @property
    def pinned_tokens(self) -> int:
        """Tokens whose KV D holds for this conversation now, for the next step to pull back (0: no pin)."""
        pin = self._pin or self._upkeep.renewing
        return pin.pin.tokens if pin is not None else 0

    @property
    def stats(self) -> SessionStats:
        """Statistics of every turn of the conversation."""
        return SessionStats(mode=self.mode, turns=list(self._turns))

    # ----------------------------------------------------------------- turns

    def _claim(self, number: int, consumer: weakref.ref[Any] | None = None) -> Turn:
        """Start a turn on a copy of the conversation, with the session's pin (called with the lock held,
        after `_require_idle`)."""
        assert self._conversation is not None
        turn = Turn(number, self._conversation.copy(), self._pin, self._pin, consumer)
        self._pin, self._active = None, turn
        self._upkeep.pause()
        return turn

    async def _prepare(self, turn: Turn, change: Callable[[Turn], None], *, off_loop: bool = False) -> None:
        """Give up the pins let go, replace a dead engine, then make the turn's conversation (``change``; in a
        worker thread with ``off_loop``: a large rendering, src/agentkv/_session/_prompt_work.py).
        On any failure the turn ends (the session is as before)."""
        try:
            await self._release_pins()
            await self._upkeep.settled()  # an upkeep step that runs ends first (one token): the turn takes its pin
            with self._lock:
                if turn.taken_pin is None and self._pin is not None and self._active is turn:
                    turn.pin = turn.taken_pin = self._pin
                    self._pin = None
                turn.pin_renewals, turn.repins, turn.early_transfers = self._upkeep.counts()
            await self._ensure_engine(turn)
            if off_loop:
                await anyio.to_thread.run_sync(change, turn)
            else:
                change(turn)
        except BaseException:
            self._end_turn(turn)
            raise

    def _step_context(self, config: SessionConfig | None = None) -> StepContext:
        return StepContext(
            self.engine,
            config or self._config,
            pushes_back(self.mode),
            self._discard_pin,
            placement="auto" if self.mode == "auto" else "prefill",
            resumed=self._resumed,
            parsers=self._parsers,
            trace=self._trace,
        )

    def _take(self, turn: Turn) -> None:
        """Make a finished turn's conversation and pin the session's (called with the lock held)."""
        if turn.ended or self._active is not turn:
            raise UserError("this turn was abandoned and cannot be kept")
        self._conversation = turn.conversation
        self._pin, turn.pin = turn.pin, None
        self._resumed = False
        turn.ended = True
        self._active = None
        self._upkeep.kept(self, turn=True, repin=turn.repinnable)

    def _end_turn(self, turn: Turn) -> None:
        """Drop a turn that was not kept (failed, cancelled, abandoned). Safe to call twice."""
        with self._lock:
            if turn.ended:
                return
            turn.ended = True
            if self._active is turn:
                self._active = None
            pin, turn.pin = turn.pin, None
            if pin is not None and pin is turn.taken_pin and self._pin is None:
                self._pin = pin  # never forwarded, and the conversation is unchanged: still good
                self._upkeep.kept(self, turn=False)
            elif pin is not None:
                self._discard_pin(pin)

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
        replacement = make_engine(self._config)
        await replacement.open(home=self.home)
        self._engine = replacement

    def _renderer_for(self, key: TranscriptKey) -> ChatRenderer:
        """The renderer of caller-kept messages under ``key`` (`step` rebuilds with it, `restore` loads with it)."""
        if self._renderer is not None and self._renderer[0] == key:
            return self._renderer[1]
        native = template_tools({t.name: t for t in key.tools}) if key.tools and key.format == "native" else None
        system = Message(role="system", content=key.system) if key.system is not None else None
        extra = json.loads(key.template_kwargs) if key.template_kwargs is not None else None
        renderer = ChatRenderer(self._tokenizer, system=system, tools=native, template_kwargs=extra)
        self._renderer = (key, renderer)
        return renderer

    # ----------------------------------------------------------------- pins

    def _discard_pin(self, held: HeldPin) -> None:
        """Give a pin up: the engine is asked (soon, on the session's loop) to drop its KV."""
        with self._lock:
            self._releases.append(held.pin)
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
            pins, self._releases = self._releases, []
        engine = self._engine
        if not pins or engine is None or not engine.is_open or engine.is_dead:
            return
        with anyio.CancelScope(shield=True):
            for pin in pins:
                try:
                    await engine.release(pin)
                except Exception:  # best effort: an unreleased pin expires on D
                    logger.debug("agentkv: releasing a pin failed", exc_info=True)

    def _saved_pin(self) -> SavedPin | None:
        """The pin as another process could take it back (`Engine.saved_pin`): only between turns, and only when
        it keeps the conversation's own tokens (so a snapshot saved beside it matches it)."""
        with self._lock:
            held, engine = self._pin, self._engine
            if held is None or engine is None or self._active is not None or self._conversation is None:
                return None
            kept = held.pin.tokens
            if held.token_ids[:kept] != self._conversation.tokens[:kept]:
                return None
        return engine.saved_pin(held.pin)

    def _adopt_pin(self, saved: SavedPin) -> bool:
        """Take up a pin another process saved with the snapshot just restored (its caller made sure no one else
        has it): the engine's own again when it can reach its KV (`Engine.adopt_pin`)."""
        engine = self._engine
        pin = engine.adopt_pin(saved) if engine is not None else None
        if pin is None:
            return False
        with self._lock:
            tokens = list(self._readable_conversation().tokens)
            if pin.tokens > len(tokens) or self._pin is not None or self._active is not None:
                self._releases.append(pin)
                return False
            self._pin = HeldPin(pin, tokens)
            self._upkeep.kept(self, turn=True)
            return True

    def _drop_pin(self) -> None:
        """Release the session's pin and cancel its upkeep (called with the lock held, after an edit)."""
        self._upkeep.cancel()
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

    def _require_idle(
        self,
        running: str = "the conversation cannot change while a turn runs; rewind, edit or fork once it ended",
        error: type[UserError] = UserError,
    ) -> Conversation:
        """The conversation, for an edit or a new turn (called with the lock held): none may be running
        (else ``error``, saying ``running``). A turn whose `stream` consumer is gone is ended first."""
        conversation = self._require_conversation()
        if self._active is not None and self._active.abandoned():
            logger.debug("agentkv: dropping turn %d, whose stream was abandoned", self._active.number)
            self._end_turn(self._active)
        if self._active is not None:
            raise error(running)
        return conversation

    def _require_home(self) -> EventLoopHome:
        self._require_conversation()
        assert self._home is not None
        return self._home


def make_engine(config: SessionConfig) -> Engine:
    """The engine a session (or a pool) starts for itself: the embedded pair, or one engine for ``colocated``."""
    mode = config.mode or "bidirectional"
    options = dict(config.engine_options)
    if mode == "colocated":
        return Colocated(config.model, **options)
    if "bidirectional" not in options:  # the old name, given by the caller: the pair maps it (with a warning)
        options.setdefault("push_back", mode in ("bidirectional", "auto"))
    return EmbeddedPair(config.model, **options)


_TOKENIZER_LOADING = threading.Lock()


def load_tokenizer(model_path: str) -> Any:
    """The model's Hugging Face tokenizer, loaded once per process (sessions only read it).

    One thread at a time: sessions opened at once (a burst at the front door) would otherwise import
    transformers in several threads together, and its lazy imports then fail (``cannot import name``)."""
    with _TOKENIZER_LOADING:
        return _load_tokenizer(model_path)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(model_path: str) -> Any:
    if is_light(model_path):  # the test doubles' model: no transformers import (seconds) for it
        return LightTokenizer(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)

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
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, Unpack

import anyio.to_thread

from .._conversation._conversation import ChatRenderer, Conversation, Message
from .._conversation._parsers import OutputParsers
from .._conversation._tools import Tool, ToolChoice, ToolFormat, template_tools
from .._conversation._transcript import Transcript, TranscriptKey, model_messages, rebuild
from .._engines import Colocated, EmbeddedPair, Engine, KVHandle
from .._engines._pinning import Pin
from .._engines._sampling import SamplingOptions, TokenLogprob
from .._errors import SessionBusyError, SessionClosedError, UserError
from .._home import EventLoopHome
from .._lifecycle import LifecycleState
from .._stats._stats import SessionStats, TurnStats
from ._answer_text import tool_call_delta
from ._engine_user import EngineUser
from ._message_step import MessageRequest, StepOptions, ToolsArgument, read_reply
from ._results import Event, ReasoningDelta, Step, StepReply, TextPiece, ToolCallDelta, TurnEnd, TurnResult
from ._session_config import Mode, SessionConfig, check_count, check_message
from ._snapshot import SessionSnapshot, load_transcript, save_transcript
from ._turn import StepContext, Turn, model_step, turn_events

__all__ = ["Mode", "Session", "make_engine"]

logger = logging.getLogger("agentkv")


class Session(EngineUser):
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
        model: the model of the session's own engine: a bundled name, a local HF folder or a Hugging Face
            id ``org/name[@revision]`` from the HF cache (see `prepare_model`).
        mode: ``"bidirectional"`` (default: D's KV pushed back every step), ``"disaggregated"``
            (standard P/D, no push-back) or ``"colocated"`` (one engine, prefix caching).
            With ``engine=`` the default is what that engine supports.
        system: the system message.
        tools: functions the model may call (`@tool`-decorated or plain typed functions).
        tool_choice: ``"auto"``, ``"required"`` (the first step of each turn must call a tool),
            ``"none"`` or a tool's name (the first step must call it).
        tool_format: ``"schema"`` (default; calls forced to JSON, works with any model) or
            ``"native"`` (the model's chat template renders the tools; its calls are read by ``tool_call_parser``).
        tool_call_parser: with ``tool_format="native"``, the vLLM tool parser that reads the model's calls, by
            its ``vllm serve --tool-call-parser`` name (``"hermes"``, ``"llama3_json"``, ``"mistral"``...; default
            ``"hermes"``: ``<tool_call>`` blocks). An unknown name raises `UserError` listing vLLM's.
        reasoning_parser: the vLLM reasoning parser (``vllm serve --reasoning-parser`` name: ``"deepseek_r1"``,
            ``"qwen3"``...) that splits a reasoning model's thinking from its answer (`StepReply.reasoning`;
            the answer is the rest). The conversation keeps the output's tokens as generated, reasoning
            included, so the next step extends them and pushes D's KV back (docs/tools.md).
        max_steps: the most model calls per turn; the last one is made to answer.
        max_tokens: the most tokens one model call may generate.
        temperature: sampling temperature (0: greedy; not negative).
        seed: sampling seed.
        sampling: every other sampling setting of vLLM's OpenAI server (`SamplingOptions`, or a mapping of
            its fields: ``top_p``, ``top_k``, ``presence_penalty``, ``logit_bias``, ``logprobs``,
            ``structured_outputs``...), under vLLM's names and ranges; each engine honours every field or
            refuses the step by name. A mistake raises `UserError` naming ``sampling.<field>``.
            ``structured_outputs`` and tools in ``tool_format="schema"`` (whose calls a JSON schema forces)
            cannot apply together: refused (`UserError`); native-format tools take it.
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
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        max_steps: int = 8,
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        sampling: SamplingOptions | Mapping[str, Any] | None = None,
        expiry_margin_s: float = 10.0,
        cache_salt: str | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        if engine is not None and (model is not None or engine_options):
            raise UserError("model= and engine_options= configure the session's own engine; not with engine=")
        config = SessionConfig.build(
            model=model,
            mode=mode,
            system=system,
            tools=tools,
            tool_choice=tool_choice,
            tool_format=tool_format,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            max_steps=max_steps,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            sampling=sampling,
            expiry_margin_s=expiry_margin_s,
            cache_salt=cache_salt,
            engine_options=engine_options,
        )
        self._setup(config, engine)

    def _setup(self, config: SessionConfig, engine: Engine | None) -> None:
        super().__init__()
        self._config = config
        self._use_engine(engine)
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
        self._tokenizer: Any = None
        self._parsers = OutputParsers()
        """The vLLM output parsers the session reads its model's output with (bound to the tokenizer at open)."""
        self._transcript: Transcript | None = None
        """What `step` last answered, as the caller sees it (None after `run` or an edit)."""
        self._renderer: tuple[TranscriptKey, ChatRenderer] | None = None
        """The renderer `step` made last, for its key (a session's key rarely changes)."""
        self._resumed = False
        """Restored from a snapshot, and no step since (its first step's miss reason is ``resumed``)."""
        self.mode: Mode = config.mode or "bidirectional"

    # ----------------------------------------------------------------- lifecycle

    def _make_engine(self) -> Engine:
        return make_engine(self._config)

    async def _open_resources(self) -> None:
        engine = await self._open_engine()
        self.mode = self._resolve_mode(engine)
        tokenizer = await anyio.to_thread.run_sync(load_tokenizer, str(engine.info.model_path))
        config = self._config
        native_tools = template_tools(config.tool_specs) if config.tools and config.format == "native" else None
        text = config.system_text(config.system)
        system = Message(role="system", content=text) if text is not None else None
        renderer = ChatRenderer(tokenizer, system=system, tools=native_tools)
        self._tokenizer = tokenizer
        self._parsers = OutputParsers(tokenizer, config.tool_call_parser, config.reasoning_parser)
        self._parsers.reasoning()  # a reasoning parser that does not fit the model's tokenizer is refused at open
        if config.format == "native":  # and so is a tool parser
            self._parsers.tools(config.tool_specs)
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
        await self._close_engine()

    def _resolve_mode(self, engine: Engine) -> Mode:
        info = engine.info
        wanted = self._config.mode or info.natural_mode
        if wanted in ("bidirectional", "auto") and not info.push_back:
            raise UserError(f"mode={wanted!r} needs an engine with push-back; this one is {info.natural_mode}")
        if wanted not in info.modes:
            why = info.extra.get("modes_off", {}).get(wanted)  # a feature the installed vLLM cannot serve
            raise UserError(
                f"mode={wanted!r} does not fit this engine (it serves {', '.join(sorted(info.modes))})"
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
        pin = self._pin
        return pin.handle.remote_num_tokens if pin is not None else 0

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

    async def step(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        tools: ToolsArgument = None,
        tool_choice: ToolChoice | Mapping[str, Any] = "auto",
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        sampling: SamplingOptions | Mapping[str, Any] | None = None,
        on_text: Callable[[str], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        on_tool_call: Callable[[ToolCallDelta], None] | None = None,
        on_reasoning: Callable[[ReasoningDelta], None] | None = None,
    ) -> StepReply:
        """One model call over the whole conversation as the caller keeps it; the caller runs the tools.

        ``messages`` are `Message` objects or OpenAI chat dicts (assistant ``tool_calls``, tool
        ``tool_call_id``). When they extend what this session last answered, only the new ones
        are appended and D's KV of the rest is pushed back; otherwise the conversation is
        rebuilt from them (its KV recomputed unless the rebuilt tokens still extend the pin).
        The reply is an answer or tool calls; nothing runs them here.

        Args:
            tools: the tools the model may call this step (`ToolSpec`, `Tool` or OpenAI tool
                dicts); default: the session's tools. A new tool list re-renders the conversation.
            tool_choice: as in `Session`, or OpenAI's ``{"type": "function", "function": {"name": ...}}``.
            max_tokens: the most tokens this step may generate; default: the session's.
            temperature: this step's sampling temperature; default: the session's.
            seed: this step's sampling seed; default: the session's.
            stop: a stop string or a list of up to 4 (OpenAI's ``stop``; none empty): the output ends at the
                first one, and the reply's text ends before it (finish reason ``"stop"``). It applies to
                output the model writes freely (plain answers, ``tool_format="native"``); a schema-format
                step with tools writes JSON forced by a grammar, which a stop string would cut, and takes
                none. The history keeps the output's token ids as generated, stop string included. On a
                pair, a step a stop string ended leaves no pin (vLLM aborts it on D, freeing its blocks):
                the next step recomputes (``miss_reason="no_handle"``).
            sampling: this step's other sampling settings (`SamplingOptions` or a mapping of its fields), put
                over the session's ``sampling`` field by field (the fields given replace the session's). With
                ``logprobs``, `Step.logprobs` of the reply carries each output token's log probability.
                ``structured_outputs`` with tools in schema format is refused (`UserError`; see `Session`).
            on_text: called with the answer's text as it is generated (not for tool calls); with ``logprobs``,
                each piece is a `TextPiece` carrying the log probabilities of the tokens since the last piece.
            on_first_token: called once, when the model's first output token arrives (TTFT's end; a
                front door sends its first chunk then, tool calls or not).
            on_tool_call: called with each `ToolCallDelta` as the model writes a tool call: the call's id and
                name first, then its arguments' JSON text piece by piece (joined: the call's arguments).
            on_reasoning: called with each `ReasoningDelta` (with a ``reasoning_parser``: the reasoning's text).

        A failed step (bad input, an engine error, cancellation) changes nothing in the session.
        """
        request = MessageRequest.build(
            self._config,
            messages,
            tools=tools,
            tool_choice=tool_choice,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop=stop,
            sampling=sampling,
        )
        return await self._step_request(
            request,
            on_text=on_text,
            on_first_token=on_first_token,
            on_tool_call=on_tool_call,
            on_reasoning=on_reasoning,
        )

    async def _step_request(
        self,
        request: MessageRequest,
        *,
        on_text: Callable[[str], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        on_tool_call: Callable[[ToolCallDelta], None] | None = None,
        on_reasoning: Callable[[ReasoningDelta], None] | None = None,
    ) -> StepReply:
        """`step` on a request already read (a pool reads each request once for all its sessions)."""
        home = self._require_home()
        step = functools.partial(self._step, request, on_text, on_first_token, on_tool_call, on_reasoning)
        if not home.is_current():
            return await home.call_async(step)
        return await step()

    def step_sync(self, messages: Sequence[Message | Mapping[str, Any]], **options: Unpack[StepOptions]) -> StepReply:
        """Blocking `step` (the same arguments), for a session opened with ``with``."""
        return self._require_home().call(functools.partial(self.step, messages, **options))

    def extends(self, messages: Sequence[Message | Mapping[str, Any]], *, tools: ToolsArgument = None) -> bool:
        """Whether ``messages`` extend what this session last answered in `step` (a front door routes by it)."""
        return self._extends_request(MessageRequest.build(self._config, messages, tools=tools))

    def _extends_request(self, request: MessageRequest) -> bool:
        """`extends`, for a request already read."""
        with self._lock:
            transcript = self._transcript
        return transcript is not None and transcript.new_messages(request.key, request.messages) is not None

    async def _step(
        self,
        request: MessageRequest,
        on_text: Callable[[str], None] | None,
        on_first_token: Callable[[], None] | None = None,
        on_tool_call: Callable[[ToolCallDelta], None] | None = None,
        on_reasoning: Callable[[ReasoningDelta], None] | None = None,
    ) -> StepReply:
        turn, continues = await self._begin_step(request)
        number = len(self._turns[-1].steps) + 1 if continues else 1
        context = self._step_context(request.step_config(self._parsers))
        reader = request.reader(self._parsers)
        watched = on_text is not None or on_tool_call is not None or on_reasoning is not None
        stream = reader.stream() if watched else None
        wants_logprobs = request.config.sampling.logprobs is not None
        pending: list[TokenLogprob] = []
        """Log probabilities of the tokens since the last piece of text given to ``on_text``."""
        try:
            step: Step | None = None
            async with aclosing(model_step(turn, number, context, json_schema=request.json_schema())) as events:
                async for event in events:
                    if isinstance(event, Step):
                        step = event
                        continue
                    if on_first_token is not None:
                        on_first_token()
                        on_first_token = None
                    if wants_logprobs and event.logprobs:
                        pending.extend(event.logprobs)
                    if stream is None:
                        continue
                    pieces = stream.feed(event.text, event.token_ids)
                    if on_reasoning is not None and pieces.reasoning:
                        on_reasoning(ReasoningDelta(turn=turn.number, step=number, text=pieces.reasoning))
                    if on_text is not None and (text := pieces.answer):
                        on_text(TextPiece(text, pending) if wants_logprobs else text)
                        pending = []
                    if on_tool_call is not None:
                        for piece in pieces.calls:
                            on_tool_call(tool_call_delta(turn.number, number, piece))
            assert step is not None
            reply = read_reply(request, step, reader)
            with self._lock:
                self._take(turn)
                self._transcript = Transcript(request.key, (*request.messages, reply.message))
                wall_s = time.perf_counter() - turn.started
                if continues:
                    last = self._turns[-1]
                    wall_s += last.wall_s
                    self._turns[-1] = TurnStats(turn=last.turn, steps=[*last.steps, step.stats], wall_s=wall_s)
                else:
                    self._turns.append(TurnStats(turn=turn.number, steps=[step.stats], wall_s=wall_s))
            return reply
        finally:
            self._end_turn(turn)

    async def _begin_step(self, request: MessageRequest) -> tuple[Turn, bool]:
        """Claim the session and make the step's conversation: the committed one extended, or a rebuilt one.

        Also says whether the step continues the last turn (the caller added only tool results)."""
        with self._lock:
            conversation = self._require_conversation()
            self._drop_abandoned_turn()
            if self._active is not None:
                raise SessionBusyError("a step is already running in this session; sessions take one at a time")
            transcript = self._transcript
            new = transcript.new_messages(request.key, request.messages) if transcript is not None else None
            continues = new is not None and not any(m.role == "user" for m in new) and bool(self._turns)
            number = len(self._turns) if continues else len(self._turns) + 1
            turn = Turn(number, conversation.copy(), self._pin, self._pin)
            self._pin, self._active = None, turn
        try:
            await self._release_pins()
            await self._ensure_engine(turn)
            if new is not None:
                turn.conversation.add_messages(model_messages(new, request.key.format))
            else:
                turn.conversation = rebuild(self._renderer_for(request.key), request.key, request.messages)
        except BaseException:
            self._end_turn(turn)
            raise
        return turn, continues

    def _renderer_for(self, key: TranscriptKey) -> ChatRenderer:
        if self._renderer is not None and self._renderer[0] == key:
            return self._renderer[1]
        native = template_tools({t.name: t for t in key.tools}) if key.tools and key.format == "native" else None
        system = Message(role="system", content=key.system) if key.system is not None else None
        renderer = ChatRenderer(self._tokenizer, system=system, tools=native)
        self._renderer = (key, renderer)
        return renderer

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
                raise SessionBusyError("a turn is already running in this session; sessions take one turn at a time")
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

    def _step_context(self, config: SessionConfig | None = None) -> StepContext:
        return StepContext(
            self.engine,
            config or self._config,
            self.mode in ("bidirectional", "auto"),
            self._discard_pin,
            placement="auto" if self.mode == "auto" else "prefill",
            resumed=self._resumed,
            parsers=self._parsers,
        )

    def _commit(self, turn: Turn) -> None:
        """Make a finished turn part of the session: its conversation, its pin, its stats."""
        with self._lock:
            if turn.result is None:
                raise UserError("this turn was abandoned and cannot be kept")
            self._take(turn)
            self._transcript = None
            self._turns.append(turn.result.stats)

    def _take(self, turn: Turn) -> None:
        """Make a finished turn's conversation and pin the session's (called with the lock held)."""
        if turn.ended or self._active is not turn:
            raise UserError("this turn was abandoned and cannot be kept")
        self._conversation = turn.conversation
        self._pin, turn.pin = turn.pin, None
        self._resumed = False
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
        replacement = make_engine(self._config)
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
            self._transcript = None
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
            self._transcript = None
            self._drop_pin()

    def snapshot(self) -> SessionSnapshot:
        """The conversation so far (finished turns), to `restore` later: after a restart, on another engine.

        The snapshot keeps the token ids (outputs exactly as generated), the messages, what `step`
        last answered and the stats; not the KV, which a restored session computes once.
        """
        with self._lock:
            conversation = self._readable_conversation()
            transcript = self._transcript
            return SessionSnapshot(
                model=self.engine.info.model_path.name,
                system=conversation.system,
                tokens=list(conversation.tokens),
                segments=conversation.saved(),
                transcript=save_transcript(transcript) if transcript is not None else None,
                turns=list(self._turns),
            )

    def restore(self, snapshot: SessionSnapshot) -> None:
        """Replace the conversation with a saved one (`snapshot`); the next step extends its tokens exactly.

        No KV comes with it: the next step computes the prompt once (its ``miss_reason`` is
        ``"resumed"``), later steps push back as usual. A snapshot of another model raises `UserError`.
        """
        model = self.engine.info.model_path.name
        if snapshot.model != model:
            raise UserError(f"this snapshot was made on model {snapshot.model!r}; the session runs {model!r}")
        transcript = load_transcript(snapshot.transcript) if snapshot.transcript is not None else None
        with self._lock:
            current = self._require_idle()
            renderer = (
                self._renderer_for(transcript.key)
                if transcript is not None
                else current.renderer.with_system(snapshot.system)
            )
            self._conversation = Conversation.loaded(
                renderer, system=snapshot.system, tokens=snapshot.tokens, segments=snapshot.segments
            )
            self._transcript = transcript
            self._turns = list(snapshot.turns)
            self._resumed = True
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
            twin._tokenizer, twin._transcript, twin._parsers = self._tokenizer, self._transcript, self._parsers
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


def make_engine(config: SessionConfig) -> Engine:
    """The engine a session (or a pool) starts for itself: the embedded pair, or one engine for ``colocated``."""
    mode = config.mode or "bidirectional"
    options = dict(config.engine_options)
    if mode == "colocated":
        return Colocated(config.model, **options)
    options.setdefault("bidirectional", mode in ("bidirectional", "auto"))
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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)

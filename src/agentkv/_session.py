"""`Session`: a conversation pinned to its KV on an engine, run turn by turn."""

from __future__ import annotations

import enum
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import anyio.to_thread

from ._conversation import ChatRenderer, Conversation, Message
from ._engines import Colocated, EmbeddedPair, Engine, EngineState, Sampling, StepDone, StepRequest, TokenDelta
from ._errors import ContextLengthError, InvalidMessageError, SessionClosedError, UserError
from ._home import LoopHome
from ._notebook import StartsInCells
from ._pinning import Pin, choose_handle, miss_after_step
from ._results import Event, Step, StepEnd, TextDelta, ToolCallEvent, ToolResultEvent, TurnEnd, TurnResult
from ._stats import SessionStats, StepStats, TurnStats
from ._tools import (
    Tool,
    ToolCall,
    ToolChoice,
    ToolFormat,
    ToolResult,
    check_tools,
    instructions,
    output_schema,
    parse_native_output,
    parse_output,
    result_message,
    run_tool_calls,
    template_tools,
)

__all__ = ["Mode", "Session"]

logger = logging.getLogger("agentkv")

Mode = Literal["bidirectional", "disaggregated", "colocated"]
_MODES: tuple[Mode, ...] = ("bidirectional", "disaggregated", "colocated")


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class Session(StartsInCells):
    """A multi-turn conversation on an engine, with its KV pinned between steps.

    Use it as a context manager: ``async with Session() as s`` on your event loop, or
    ``with Session() as s`` from synchronous code and notebooks (the engine then runs on an
    event loop of its own, and both ``s.run_sync(...)`` and ``await s.run(...)`` work).

    Args:
        engine: the engine to run on. An open one is shared (other sessions may use it; its
            owner closes it); an unopened one (``Session(engine=LaunchedPair())``) becomes the
            session's own: it opens with the session and closes with it.
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
        temperature: sampling temperature (0: greedy).
        seed: sampling seed.
        expiry_margin_s: a pin that expires within this many seconds is not pushed back.
        cache_salt: keep this session's cached KV apart: blocks cached under one salt never
            serve a request with another (vLLM ``cache_salt``), on P, D or a colocated engine.
            For tenants that must not share KV, and for measurements that must not help
            each other. Default: none (sessions with equal prefixes share blocks).
        engine_options: keyword arguments for the session's own engine (e.g. ``max_model_len``).
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
        if mode is not None and mode not in _MODES:
            raise UserError(f"mode must be one of {', '.join(_MODES)}, not {mode!r}")
        if engine is not None and (model is not None or engine_options):
            raise UserError("model= and engine_options= configure the session's own engine; not with engine=")
        if max_tokens < 1:
            raise UserError("max_tokens must be at least 1")
        if system is not None and not isinstance(system, str):
            raise InvalidMessageError(f"system must be a string, not {type(system).__name__}")
        if max_steps < 1:
            raise UserError("max_steps must be at least 1")
        self._tools = check_tools(tools)
        _check_choice(tool_choice, self._tools)
        self._tool_choice = tool_choice
        self._max_steps = max_steps
        if tool_format not in ("schema", "native"):
            raise UserError(f"tool_format must be 'schema' or 'native', not {tool_format!r}")
        if tool_format == "native" and tool_choice != "auto":
            raise UserError(
                "with tool_format='native' the model decides (tool_choice='auto'); "
                "forced calls need tool_format='schema'"
            )
        self._tool_format = tool_format
        if self._tools and tool_format == "schema":
            system = (system or "") + instructions(self._tools)
        self._engine = engine
        self._owns_engine = engine is None or engine.state is EngineState.UNOPENED
        self._engine_given = engine is not None
        self._model = model
        self._requested_mode = mode
        self._engine_options = dict(engine_options or {})
        self._system = Message(role="system", content=system) if system is not None else None
        self._sampling = Sampling(max_tokens=max_tokens, temperature=temperature, seed=seed)
        self._expiry_margin_s = expiry_margin_s
        self._cache_salt = cache_salt
        self._state = _State.UNOPENED
        self._home: LoopHome | None = None
        self._conversation: Conversation | None = None
        self._pin: Pin | None = None
        self._turns: list[TurnStats] = []
        self._busy = False
        self.mode: Mode = mode or "bidirectional"

    # ----------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        """Start the session (and its own engine). Prefer ``async with``."""
        if self._state is not _State.UNOPENED:
            raise SessionClosedError(f"the session is {self._state.value}; create a new one")
        try:
            engine = self._engine if self._engine is not None else self._make_engine()
            self._engine = engine
            if self._owns_engine:
                engine.home = self._home
                await engine.open()
            elif engine.state is not EngineState.OPEN:
                raise SessionClosedError(
                    f"the engine given to this session is {engine.state.value}; give an open or a new one"
                )
            self._home = engine.home
            self.mode = self._resolve_mode(engine)
            tokenizer = await anyio.to_thread.run_sync(load_tokenizer, str(engine.info.model_path))
            native_tools = template_tools(self._tools) if self._tools and self._tool_format == "native" else None
            renderer = ChatRenderer(tokenizer, system=self._system, tools=native_tools)
            self._conversation = Conversation(renderer, system=self._system)
        except BaseException:
            self._state = _State.CLOSED
            if self._owns_engine and self._engine is not None:
                await self._engine.aclose()
            raise
        self._state = _State.OPEN

    async def aclose(self) -> None:
        """Close the session, and its engine if it started one. Safe to call twice."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        if self._owns_engine and self._engine is not None:
            await self._engine.aclose()

    async def __aenter__(self) -> Session:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __enter__(self) -> Session:
        if self._engine is not None and not self._owns_engine:
            if self._engine.home is None or not self._engine.home.owns_thread:
                raise UserError("this engine was opened with `async with`: use `async with Session(...)` too")
            self._engine.home.call(self.open)
            return self
        self._home = LoopHome.start_thread()
        self._home.call_or_stop(self.open)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        """Whether the session takes turns (open, and not closed)."""
        return self._state is _State.OPEN

    def close(self) -> None:
        """Blocking `aclose`."""
        if self._state is _State.CLOSED:
            return
        home = self._require_home()
        home.call(self.aclose)
        if self._owns_engine:
            home.stop()

    def _make_engine(self) -> Engine:
        mode = self._requested_mode or "bidirectional"
        options = dict(self._engine_options)
        if mode == "colocated":
            return Colocated(self._model, **options)
        options.setdefault("bidirectional", mode == "bidirectional")
        return EmbeddedPair(self._model, **options)

    def _resolve_mode(self, engine: Engine) -> Mode:
        info = engine.info
        natural: Mode = (
            "colocated" if info.kind == "colocated" else ("bidirectional" if info.push_back else "disaggregated")
        )
        wanted = self._requested_mode or natural
        if wanted == "bidirectional" and not info.push_back:
            raise UserError(f"mode='bidirectional' needs an engine with push-back; this one is {natural}")
        if (wanted == "colocated") != (info.kind == "colocated") and info.kind != "scripted":
            raise UserError(f"mode={wanted!r} does not fit a {info.kind} engine")
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
        """The conversation so far (readable after close too)."""
        return self._readable_conversation().messages

    @property
    def token_ids(self) -> list[int]:
        """The conversation as the model sees it (a copy; readable after close too)."""
        return list(self._readable_conversation().tokens)

    @property
    def stats(self) -> SessionStats:
        """Statistics of every turn so far."""
        return SessionStats(mode=self.mode, turns=list(self._turns))

    # ----------------------------------------------------------------- running

    async def run(self, message: str, *, on_event: Callable[[Event], None] | None = None) -> TurnResult:
        """Send a user message; return the answer and every step's stats.

        If anything fails (bad input, an engine error, cancellation) the conversation is
        left as it was before the call.
        """
        home = self._require_home()
        if not home.is_current():
            return await home.call_async(self._run, message, on_event)
        return await self._run(message, on_event)

    async def _run(self, message: str, on_event: Callable[[Event], None] | None) -> TurnResult:
        result: TurnResult | None = None
        async for event in self._turn(message):
            if on_event is not None:
                on_event(event)
            if isinstance(event, TurnEnd):
                result = event.result
        assert result is not None
        return result

    def run_sync(self, message: str, *, on_event: Callable[[Event], None] | None = None) -> TurnResult:
        """Blocking `run`, for a session opened with ``with``. Ctrl-C cancels the turn cleanly."""
        return self._require_home().call(self._run, message, on_event)

    async def stream(self, message: str) -> AsyncIterator[Event]:
        """`run`, as events: text deltas and step ends as they happen, then the turn end."""
        if not self._require_home().is_current():
            raise UserError("stream() runs on the session's own event loop; use run(on_event=...) here")
        async for event in self._turn(message):
            yield event

    async def _turn(self, message: str) -> AsyncIterator[Event]:
        conversation = self._require_conversation()
        _check_message(message)
        if self._busy:
            raise UserError("a turn is already running in this session; sessions take one turn at a time")
        self._busy = True
        checkpoint = conversation.checkpoint()
        started = time.perf_counter()
        turn = len(self._turns) + 1
        try:
            await self._ensure_engine()
            conversation.add_messages([Message(role="user", content=message)])
            steps: list[Step] = []
            choice = self._tool_choice
            answer: str | None = None
            for number in range(1, self._max_steps + 1):
                forced_answer = number == self._max_steps
                schema = None
                if self._tools and self._tool_format == "schema":
                    schema = output_schema(self._tools, "none" if forced_answer else choice)
                step: Step | None = None
                async for event in self._model_step(turn, number, schema):
                    if isinstance(event, Step):
                        step = event
                    else:
                        yield event
                assert step is not None
                if not self._tools:
                    steps.append(step)
                    answer = step.text
                    break
                calls, answer, error = self._parse_calls(step.text, f"t{turn}s{number}", last=forced_answer)
                if answer is not None:
                    steps.append(step)
                    yield StepEnd(step=step)
                    break
                for call in calls:
                    yield ToolCallEvent(turn=turn, step=number, call=call)
                tools_started = time.perf_counter()
                results = (
                    await run_tool_calls(calls, self._tools)
                    if error is None
                    else [
                        ToolResult(
                            call_id=f"t{turn}s{number}",
                            name="agentkv",
                            content=f"error: {error}",
                            error="malformed_output",
                        )
                    ]
                )
                for result in results:
                    yield ToolResultEvent(turn=turn, step=number, result=result)
                step = step.model_copy(
                    update={
                        "tool_calls": calls,
                        "tool_results": results,
                        "stats": step.stats.model_copy(update={"tool_s": time.perf_counter() - tools_started}),
                    }
                )
                steps.append(step)
                yield StepEnd(step=step)
                conversation.add_messages(
                    [Message(role="tool", name=r.name, content=self._tool_message(r)) for r in results]
                )
                choice = "auto" if choice != "none" else choice  # a forced call is forced once per turn
            if not self._tools:
                yield StepEnd(step=steps[-1])
            assert answer is not None
            stats = TurnStats(turn=turn, steps=[s.stats for s in steps], wall_s=time.perf_counter() - started)
            bounded = bool(self._tools) and self._max_steps > 1 and len(steps) == self._max_steps
            stop_reason: Literal["answer", "max_steps"] = "max_steps" if bounded else "answer"
            turn_result = TurnResult(text=answer, steps=steps, stats=stats, stop_reason=stop_reason)
            self._turns.append(stats)
        except BaseException:
            conversation.restore(checkpoint)
            raise
        finally:
            self._busy = False
        yield TurnEnd(result=turn_result)

    def _parse_calls(self, text: str, call_prefix: str, *, last: bool) -> tuple[list[ToolCall], str | None, str | None]:
        """(tool calls, answer, error) from a step's output, in the session's tool format."""
        parse = parse_output if self._tool_format == "schema" else parse_native_output
        calls, answer, error = parse(text, call_prefix=call_prefix)
        if last and answer is None:  # the step bound: whatever the last step said is the answer; no calls run
            return [], text.strip(), None
        return calls, answer, error

    def _tool_message(self, result: ToolResult) -> str:
        """A tool result as the model reads it: raw content for native templates, JSON for schema mode."""
        return result.content if self._tool_format == "native" else result_message(result)

    async def _model_step(
        self, turn: int, number: int, json_schema: dict[str, Any] | None
    ) -> AsyncIterator[TextDelta | Step]:
        conversation = self._require_conversation()
        engine = self.engine
        prompt = list(conversation.tokens)
        max_model_len = engine.info.max_model_len
        if len(prompt) >= max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens; the model's context is {max_model_len}",
                prompt_tokens=len(prompt),
                max_model_len=max_model_len,
            )
        sampling = Sampling(
            max_tokens=min(self._sampling.max_tokens, max_model_len - len(prompt)),
            temperature=self._sampling.temperature,
            seed=self._sampling.seed,
            top_p=self._sampling.top_p,
            json_schema=json_schema,
        )
        handle, reason = choose_handle(
            self._pin, prompt, push_back=self.mode == "bidirectional", expiry_margin_s=self._expiry_margin_s
        )
        self._pin = None  # a handle is single-use, and an unforwarded pin is no longer ours to use
        request = StepRequest(
            request_id=f"agentkv-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            sampling=sampling,
            handle=handle,
            cache_salt=self._cache_salt,
        )
        done: StepDone | None = None
        async for event in engine.step(request):
            if isinstance(event, TokenDelta):
                yield TextDelta(turn=turn, step=number, text=event.text, token_ids=list(event.token_ids))
            else:
                done = event
        assert done is not None
        conversation.add_output(done.token_ids, done.text)
        if done.handle is not None:
            self._pin = Pin(done.handle, prompt + list(done.token_ids), done.handle_deadline)
        timings = done.timings
        stats = StepStats(
            turn=turn,
            step=number,
            ttft_s=timings.ttft_s,
            prefill_s=timings.prefill_s,
            kv_wait_s=timings.kv_wait_s,
            decode_s=timings.decode_s,
            prompt_tokens=len(prompt),
            local_hit_tokens=timings.local_hit_tokens,
            pulled_tokens=timings.pulled_tokens,
            computed_tokens=timings.computed_tokens,
            output_tokens=len(done.token_ids),
            handoff_tokens=timings.handoff_tokens,
            kv_bytes=timings.kv_bytes,
            kv_transfer_s=timings.kv_transfer_s,
            handle_forwarded=handle is not None,
            miss_reason=miss_after_step(
                handle,
                reason,
                prompt_tokens=len(prompt),
                local_hit_tokens=timings.local_hit_tokens,
                pulled_tokens=timings.pulled_tokens,
                declined=timings.pullback_declined,
            ),
        )
        yield Step(text=done.text, token_ids=list(done.token_ids), finish_reason=done.finish_reason, stats=stats)

    async def _ensure_engine(self) -> None:
        """Replace the session's own engine if it died; a shared engine is the caller's to replace."""
        engine = self.engine
        if not engine.is_dead:
            return
        if not self._owns_engine or self._engine_given:  # only an engine the session made is remade
            engine.check_open()
        logger.warning("agentkv: the session's engine died; starting a new one (the conversation is kept)")
        self._pin = None
        replacement = self._make_engine()
        replacement.home = self._home
        try:
            await replacement.open()
        except BaseException:
            await replacement.aclose()
            raise
        self._engine = replacement

    # ----------------------------------------------------------------- editing

    def rewind(self, turns: int = 1) -> None:
        """Drop the last ``turns`` turns from the conversation (and their stats)."""
        self._require_idle().rewind(turns)
        del self._turns[len(self._turns) - turns :]

    def replace_message(self, index: int, content: str) -> None:
        """Replace the content of message ``index`` of `messages`; later messages are kept.

        The tokens after the edit are re-rendered, so the next step's prompt no longer
        extends D's pin: the handle is not pushed back (``miss_reason="prefix_mismatch"``).
        """
        _check_message(content)
        self._require_idle().replace(index, content)

    def fork(self) -> Session:
        """A new open session on the same engine with a copy of this conversation.

        The fork has no pin (handles are single-use); its first step reuses the engine's
        prefix cache. Closing the fork leaves the engine running.
        """
        conversation = self._require_idle()
        twin = Session(
            engine=self.engine,
            mode=self.mode,
            tools=list(self._tools.values()),
            tool_choice=self._tool_choice,
            max_steps=self._max_steps,
            max_tokens=self._sampling.max_tokens,
            temperature=self._sampling.temperature,
            seed=self._sampling.seed,
            cache_salt=self._cache_salt,
            expiry_margin_s=self._expiry_margin_s,
        )
        twin._system = conversation.system
        twin._home = self._home
        twin._conversation = conversation.copy()
        twin._state = _State.OPEN
        return twin

    # ----------------------------------------------------------------- guards

    def _require_conversation(self) -> Conversation:
        if self._state is not _State.OPEN or self._conversation is None:
            raise SessionClosedError(f"the session is {self._state.value}; open it with `with` or `async with`")
        return self._conversation

    def _readable_conversation(self) -> Conversation:
        if self._conversation is None:
            raise SessionClosedError("the session was never opened: it has no conversation")
        return self._conversation

    def _require_idle(self) -> Conversation:
        conversation = self._require_conversation()
        if self._busy:
            raise UserError("the conversation cannot change while a turn runs")
        return conversation

    def _require_home(self) -> LoopHome:
        self._require_conversation()
        assert self._home is not None
        return self._home


def _check_choice(choice: ToolChoice, tools: dict[str, Tool]) -> None:
    if choice not in ("auto", "required", "none") and choice not in tools:
        raise UserError(f"tool_choice {choice!r} is neither auto, required, none nor one of the tools")
    if choice == "required" and not tools:
        raise UserError("tool_choice='required' needs tools")


def _check_message(message: object) -> None:
    if not isinstance(message, str):
        raise InvalidMessageError(f"a message must be a string, not {type(message).__name__}")
    if not message.strip():
        raise InvalidMessageError("a message must not be empty")


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_path: str) -> Any:
    """The model's Hugging Face tokenizer, loaded once per process (sessions only read it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
